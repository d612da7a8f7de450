"""The DESIGN test contract, generated from the registry for every op and both implementations.

1 forward == reference; 2 grads == autodiff of the reference (and the kernel really ran);
3 float64 numerical gradients (XLA path); 4 jit/vmap/grad-of-vmap/vmap-of-grad/checkpoint/
scan; 5 lowering for CUDA at realistic shapes with the Triton kernels in the module;
6 bad input errors; 7 residual budget; plus bitwise-deterministic kernel gradients (GPU) and
programs of a grid independent of each other (interpret mode, each program alone).
"""
from __future__ import annotations

import contextlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxbwd import config, registry, testing
from jaxbwd.vjp import _derivatives as derivatives
from jaxbwd.pallas import _common as pallas_common

SPECS = registry.ops()
IMPLS = ("xla", "pallas")
TOL = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 2e-3}


def _cases(specs, with_dtype=True, first_only=False, dtypes=None):
    out = []
    for s in specs:
        exs = s.examples[:1] if first_only else s.examples
        for ex in exs:
            for impl in IMPLS:
                if impl == "pallas" and not s.has_kernels:
                    continue
                dts = dtypes or (s.dtypes if with_dtype else ("float32",))
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


# float16 too, on each op's first example: its own tolerance, and its narrow range (the
# other contract tests keep to the spec's dtypes).
@pytest.mark.parametrize("spec,ex,impl,dt", _cases(SPECS) + _cases(SPECS, first_only=True, dtypes=("float16",)))
def test_forward_and_grads_match_reference(spec, ex, impl, dt):
    """The op's output (dtype and shape as the reference's; values as the float32 reference
    on the same inputs) and its VJP against autodiff of the float32 reference."""
    args, kwargs = _setup(spec, ex, dt)
    diff = [args[i] for i in spec.diff_argnums]
    f = _closure(spec.fn, spec, args, kwargs, impl)
    out, vjp = jax.vjp(f, *diff)
    want = jax.eval_shape(lambda: spec.reference(*args, **kwargs))
    assert out.dtype == want.dtype and out.shape == want.shape
    ct = _cotangent(out)
    grads = vjp(ct)
    for g, d in zip(grads, diff):
        assert g.dtype == d.dtype, f"{spec.name}: grad dtype {g.dtype} for input {d.dtype}"
        assert g.shape == d.shape
        assert bool(jnp.all(jnp.isfinite(g.astype(jnp.float32))))
    f32, diff32 = _truth_f32(spec, args, kwargs)
    out32, vjp32 = jax.vjp(f32, *diff32)
    _close(out, out32, TOL[dt])
    _close(grads, vjp32(ct.astype(jnp.float32)), TOL[dt])
    if impl == "pallas":
        jaxpr = str(jax.make_jaxpr(lambda *d: jax.vjp(f, *d)[1](ct))(*diff))
        for name in spec.kernels:
            assert f"name={name}" in jaxpr, f"kernel {name} not in the backward of {spec.name}"


# GPU only: in interpret mode on CPU every kernel is sequential, so equal bits prove nothing.
@pytest.mark.gpu
@pytest.mark.parametrize("spec,ex,impl,dt", [c for c in _cases(SPECS, first_only=True) if c.values[2] == "pallas"])
def test_kernel_grads_are_deterministic(spec, ex, impl, dt):
    args, kwargs = _setup(spec, ex, dt)
    diff = [args[i] for i in spec.diff_argnums]
    f = _closure(spec.fn, spec, args, kwargs, impl)
    ct = _cotangent(jax.eval_shape(f, *diff))
    # Fresh executions of the same compiled kernels: equal bits means no atomics or other
    # order-dependent reductions.
    with config.use(interpret=False):
        bwd = jax.jit(lambda c: jax.vjp(f, *diff)[1](c))
        g1, g2 = bwd(ct), bwd(ct)
    for a, b in zip(g1, g2):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))


# A GPU runs a grid's programs concurrently in no fixed order; interpret mode runs them one
# after another, so a write-write race, a read of another program's output or an unwritten
# output element gives right answers here. Each program run alone shows them (small tiles,
# so that every kernel has several programs).
@pytest.mark.parametrize("spec", [s for s in SPECS if s.has_kernels], ids=lambda s: s.name)
def test_programs_independent(spec):
    testing.check_programs_independent(spec)


