"""The test contract of jaxbwd's ops, for any op with a registry entry (yours too).

Subclass :class:`OpContract` in a pytest file and set ``spec``::

    import jaxbwd.testing
    from mypkg.ops import SPEC            # an OpSpec, e.g. from jaxbwd.define_op(...).spec(...)

    class TestMyOp(jaxbwd.testing.OpContract):
        spec = SPEC

pytest then runs, for both implementations where the op has Pallas kernels (in interpret
mode on a machine without a GPU) and every dtype of ``spec.dtypes``:

1. the forward against ``spec.reference``;
2. the gradients against ``jax.vjp`` of the reference, with the kernels in the jaxpr;
3. float64 numerical gradients (``jax.test_util.check_grads``) of the XLA implementation;
4. ``jit``, ``vmap``, ``grad`` of ``vmap``, ``vmap`` of ``grad``, ``jax.checkpoint`` and
   ``lax.scan`` against a loop of single calls;
5. every kernel lowered for CUDA from this machine at the ``spec.lowering`` shapes;
6. every ``spec.bad_inputs`` raising its error naming the op;
7. the residual bytes within ``spec.residual_budget``;
8. ``jax.jvp``/``jax.linearize`` against the reference (jax >= 0.12), or, for an op declared
   without forward mode (``spec.forward_mode``), ``jax.jvp`` raising NotImplementedError;
9. grad of grad (reverse over reverse) against the reference.

jaxbwd's own ops also run ``tests/test_contract.py``, which adds more: determinism, strict
dtype promotion, 16-bit transforms, x64 tracing, ``jacfwd``, Hessian-vector products.

Each check is also a plain function (``check_forward(spec, impl, dtype)`` ...) for other
test runners. Needs ``chex`` and ``pytest`` (jaxbwd's ``test`` extra).

Arguments of the ``check_*`` functions (their docstrings say which each takes):

* ``spec``: the op's :class:`~jaxbwd.registry.OpSpec`;
* ``impl``: ``"xla"`` or ``"pallas"`` (the kernels run in interpret mode when the default
  backend is not a GPU);
* ``dtype``: ``"float32"``, ``"bfloat16"`` or ``"float16"``, the floating inputs' dtype
  (integer inputs keep theirs);
* ``example``: one of ``spec.examples`` (default: each of them, or the first where the
  docstring says so).

Each returns None and raises ``AssertionError`` (chex's or pytest's) when the op fails the
check; an error the op raises itself propagates. Tolerances, relative to
``max(1, max|reference|)``: float32 1e-5, bfloat16 2e-2, float16 2e-3 (``TOL``), each
against the float32 reference. Source: the references are the registry's plain-jnp
formulas differentiated by JAX's autodiff; check 3 is ``jax.test_util.check_grads``.
"""
from __future__ import annotations

from typing import Optional

import chex
import jax
import jax.numpy as jnp
import pytest

from jaxbwd import config
from jaxbwd.check import kernels_missing
from jaxbwd.pallas import _common as pallas_common
from jaxbwd.registry import Example, OpSpec
from jaxbwd.vjp import _derivatives

IMPLS = ("xla", "pallas")
TOL = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 2e-3}


# ------------------------------------------------------------------------------ helpers
def _interpret():
    return config.use(interpret=jax.default_backend() != "gpu" or config.interpret())


def _setup(ex: Example, dt, seed=0):
    args, kwargs = ex.make(jax.random.PRNGKey(seed), jnp.dtype(dt))
    return list(args), kwargs


def _cotangent(out, seed=1):
    return jax.random.normal(jax.random.PRNGKey(seed), out.shape, jnp.float32).astype(out.dtype)


def assert_close(actual, expected, tol: float) -> None:
    """``chex.assert_trees_all_close`` in float32 with ``atol = tol * max(1, max|expected|)``.

    Args:
      actual, expected: pytrees of arrays of the same structure and shapes (any dtypes).
      tol: the relative tolerance (also ``rtol``).

    Raises:
      AssertionError: an element differs by more than ``atol + rtol * |expected|``.
    """
    scale = max(1.0, max(float(jnp.max(jnp.abs(e.astype(jnp.float32)))) for e in jax.tree_util.tree_leaves(expected)))
    f32 = lambda t: jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), t)  # noqa: E731
    chex.assert_trees_all_close(f32(actual), f32(expected), atol=tol * scale, rtol=tol)


