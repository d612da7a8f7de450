"""The DESIGN test contract, generated from the registry for every op and both implementations.

1 forward == reference; 2 grads == autodiff of the reference (and the kernel really ran);
3 float64 numerical gradients (XLA path); 4 jit/vmap/grad-of-vmap/vmap-of-grad/checkpoint/
scan; 5 lowering for CUDA at realistic shapes with the Triton kernels in the module;
6 bad input errors; 7 residual budget; plus bitwise-deterministic kernel gradients.
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxbwd import config, registry
from jaxbwd.pallas import _common as pallas_common

SPECS = registry.ops()
IMPLS = ("xla", "pallas")
TOL = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 2e-3}


def _cases(specs, with_dtype=True, first_only=False):
    out = []
    for s in specs:
        exs = s.examples[:1] if first_only else s.examples
        for ex in exs:
            for impl in IMPLS:
                if impl == "pallas" and not s.has_kernels:
                    continue
                dts = s.dtypes if with_dtype else ("float32",)
                for dt in dts:
                    out.append(pytest.param(s, ex, impl, dt, id=f"{s.name}-{ex.name}-{impl}-{dt}"))
    return out


def _setup(spec, ex, dt, seed=0):
    args, kwargs = ex.make(jax.random.PRNGKey(seed), jnp.dtype(dt))
    return list(args), kwargs


def _closure(fn, spec, args, kwargs, impl=None):
    """f(*diff_args) with the non-differentiable args fixed."""
    return spec.bind(args, kwargs, fn, **({} if impl is None else {"implementation": impl}))


def _cotangent(out, seed=1):
    return jax.random.normal(jax.random.PRNGKey(seed), out.shape, jnp.float32).astype(out.dtype)



def _close(actual, expected, tol):
    scale = max(1.0, max(float(jnp.max(jnp.abs(e.astype(jnp.float32)))) for e in jax.tree_util.tree_leaves(expected)))
    chex.assert_trees_all_close(
        jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), actual),
        jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), expected),
        atol=tol * scale, rtol=tol,
    )


def _truth_f32(spec, args, kwargs):
    """Reference forward and vjp in float32 on the (possibly bf16-rounded) inputs."""
    args32 = [a.astype(jnp.float32) if hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating) else a for a in args]
    f = _closure(spec.reference, spec, args32, kwargs)
    return f, [args32[i] for i in spec.diff_argnums]


@pytest.mark.parametrize("spec,ex,impl,dt", _cases(SPECS))
def test_forward_matches_reference(spec, ex, impl, dt):
    args, kwargs = _setup(spec, ex, dt)
    out = spec.fn(*args, **kwargs, implementation=impl)
    want = spec.reference(*args, **kwargs)
    assert out.dtype == want.dtype and out.shape == want.shape
    f32, diff32 = _truth_f32(spec, args, kwargs)
    _close(out, f32(*diff32), TOL[dt])


@pytest.mark.parametrize("spec,ex,impl,dt", _cases(SPECS))
def test_grads_match_autodiff_of_reference(spec, ex, impl, dt):
    args, kwargs = _setup(spec, ex, dt)
    diff = [args[i] for i in spec.diff_argnums]
    f = _closure(spec.fn, spec, args, kwargs, impl)
    out, vjp = jax.vjp(f, *diff)
    ct = _cotangent(out)
    grads = vjp(ct)
    for g, d in zip(grads, diff):
        assert g.dtype == d.dtype, f"{spec.name}: grad dtype {g.dtype} for input {d.dtype}"
        assert g.shape == d.shape
        assert bool(jnp.all(jnp.isfinite(g.astype(jnp.float32))))
    f32, diff32 = _truth_f32(spec, args, kwargs)
    _, vjp32 = jax.vjp(f32, *diff32)
    _close(grads, vjp32(ct.astype(jnp.float32)), TOL[dt])
    if impl == "pallas":
        jaxpr = str(jax.make_jaxpr(lambda *d: jax.vjp(f, *d)[1](ct))(*diff))
        for name in spec.kernels:
            assert f"name={name}" in jaxpr, f"kernel {name} not in the backward of {spec.name}"


@pytest.mark.parametrize("spec,ex,impl,dt", [c for c in _cases(SPECS, first_only=True) if c.values[2] == "pallas"])
def test_kernel_grads_are_deterministic(spec, ex, impl, dt):
    args, kwargs = _setup(spec, ex, dt)
    diff = [args[i] for i in spec.diff_argnums]
    f = _closure(spec.fn, spec, args, kwargs, impl)
    ct = _cotangent(jax.eval_shape(f, *diff))
    # Fresh executions of the same program: equal bits means no atomics or other
    # order-dependent reductions (meaningful on GPU; the same test runs there).
    g1 = jax.jit(lambda c: jax.vjp(f, *diff)[1](c))(ct)
    g2 = jax.jit(lambda c: jax.vjp(f, *diff)[1](c))(ct)
    for a, b in zip(g1, g2):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))


@pytest.mark.parametrize("spec", [s for s in SPECS if s.check_grads_order], ids=lambda s: s.name)
def test_numerical_grads_float64_xla(spec):
    from jax.test_util import check_grads

    with jax.enable_x64(True):
        args, kwargs = _setup(spec, spec.examples[0], "float64")
        f = _closure(spec.fn, spec, args, kwargs, "xla")
        check_grads(f, [args[i] for i in spec.diff_argnums], order=spec.check_grads_order, modes=("rev",), atol=1e-5, rtol=1e-5)


def _batched(spec, ex, dt, n=3):
    """n examples stacked along a new leading axis for ``batch_argnums``; others shared."""
    per = [_setup(spec, ex, dt, seed=i)[0] for i in range(n)]
    _, kwargs = _setup(spec, ex, dt)
    args = list(per[0])
    for i in ex.batch_argnums:
        args[i] = jnp.stack([p[i] for p in per])
    return args, kwargs


@pytest.mark.parametrize("spec,ex,impl,dt", _cases(SPECS, first_only=True))
def test_transforms(spec, ex, impl, dt):
    """jit, vmap (unbatched weights), vmap of grad, grad of vmap, checkpoint and scan agree."""
    args, kwargs = _batched(spec, ex, dt)
    tol = TOL[dt]
    in_axes = tuple(0 if i in ex.batch_argnums else None for i in spec.diff_argnums)
    nb = [i for i in range(len(args)) if i not in spec.diff_argnums]
    assert all(i in spec.diff_argnums for i in ex.batch_argnums) or nb

    single = spec.bind(args, kwargs, implementation=impl)  # one example, diff args only

    diff = [args[i] for i in spec.diff_argnums]
    n = diff[spec.diff_argnums.index(ex.batch_argnums[0])].shape[0]
    pick = lambda k: [d[k] if ax == 0 else d for d, ax in zip(diff, in_axes)]

    def loss(*d):
        return jnp.sum(single(*d).astype(jnp.float32) ** 2)

    loop_out = jnp.stack([single(*pick(k)) for k in range(n)])
    loop_grads = [jax.grad(loss, argnums=tuple(range(len(diff))))(*pick(k)) for k in range(n)]

    vm = jax.vmap(single, in_axes=in_axes)
    _close(jax.jit(vm)(*diff), loop_out, tol)
    # vmap of grad: per-example grads, unbatched weights get one grad per example.
    vg = jax.vmap(jax.grad(loss, argnums=tuple(range(len(diff)))), in_axes=in_axes)(*diff)
    for j in range(len(diff)):
        _close(vg[j], jnp.stack([g[j] for g in loop_grads]), tol)
    # grad of vmap: unbatched weights' grads are summed over the batch.
    gv = jax.grad(lambda *d: jnp.sum(vm(*d).astype(jnp.float32) ** 2), argnums=tuple(range(len(diff))))(*diff)
    for j, ax in enumerate(in_axes):
        want = jnp.stack([g[j] for g in loop_grads]) if ax == 0 else sum(g[j].astype(jnp.float32) for g in loop_grads)
        assert gv[j].dtype == diff[j].dtype
        _close(gv[j], want, tol * (1 if ax == 0 else n))
    # checkpoint
    gc = jax.grad(jax.checkpoint(loss), argnums=tuple(range(len(diff))))(*pick(0))
    _close(gc, loop_grads[0], tol)

    # scan over the batch, unbatched args carried; bf16 grads come back as bf16.
    def step(carry, xs):
        d = [xs.pop(0) if ax == 0 else c for ax, c in zip(in_axes, carry)]
        g = jax.grad(loss, argnums=tuple(range(len(diff))))(*d)
        return carry, g

    carry = [d for d, ax in zip(diff, in_axes)]
    xs = [d for d, ax in zip(diff, in_axes) if ax == 0]
    _, sg = jax.lax.scan(step, carry, xs)
    for j in range(len(diff)):
        assert sg[j].dtype == diff[j].dtype
        _close(sg[j], jnp.stack([g[j] for g in loop_grads]), tol)


def _lowering_cases():
    return [
        pytest.param(s, ex, id=f"{s.name}-{ex.name}") for s in SPECS if s.has_kernels for ex in s.lowering
    ]


@pytest.mark.parametrize("spec,ex", _lowering_cases())
def test_kernels_lower_for_gpu(spec, ex):
    args, kwargs = ex.make(None, None)
    diff_idx = spec.diff_argnums

    def bwd(*all_args):
        f = _closure(spec.fn, spec, list(all_args), kwargs, "pallas")
        diff = [all_args[i] for i in diff_idx]
        out, vjp = jax.vjp(f, *diff)
        return vjp(jnp.ones_like(out))

    with config.use(interpret=False):
        text = pallas_common.lower_for_gpu(bwd, *args)
    names = pallas_common.triton_kernel_names(text)
    for k in spec.kernels:
        assert k in names, f"{spec.name}: kernel {k} missing from the CUDA module (found {names})"


def test_every_kernel_op_has_lowering_shapes():
    for s in SPECS:
        assert not s.has_kernels or s.lowering, f"{s.name} has kernels but no lowering shapes"


@pytest.mark.parametrize(
    "spec,bad", [pytest.param(s, b, id=f"{s.name}-{b.name}") for s in SPECS for b in s.bad_inputs]
)
def test_bad_input_raises(spec, bad):
    args, kwargs = bad.make()
    with pytest.raises(bad.error, match=bad.match) as info:
        spec.fn(*args, **kwargs)
    assert spec.name in str(info.value)


@pytest.mark.parametrize(
    "spec,impl",
    [pytest.param(s, i, id=f"{s.name}-{i}") for s in SPECS if s.residual_budget for i in IMPLS
     if i == "xla" or s.has_kernels],
)
def test_residuals_within_budget(spec, impl):
    args, kwargs = _setup(spec, spec.examples[0], "float32")
    f = _closure(spec.fn, spec, args, kwargs, impl)
    _, vjp = jax.vjp(f, *[args[i] for i in spec.diff_argnums])
    saved = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(vjp) if hasattr(x, "dtype"))
    budget = spec.residual_budget(*args, **kwargs)
    assert saved <= budget, f"{spec.name} saves {saved} bytes, budget {budget}"