# Interpret mode clamps a gather's indices and drops a scatter's out-of-range ones, so a load
# or store whose mask lets a lane past a tail gives right answers here and reads or writes
# another buffer on a GPU.
@pytest.mark.parametrize("spec", [s for s in SPECS if s.has_kernels], ids=lambda s: s.name)
def test_loads_and_stores_in_bounds(spec):
    checked = testing.check_in_bounds(spec)
    want = set(spec.kernels) | (set(spec.jvp_kernels) if spec.forward_mode and derivatives.FORWARD_MODE else set())
    assert want <= checked, f"{spec.name}: kernels never launched by its examples: {sorted(want - checked)}"


@pytest.mark.parametrize("spec", [s for s in SPECS if s.check_grads_order], ids=lambda s: s.name)
def test_numerical_grads_float64_xla(spec):
    from jax.test_util import check_grads

    with jax.enable_x64(True):
        args, kwargs = _setup(spec, spec.examples[0], "float64")
        f = _closure(spec.fn, spec, args, kwargs, "xla")
        check_grads(f, [args[i] for i in spec.diff_argnums], order=spec.check_grads_order, modes=("rev",), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("spec", [s for s in SPECS if s.has_kernels], ids=lambda s: s.name)
def test_kernels_trace_under_x64(spec):
    """With ``jax_enable_x64`` the kernels' index arithmetic stays int32 (a Python int mixed
    into ``lax.div`` became int64 there and failed to trace): forward and backward of the
    first example, float32 inputs, lowered with the kernel bodies traced (interpret mode)."""
    with jax.enable_x64(True):
        args, kwargs = _setup(spec, spec.examples[0], "float32")
        diff = [args[i] for i in spec.diff_argnums]
        f = _closure(spec.fn, spec, args, kwargs, "pallas")
        ct = _cotangent(jax.eval_shape(f, *diff))
        with config.use(interpret=True):
            jax.jit(lambda *d: jax.vjp(f, *d)[1](ct)).lower(*diff)


def _batched(spec, ex, dt, n=3):
    """n examples stacked along a new leading axis for ``batch_argnums``; others shared."""
    per = [_setup(spec, ex, dt, seed=i)[0] for i in range(n)]
    _, kwargs = _setup(spec, ex, dt)
    args = list(per[0])
    for i in ex.batch_argnums:
        args[i] = jnp.stack([p[i] for p in per])
    return args, kwargs


def _transform_setup(spec, ex, impl, dt):
    """(diff args batched along axis 0 where ``ex.batch_argnums`` says, their in_axes, the
    op on the diff args, a scalar loss of it, the loss's argnums) for the transform tests."""
    args, kwargs = _batched(spec, ex, dt)
    in_axes = tuple(0 if i in ex.batch_argnums else None for i in spec.diff_argnums)
    nb = [i for i in range(len(args)) if i not in spec.diff_argnums]
    assert all(i in spec.diff_argnums for i in ex.batch_argnums) or nb
    single = spec.bind(args, kwargs, implementation=impl)  # one example, diff args only
    diff = [args[i] for i in spec.diff_argnums]

    def loss(*d):
        return jnp.sum(single(*d).astype(jnp.float32) ** 2)

    return diff, in_axes, single, loss, tuple(range(len(diff)))


def _scan_grads(loss, argn, diff, in_axes):
    """Per-example grads from a lax.scan over the batch, unbatched args carried."""
    def step(carry, xs):
        d = [xs.pop(0) if ax == 0 else c for ax, c in zip(in_axes, carry)]
        return carry, jax.grad(loss, argnums=argn)(*d)

    carry = [d for d, ax in zip(diff, in_axes)]
    return jax.lax.scan(step, carry, [d for d, ax in zip(diff, in_axes) if ax == 0])[1]


# Values in float32; test_transforms_keep_dtypes traces the same transforms in the narrow
# dtypes, and each dtype's values are checked by test_forward_and_grads_match_reference.
@pytest.mark.parametrize("spec,ex,impl,dt", _cases(SPECS, with_dtype=False, first_only=True))
def test_transforms(spec, ex, impl, dt):
    """jit, vmap (unbatched weights), vmap of grad, grad of vmap, checkpoint and scan agree."""
    diff, in_axes, single, loss, argn = _transform_setup(spec, ex, impl, dt)
    tol = TOL[dt]
    n = diff[spec.diff_argnums.index(ex.batch_argnums[0])].shape[0]
    pick = lambda k: [d[k] if ax == 0 else d for d, ax in zip(diff, in_axes)]

    loop_out = jnp.stack([single(*pick(k)) for k in range(n)])
    loop_grads = [jax.grad(loss, argnums=argn)(*pick(k)) for k in range(n)]

    vm = jax.vmap(single, in_axes=in_axes)
    _close(jax.jit(vm)(*diff), loop_out, tol)
    # vmap of grad: per-example grads, unbatched weights get one grad per example.
    vg = jax.vmap(jax.grad(loss, argnums=argn), in_axes=in_axes)(*diff)
    for j in range(len(diff)):
        _close(vg[j], jnp.stack([g[j] for g in loop_grads]), tol)
    # grad of vmap: unbatched weights' grads are summed over the batch.
    gv = jax.grad(lambda *d: jnp.sum(vm(*d).astype(jnp.float32) ** 2), argnums=argn)(*diff)
    for j, ax in enumerate(in_axes):
        want = jnp.stack([g[j] for g in loop_grads]) if ax == 0 else sum(g[j].astype(jnp.float32) for g in loop_grads)
        assert gv[j].dtype == diff[j].dtype
        _close(gv[j], want, tol * (1 if ax == 0 else n))
    # checkpoint
    gc = jax.grad(jax.checkpoint(loss), argnums=argn)(*pick(0))
    _close(gc, loop_grads[0], tol)
    # scan over the batch
    sg = _scan_grads(loss, argn, diff, in_axes)
    for j in range(len(diff)):
        assert sg[j].dtype == diff[j].dtype
        _close(sg[j], jnp.stack([g[j] for g in loop_grads]), tol)


@pytest.mark.parametrize("spec,ex,impl,dt", [c for c in _cases(SPECS, first_only=True) if c.values[3] != "float32"])
def test_transforms_keep_dtypes(spec, ex, impl, dt):
    """bf16/f16 under vmap, vmap of grad, grad of vmap, checkpoint and scan: outputs and
    every grad keep their dtypes and shapes (traced, not run)."""
    diff, in_axes, single, loss, argn = _transform_setup(spec, ex, impl, dt)
    vm = jax.vmap(single, in_axes=in_axes)
    y = jax.eval_shape(vm, *diff)
    assert y.dtype == jax.eval_shape(single, *[d[0] if ax == 0 else d for d, ax in zip(diff, in_axes)]).dtype
    grads = {
        "vmap of grad": jax.vmap(jax.grad(loss, argnums=argn), in_axes=in_axes),
        "grad of vmap": jax.grad(lambda *d: jnp.sum(vm(*d).astype(jnp.float32) ** 2), argnums=argn),
        "scan": lambda *d: _scan_grads(loss, argn, list(d), in_axes),
        "checkpoint": jax.vmap(jax.grad(jax.checkpoint(loss), argnums=argn), in_axes=in_axes),
    }
    for name, fn in grads.items():
        gs = jax.eval_shape(fn, *diff)
        for j, ax in enumerate(in_axes):
            assert gs[j].dtype == diff[j].dtype, (name, j, gs[j].dtype, diff[j].dtype)
            if name == "grad of vmap" or ax == 0:
                assert gs[j].shape == diff[j].shape, (name, j)


@pytest.mark.parametrize("spec,ex,impl,dt", [c for c in _cases(SPECS, first_only=True) if c.values[3] != "float32"])
def test_strict_dtype_promotion(spec, ex, impl, dt):
    """Under ``jax.numpy_dtype_promotion("strict")`` (no implicit bf16/f16 -> f32) the op's
    forward, VJP and, with forward mode, JVP trace in 16-bit (traced, not run): every widening
    inside an op is an explicit cast."""
    args, kwargs = _setup(spec, ex, dt)
    diff = [args[i] for i in spec.diff_argnums]
    f = _closure(spec.fn, spec, args, kwargs, impl)
    with jax.numpy_dtype_promotion("strict"):
        out, grads = jax.eval_shape(lambda *d: (lambda o, vjp: (o, vjp(o)))(*jax.vjp(f, *d)), *diff)
        assert out.dtype == jax.eval_shape(f, *diff).dtype
        assert [g.dtype for g in grads] == [d.dtype for d in diff]
        if derivatives.FORWARD_MODE:
            _, t = jax.eval_shape(lambda *d: jax.jvp(f, d, d), *diff)
            assert t.dtype == out.dtype


@pytest.mark.parametrize("mode", ["rank-raise", "x64-strict"])
@pytest.mark.parametrize("spec,ex,impl,dt", [c for c in _cases(SPECS, first_only=True) if c.values[3] == "float32"])
def test_strict_user_settings(spec, ex, impl, dt, mode):
    """The op traces under the strict settings a user may turn on, as JAX's own ops do:
    ``jax.numpy_rank_promotion("raise")`` (every broadcast inside an op is of equal ranks)
    and ``jax_enable_x64`` with strict dtype promotion (index arithmetic never mixes int32
    with x64's int64). Forward, VJP and, with forward mode, JVP, lowered with the kernel
    bodies traced (interpret mode), nothing run."""
    with contextlib.ExitStack() as stack, config.use(interpret=True):
        if mode == "x64-strict":  # the arguments made under x64 too: int64 labels, ids, positions
            stack.enter_context(jax.enable_x64(True))
        args, kwargs = _setup(spec, ex, dt)
        diff = [args[i] for i in spec.diff_argnums]
        f = _closure(spec.fn, spec, args, kwargs, impl)
        ct = _cotangent(jax.eval_shape(f, *diff))
        stack.enter_context(jax.numpy_rank_promotion("raise") if mode == "rank-raise"
                            else jax.numpy_dtype_promotion("strict"))
        jax.jit(lambda *d: jax.vjp(f, *d)[1](ct)).lower(*diff)
        if derivatives.FORWARD_MODE and spec.forward_mode:
            jax.jit(lambda *d: jax.jvp(f, d, d)).lower(*diff)


def _lowering_cases():
    return [
        pytest.param(s, ex, id=f"{s.name}-{ex.name}") for s in SPECS if s.has_kernels for ex in s.lowering
    ]


@pytest.mark.parametrize("spec,ex", _lowering_cases())
def test_kernels_lower_for_gpu(spec, ex):
    # the backward with spec.kernels, and the op alone with spec.primal_kernels
    testing.check_lowering(spec, ex)


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


@pytest.mark.parametrize("dt", ["float32", "float16"])  # float16: a residual may be kept wider
@pytest.mark.parametrize(
    "spec,impl",
    [pytest.param(s, i, id=f"{s.name}-{i}") for s in SPECS if s.residual_budget for i in IMPLS
     if i == "xla" or s.has_kernels],
)
def test_residuals_within_budget(spec, impl, dt):
    args, kwargs = _setup(spec, spec.examples[0], dt)
    f = _closure(spec.fn, spec, args, kwargs, impl)
    _, vjp = jax.vjp(f, *[args[i] for i in spec.diff_argnums])
    saved = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(vjp) if hasattr(x, "dtype"))
    budget = spec.residual_budget(*args, **kwargs)
    assert saved <= budget, f"{spec.name} saves {saved} bytes, budget {budget}"