def _truth(spec, args, kwargs):
    """The reference on float32 copies of the (possibly 16-bit) inputs, and its diff args."""
    args32 = [a.astype(jnp.float32) if hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating) else a
              for a in args]
    return spec.bind(args32, kwargs, spec.reference), [args32[i] for i in spec.diff_argnums]


def implementations(spec: OpSpec) -> tuple[str, ...]:
    """The implementations the contract runs for ``spec`` (an OpSpec): ``("xla", "pallas")``,
    or ``("xla",)`` for an op whose backward is XLA by design. Raises nothing."""
    return IMPLS if spec.has_kernels else ("xla",)


# ------------------------------------------------------------------------------- checks
def check_forward(spec: OpSpec, impl: str, dtype: str, example: Optional[Example] = None) -> None:
    """1: the op's output equals the reference's (dtype, shape, values)."""
    for ex in [example] if example else spec.examples:
        args, kwargs = _setup(ex, dtype)
        with _interpret():
            out = spec.fn(*args, **kwargs, implementation=impl)
        want = spec.reference(*args, **kwargs)
        assert out.dtype == want.dtype and out.shape == want.shape, (spec.name, ex.name, out.dtype, want.dtype)
        f32, d32 = _truth(spec, args, kwargs)
        assert_close(out, f32(*d32), TOL[dtype])


def check_grads(spec: OpSpec, impl: str, dtype: str, example: Optional[Example] = None) -> None:
    """2: gradients equal autodiff of the reference, in the inputs' dtypes; on the Pallas path
    every kernel of ``spec.kernels`` is in the backward's jaxpr (no silent fallback)."""
    for ex in [example] if example else spec.examples:
        args, kwargs = _setup(ex, dtype)
        diff = [args[i] for i in spec.diff_argnums]
        f = spec.bind(args, kwargs, implementation=impl)
        with _interpret():
            out, vjp = jax.vjp(f, *diff)
            ct = _cotangent(out)
            grads = vjp(ct)
            missing = kernels_missing(f, diff, ct, spec.kernels) if impl == "pallas" else []
        for g, d in zip(grads, diff):
            assert g.dtype == d.dtype and g.shape == d.shape, (spec.name, ex.name, g.dtype, d.dtype)
            assert bool(jnp.all(jnp.isfinite(g.astype(jnp.float32)))), (spec.name, ex.name)
        f32, d32 = _truth(spec, args, kwargs)
        assert_close(grads, jax.vjp(f32, *d32)[1](ct.astype(jnp.float32)), TOL[dtype])
        assert not missing, f"kernels {missing} not in the backward of {spec.name}"


def check_numerical_grads(spec: OpSpec) -> None:
    """3: ``jax.test_util.check_grads`` in float64 on the XLA implementation (first example)."""
    from jax.test_util import check_grads as numerical

    with jax.enable_x64(True):
        args, kwargs = _setup(spec.examples[0], "float64")
        f = spec.bind(args, kwargs, implementation="xla")
        numerical(f, [args[i] for i in spec.diff_argnums], order=spec.check_grads_order or 1,
                  modes=("rev",), atol=1e-5, rtol=1e-5)


