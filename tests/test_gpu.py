"""Real compiled kernels on a GPU (skipped elsewhere): numerics at realistic shapes.

Each kernel op's Pallas gradients are compared with its XLA implementation at the
registry's "llm" benchmark shapes (or its first lowering shape), in the op's dtype.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxbwd import bench, config, registry

pytestmark = pytest.mark.gpu

SPECS = [s for s in registry.ops() if s.has_kernels]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_kernel_matches_xla_at_llm_shapes(spec):
    args, kwargs = bench.bench_inputs(spec, "llm", jax.random.PRNGKey(0))
    diff = [args[i] for i in spec.diff_argnums]

    def run(impl):
        f = spec.bind(args, kwargs, implementation=impl)
        out, vjp = jax.vjp(f, *diff)
        ct = jax.random.normal(jax.random.PRNGKey(1), out.shape, jnp.float32).astype(out.dtype)
        return out, vjp(ct)

    # f32 at "highest": the kernels' 3xTF32 dots and XLA's f32 dots agree to ~1e-6; at the
    # default (TF32 on both sides, different summation orders) they differ by ~1e-3.
    with config.use(interpret=False), jax.default_matmul_precision("highest"):
        got = jax.jit(lambda: run("pallas"))()
        want = jax.jit(lambda: run("xla"))()
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        a32, b32 = a.astype(jnp.float32), b.astype(jnp.float32)
        assert bool(jnp.all(jnp.isfinite(a32)))
        tol = 1e-4 if a.dtype == jnp.float32 else 3e-2
        err = float(jnp.max(jnp.abs(a32 - b32)) / jnp.maximum(1.0, jnp.max(jnp.abs(b32))))
        assert err <= tol, f"{spec.name}: scaled error {err:.2e} > {tol}"