def _stacked_residual_bytes(loss, diff, length):
    """Bytes that ``jax.grad(loss)`` stacks per iteration in its forward ``lax.scan`` (of
    ``length``): what the backward scan reads back."""
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=tuple(range(len(diff)))))(*diff)
    scans = [e for e in jaxpr.eqns if e.primitive.name == "scan" and not e.params["reverse"]
             and e.params["length"] == length]
    assert len(scans) == 1, [e.primitive.name for e in jaxpr.eqns]
    return sum(v.aval.size * v.aval.dtype.itemsize for v in scans[0].outvars
               if v.aval.ndim and v.aval.shape[0] == length)


@pytest.mark.parametrize("spec", [pytest.param(s, id=s.name) for s in SPECS if s.has_kernels])
def test_scan_stacks_no_more_residuals_on_the_kernel_path(spec):
    # An op applied in a scan body to a scanned first input and loop-invariant others (a
    # weight, shared keys): the kernel path stacks what the XLA path stacks per iteration,
    # not a copy of each input its fwd rule saves.
    args, kwargs = _setup(spec, spec.examples[0], "float32")
    diff = tuple(args[i] for i in spec.diff_argnums)
    diff = (jnp.stack([diff[0]] * 3),) + diff[1:]
    stacked = {}
    for impl in IMPLS:
        f = _closure(spec.fn, spec, args, kwargs, impl)

        def loss(xs, *rest, f=f):
            body = lambda c, x: (c + jnp.sum(f(x, *rest).astype(jnp.float32)), None)  # noqa: E731
            return jax.lax.scan(body, jnp.float32(0), xs)[0]

        with config.use(interpret=True):
            stacked[impl] = _stacked_residual_bytes(loss, diff, 3)
    assert stacked["pallas"] <= stacked["xla"], stacked