def check_transforms(spec: OpSpec, impl: str, dtype: str, n: int = 3) -> None:
    """4: jit(vmap), vmap of grad, grad of vmap (unbatched args' grads summed), checkpoint and
    scan against a Python loop of single calls (first example, ``batch_argnums`` batched)."""
    ex = spec.examples[0]
    per = [_setup(ex, dtype, seed=i)[0] for i in range(n)]
    args, kwargs = list(per[0]), _setup(ex, dtype)[1]
    for i in ex.batch_argnums:
        args[i] = jnp.stack([p[i] for p in per])
    tol = TOL[dtype]
    in_axes = tuple(0 if i in ex.batch_argnums else None for i in spec.diff_argnums)
    single = spec.bind(args, kwargs, implementation=impl)
    diff = [args[i] for i in spec.diff_argnums]
    pick = lambda k: [d[k] if ax == 0 else d for d, ax in zip(diff, in_axes)]  # noqa: E731
    argnums = tuple(range(len(diff)))

    def loss(*d):
        return jnp.sum(single(*d).astype(jnp.float32) ** 2)

    with _interpret():
        loop_out = jnp.stack([single(*pick(k)) for k in range(n)])
        loop_grads = [jax.grad(loss, argnums=argnums)(*pick(k)) for k in range(n)]
        vm = jax.vmap(single, in_axes=in_axes)
        assert_close(jax.jit(vm)(*diff), loop_out, tol)
        vg = jax.vmap(jax.grad(loss, argnums=argnums), in_axes=in_axes)(*diff)
        for j in argnums:
            assert_close(vg[j], jnp.stack([g[j] for g in loop_grads]), tol)
        gv = jax.grad(lambda *d: jnp.sum(vm(*d).astype(jnp.float32) ** 2), argnums=argnums)(*diff)
        for j, ax in enumerate(in_axes):
            want = (jnp.stack([g[j] for g in loop_grads]) if ax == 0
                    else sum(g[j].astype(jnp.float32) for g in loop_grads))
            assert gv[j].dtype == diff[j].dtype
            assert_close(gv[j], want, tol * (1 if ax == 0 else n))
        assert_close(jax.grad(jax.checkpoint(loss), argnums=argnums)(*pick(0)), loop_grads[0], tol)

        def step(carry, xs):
            xs = list(xs)
            d = [xs.pop(0) if ax == 0 else c for ax, c in zip(in_axes, carry)]
            return carry, jax.grad(loss, argnums=argnums)(*d)

        _, sg = jax.lax.scan(step, [d for d in diff], [d for d, ax in zip(diff, in_axes) if ax == 0])
        for j in argnums:
            assert_close(sg[j], jnp.stack([g[j] for g in loop_grads]), tol)


def check_lowering(spec: OpSpec) -> None:
    """5: the backward lowers for CUDA from any machine at every ``spec.lowering`` shape, with
    each of ``spec.kernels`` as a Triton kernel in the module."""
    assert spec.lowering, f"{spec.name} has kernels but no lowering shapes"
    for ex in spec.lowering:
        args, kwargs = ex.make(None, None)

        def bwd(*all_args):
            f = spec.bind(list(all_args), kwargs, implementation="pallas")
            diff = [all_args[i] for i in spec.diff_argnums]
            out, vjp = jax.vjp(f, *diff)
            return vjp(jnp.ones_like(out))

        with config.use(interpret=False):
            names = pallas_common.triton_kernel_names(pallas_common.lower_for_gpu(bwd, *args))
        for k in spec.kernels:
            assert k in names, f"{spec.name} ({ex.name}): kernel {k} missing from the CUDA module (found {names})"


def check_bad_inputs(spec: OpSpec) -> None:
    """6: each bad input raises its error type, matching its message, naming the op."""
    for bad in spec.bad_inputs:
        args, kwargs = bad.make()
        with pytest.raises(bad.error, match=bad.match) as info:
            spec.fn(*args, **kwargs)
        assert spec.name in str(info.value), (bad.name, str(info.value))


def check_residuals(spec: OpSpec, impl: str) -> None:
    """7: the arrays the forward saves for the backward fit ``spec.residual_budget`` bytes."""
    args, kwargs = _setup(spec.examples[0], "float32")
    f = spec.bind(args, kwargs, implementation=impl)
    with _interpret():
        _, vjp = jax.vjp(f, *[args[i] for i in spec.diff_argnums])
    saved = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(vjp) if hasattr(x, "dtype"))
    budget = spec.residual_budget(*args, **kwargs)
    assert saved <= budget, f"{spec.name} saves {saved} bytes, budget {budget}"