# ------------------------------------------------------------------ forward mode and second order
# Every op runs under jax.jvp / linearize / jacfwd and second order (jvp of grad, grad of
# grad), on both implementations: the kernel path's backward is differentiated through the
# op's XLA formula. First example per op; the second-order cases in float32 only.
pytestmark_fwd = pytest.mark.skipif(not derivatives.FORWARD_MODE, reason="forward mode needs jax >= 0.12")


def _tangents(diff, seed=2):
    keys = jax.random.split(jax.random.PRNGKey(seed), len(diff))
    return tuple(jax.random.normal(k, d.shape, jnp.float32).astype(d.dtype) for k, d in zip(keys, diff))


def _fwd_setup(spec, ex, impl, dt):
    args, kwargs = _setup(spec, ex, dt)
    diff = [args[i] for i in spec.diff_argnums]
    f = _closure(spec.fn, spec, args, kwargs, impl)
    f32, diff32 = _truth_f32(spec, args, kwargs)
    return f, tuple(diff), f32, tuple(diff32)


@pytestmark_fwd
@pytest.mark.parametrize("spec,ex,impl,dt", _cases(SPECS, first_only=True))
def test_jvp_and_linearize_match_reference(spec, ex, impl, dt):
    f, diff, f32, diff32 = _fwd_setup(spec, ex, impl, dt)
    ts = tuple(_tangents(diff))
    out, t_out = jax.jvp(f, diff, ts)
    want, t_want = jax.jvp(f32, diff32, tuple(t.astype(jnp.float32) for t in ts))
    assert t_out.dtype == out.dtype and t_out.shape == out.shape
    _close(out, want, TOL[dt])
    _close(t_out, t_want, TOL[dt])
    # jit, and linearize evaluated at a second tangent too (the linear map is reusable).
    _close(jax.jit(lambda *p: jax.jvp(f, p, ts)[1])(*diff), t_want, TOL[dt])
    out_l, lin = jax.linearize(f, *diff)
    _close(out_l, want, TOL[dt])
    _close(lin(*ts), t_want, TOL[dt])
    ts2 = _tangents(diff, seed=3)
    _close(lin(*ts2), jax.jvp(f32, diff32, tuple(t.astype(jnp.float32) for t in ts2))[1], TOL[dt])


@pytestmark_fwd
@pytest.mark.parametrize("spec,ex", [pytest.param(s, ex, id=f"{s.name}-{ex.name}") for s in SPECS if s.jvp_kernels
                                     for ex in s.examples[1:]])
def test_jvp_kernel_other_examples(spec, ex):
    """The forward-mode kernel on the examples the first-example cases above skip."""
    f, diff, f32, diff32 = _fwd_setup(spec, ex, "pallas", "float32")
    ts = tuple(_tangents(diff))
    _close(jax.jvp(f, tuple(diff), ts)[1], jax.jvp(f32, tuple(diff32), ts)[1], TOL["float32"])


def _subspace(f, diff, k=3, seed=4):
    """``g(c) = f(diff + sum_i c_i v_i)``: a small input space, so jacfwd stays cheap."""
    dirs = [_tangents(diff, seed=seed + i) for i in range(k)]

    def g(c):
        return f(*[d + sum(c[i] * dirs[i][j].astype(d.dtype) for i in range(k)).astype(d.dtype)
                   for j, d in enumerate(diff)])

    return g


@pytestmark_fwd
@pytest.mark.parametrize("spec,ex,impl,dt", _cases(SPECS, with_dtype=False, first_only=True))
def test_jacfwd_and_vmap_of_jvp(spec, ex, impl, dt):
    f, diff, f32, diff32 = _fwd_setup(spec, ex, impl, dt)
    c0 = jnp.zeros((3,), jnp.float32)
    _close(jax.jacfwd(_subspace(f, diff))(c0), jax.jacrev(_subspace(f32, diff32))(c0), TOL[dt])
    # vmap of jvp over a batch of tangents, against one jvp per tangent.
    tb = [jnp.stack([t, 2 * t]) for t in _tangents(diff)]
    vj = jax.vmap(lambda *t: jax.jvp(f, diff, t)[1])(*tb)
    _close(vj, jnp.stack([jax.jvp(f32, diff32, tuple(t[i] for t in tb))[1] for i in range(2)]), TOL[dt])