def check_jvp(spec: OpSpec, impl: str, dtype: str = "float32") -> None:
    """8: ``jax.jvp`` and ``jax.linearize`` equal the reference's (first example); for an op
    declared without forward mode, ``jax.jvp`` raises NotImplementedError naming it."""
    args, kwargs = _setup(spec.examples[0], dtype)
    diff = tuple(args[i] for i in spec.diff_argnums)
    f = spec.bind(args, kwargs, implementation=impl)
    if not spec.forward_mode:
        with _interpret(), pytest.raises(NotImplementedError, match=f"jaxbwd.{spec.name}: forward-mode"):
            jax.jvp(f, diff, diff)
        return
    f32, d32 = _truth(spec, args, kwargs)
    keys = jax.random.split(jax.random.PRNGKey(2), len(diff))
    ts = tuple(jax.random.normal(k, d.shape, jnp.float32).astype(d.dtype) for k, d in zip(keys, diff))
    with _interpret():
        out, t_out = jax.jvp(f, diff, ts)
        _, lin = jax.linearize(f, *diff)
        t_lin = lin(*ts)
    want, t_want = jax.jvp(f32, tuple(d32), tuple(t.astype(jnp.float32) for t in ts))
    assert_close(out, want, TOL[dtype])
    assert_close(t_out, t_want, TOL[dtype])
    assert_close(t_lin, t_want, TOL[dtype])


def check_second_order(spec: OpSpec, impl: str) -> None:
    """9: grad of grad (a gradient penalty, ``d/dx <grad(x), v>``) equals the reference's, in
    float32 (first example). Reverse over reverse: no tangent rule needed; on the Pallas path
    it differentiates the op's XLA backward formula (see ``define_op``'s ``pallas_backward``)."""
    args, kwargs = _setup(spec.examples[0], "float32")
    diff = tuple(args[i] for i in spec.diff_argnums)
    f = spec.bind(args, kwargs, implementation=impl)
    f32, d32 = _truth(spec, args, kwargs)
    w = _cotangent(jax.eval_shape(f, *diff)).astype(jnp.float32)
    keys = jax.random.split(jax.random.PRNGKey(3), len(diff))
    vs = tuple(jax.random.normal(k, d.shape, jnp.float32) for k, d in zip(keys, diff))
    argnums = tuple(range(len(diff)))

    def grad_of_grad(h, d):
        g = jax.grad(lambda *d: jnp.sum(h(*d).astype(jnp.float32) * w), argnums=argnums)
        return jax.grad(lambda *d: sum(jnp.vdot(a.astype(jnp.float32), v) for a, v in zip(g(*d), vs)),
                        argnums=argnums)(*d)

    with _interpret():
        got = grad_of_grad(f, diff)
    assert_close(got, grad_of_grad(f32, d32), 1e-4)


# ------------------------------------------------------------------------- pytest base
class OpContract:
    """Subclass with ``spec = <OpSpec>`` (class name starting with ``Test``) to run the contract:
    pytest collects one test per check (module docstring), parametrised over the
    implementations, skipping only what the spec declares absent (no kernels, no residual
    budget; forward mode on jax < 0.12)."""

    spec: OpSpec = None

    @pytest.fixture(params=IMPLS)
    def impl(self, request):
        if request.param not in implementations(self.spec):
            pytest.skip(f"{self.spec.name}: the backward is XLA by design (no Pallas kernel)")
        return request.param

    def test_forward_matches_reference(self, impl):
        for dt in self.spec.dtypes:
            check_forward(self.spec, impl, dt)

    def test_grads_match_autodiff_of_reference(self, impl):
        for dt in self.spec.dtypes:
            check_grads(self.spec, impl, dt)

    def test_numerical_grads_float64_xla(self):
        check_numerical_grads(self.spec)

    def test_transforms(self, impl):
        check_transforms(self.spec, impl, "float32")

    def test_kernels_lower_for_gpu(self):
        if not self.spec.has_kernels:
            pytest.skip(f"{self.spec.name}: no Pallas kernel to lower")
        check_lowering(self.spec)

    def test_bad_inputs_raise(self):
        check_bad_inputs(self.spec)

    def test_residuals_within_budget(self, impl):
        if self.spec.residual_budget is None:
            pytest.skip(f"{self.spec.name}: no residual budget declared")
        check_residuals(self.spec, impl)

    @pytest.mark.skipif(not _derivatives.FORWARD_MODE, reason="forward mode needs jax >= 0.12")
    def test_jvp_matches_reference(self, impl):
        check_jvp(self.spec, impl)

    def test_grad_of_grad_matches_reference(self, impl):
        check_second_order(self.spec, impl)