@pytestmark_fwd
@pytest.mark.parametrize("spec,ex,impl,dt", _cases(SPECS, with_dtype=False, first_only=True))
def test_nested_forward_mode(spec, ex, impl, dt):
    """Forward mode nested in itself and in vmaps: jacfwd of jacfwd, jvp under two vmaps
    (the op's inputs batched twice), and linearize of a function in which the op's inputs
    are constants (its tangent is a symbolic zero)."""
    f, diff, f32, diff32 = _fwd_setup(spec, ex, impl, dt)
    out = jax.eval_shape(f, *diff)
    loss, loss32 = (_scalar_loss(h, out) for h in (f, f32))
    g, g32 = _subspace(loss, diff), _subspace(loss32, diff32)
    c0 = jnp.zeros((3,), jnp.float32)
    _close(jax.jacfwd(jax.jacfwd(g))(c0), jax.jacrev(jax.jacrev(g32))(c0), 1e-4)
    cs = 0.1 * jax.random.normal(jax.random.PRNGKey(6), (2, 2, 3))
    us = jax.random.normal(jax.random.PRNGKey(7), (2, 2, 3))
    jvp2 = lambda h: jax.vmap(jax.vmap(lambda c, u: jax.jvp(h, (c,), (u,))[1]))  # noqa: E731
    _close(jvp2(_subspace(f, diff))(cs, us), jvp2(_subspace(f32, diff32))(cs, us), TOL[dt])
    z = jnp.ones((), jnp.float32)
    y, lin = jax.linearize(lambda a: a * f(*diff).astype(jnp.float32), z)
    _close(lin(2 * z), 2 * f32(*diff32), TOL[dt])


def _scalar_loss(f, out_like, seed=5):
    w = _cotangent(out_like, seed).astype(jnp.float32)
    return lambda *d: jnp.sum(f(*d).astype(jnp.float32) * w)


@pytestmark_fwd
@pytest.mark.parametrize("spec,ex,impl,dt", _cases(SPECS, with_dtype=False, first_only=True))
def test_second_order_matches_reference(spec, ex, impl, dt):
    """Hessian-vector product (jvp of grad) and grad of grad, plain and under jit/vmap."""
    f, diff, f32, diff32 = _fwd_setup(spec, ex, impl, dt)
    out = jax.eval_shape(f, *diff)
    argnums = tuple(range(len(diff)))
    g, g32 = (jax.grad(_scalar_loss(h, out), argnums=argnums) for h in (f, f32))
    ts = tuple(_tangents(diff))
    hvp = jax.jvp(g, diff, ts)[1]
    hvp32 = jax.jvp(g32, diff32, ts)[1]
    _close(hvp, hvp32, 1e-4)
    _close(jax.jit(lambda *d: jax.jvp(g, d, ts)[1])(*diff), hvp32, 1e-4)
    # grad of grad (a gradient penalty): d/dx sum(grad(x) * v).
    gg = jax.grad(lambda *d: sum(jnp.vdot(a.astype(jnp.float32), t) for a, t in zip(g(*d), ts)), argnums=argnums)
    gg32 = jax.grad(lambda *d: sum(jnp.vdot(a, t) for a, t in zip(g32(*d), ts)), argnums=argnums)
    _close(gg(*diff), gg32(*diff32), 1e-4)
    # vmap of the Hessian-vector product over two tangents.
    tb = [jnp.stack([t, -t]) for t in ts]
    vh = jax.vmap(lambda *t: jax.jvp(g, diff, t)[1])(*tb)
    _close(vh, jax.tree_util.tree_map(lambda h: jnp.stack([h, -h]), hvp32), 1e-4)


@pytestmark_fwd
@pytest.mark.parametrize("spec", [s for s in SPECS if s.check_grads_order], ids=lambda s: s.name)
def test_numerical_second_order_float64_xla(spec):
    from jax.test_util import check_grads

    with jax.enable_x64(True):
        args, kwargs = _setup(spec, spec.examples[0], "float64")
        f = _closure(spec.fn, spec, args, kwargs, "xla")
        check_grads(f, [args[i] for i in spec.diff_argnums], order=2, modes=("fwd", "rev"), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(derivatives.FORWARD_MODE, reason="jax >= 0.12 has forward mode")
@pytest.mark.parametrize("spec,ex,impl,dt", _cases(SPECS, with_dtype=False, first_only=True))
def test_forward_mode_error_and_grad_of_grad_on_old_jax(spec, ex, impl, dt):
    """Before jax 0.12: jvp raises NotImplementedError naming the op, eagerly and under jit;
    grad of grad and forward over reverse (a Hessian-vector product) still work."""
    f, diff, f32, diff32 = _fwd_setup(spec, ex, impl, dt)
    if "custom_vjp" in str(jax.make_jaxpr(f)(*diff)):
        for t in (lambda g: g, jax.jit):
            with pytest.raises(NotImplementedError, match=rf"jaxbwd\.{spec.name}: forward-mode"):
                t(lambda *d: jax.jvp(f, d, tuple(_tangents(diff))))(*diff)
    else:  # an op written in plain jnp (no custom derivative) has JAX's own forward mode
        ts = _tangents(diff)
        _close(jax.jvp(f, diff, ts)[1], jax.jvp(f32, diff32, tuple(t.astype(jnp.float32) for t in ts))[1], TOL[dt])
    out = jax.eval_shape(f, *diff)
    argnums = tuple(range(len(diff)))
    ts = _tangents(diff)
    g, g32 = (jax.grad(_scalar_loss(h, out), argnums=argnums) for h in (f, f32))
    gg = jax.grad(lambda *d: sum(jnp.vdot(a.astype(jnp.float32), t) for a, t in zip(g(*d), ts)), argnums=argnums)
    gg32 = jax.grad(lambda *d: sum(jnp.vdot(a, t) for a, t in zip(g32(*d), ts)), argnums=argnums)
    _close(gg(*diff), gg32(*diff32), 1e-4)
    t32 = tuple(t.astype(jnp.float32) for t in ts)
    _close(jax.jvp(g, diff, ts)[1], jax.jvp(g32, diff32, t32)[1], 1e-4)
    if len(diff) > 1:  # a mixed partial: forward in the last input of the gradient in the first
        mixed = lambda h, d: jax.jvp(  # noqa: E731
            lambda last: jax.grad(_scalar_loss(h, out))(*d[:-1], last), (d[-1],), (t32[-1].astype(d[-1].dtype),))[1]
        _close(mixed(f, diff), mixed(f32, diff32), 1e-4)
        _close(jax.jit(lambda *d: mixed(f, d))(*diff), mixed(f32, diff32), 1e-4)


@pytestmark_fwd
@pytest.mark.parametrize("spec,ex", [pytest.param(s, s.lowering[0], id=s.name) for s in SPECS if s.jvp_kernels])
def test_jvp_kernels_lower_for_gpu(spec, ex):
    args, kwargs = ex.make(None, None)

    def jvp(*all_args):
        f = _closure(spec.fn, spec, list(all_args), kwargs, "pallas")
        diff = tuple(all_args[i] for i in spec.diff_argnums)
        return jax.jvp(f, diff, diff)

    with config.use(interpret=False):
        names = pallas_common.triton_kernel_names(pallas_common.lower_for_gpu(jvp, *args))
    for k in spec.jvp_kernels:
        assert k in names, f"{spec.name}: forward-mode kernel {k} missing from the CUDA module (found {names})"


@pytestmark_fwd
@pytest.mark.parametrize("spec", [s for s in SPECS if s.jvp_memory], ids=lambda s: s.name)
def test_jvp_memory_within_budget(spec):
    ex, budget = spec.jvp_memory
    args, kwargs = ex.make(None, None)
    diff = [args[i] for i in spec.diff_argnums]

    def jvp(*d):
        f = _closure(spec.fn, spec, args, kwargs, "xla")
        return jax.jvp(f, d, d)

    temp = jax.jit(jvp).lower(*diff).compile().memory_analysis().temp_size_in_bytes
    assert temp <= budget(*args, **kwargs), f"{spec.name}: jit(jvp) holds {temp} temp bytes, budget {budget(*args, **kwargs)}"
