"""Activation-specific cases: saturation, clamping, masked softmax rows, axes, GPU lowering.

The generic contract (forward and grads vs reference, transforms, bad dtypes) comes from
the registry; this file covers what only activations have. Pallas runs in interpret mode.
"""
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxbwd import config
from jaxbwd import reference as ref
from jaxbwd.pallas import _common as C
from jaxbwd.vjp._derivatives import FORWARD_MODE
from jaxbwd.vjp.activations import gated_linear_unit, gelu, leaky_relu, relu, sigmoid, silu, softmax, swiglu, tanh

IMPLS = ("xla", "pallas")
ACTIVATIONS = ("silu", "gelu", "gelu_exact")
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def _interpret():
    with config.use(interpret=True):
        yield


def _normal(seed, shape, dtype=jnp.float32, scale=1.0):
    return (scale * jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32)).astype(dtype)


def _vjp(f, args, dy):
    y, vjp = jax.vjp(f, *args)
    return y, vjp(dy)


def _assert_grads_match(f, f_ref, args, dtype=jnp.float32):
    y_ref = f_ref(*args)
    dy = _normal(99, y_ref.shape, dtype)
    y, grads = _vjp(f, args, dy)
    _, grads_ref = _vjp(f_ref, args, dy)
    tol = TOL[dtype]
    chex.assert_trees_all_close(y, y_ref, atol=tol, rtol=tol)
    chex.assert_trees_all_equal_dtypes(grads, args)
    chex.assert_trees_all_close(grads, grads_ref, atol=tol, rtol=tol)
    return grads


def _glu_ref(activation, limit=None):
    return lambda x: ref.gated_linear_unit(x, activation=activation, limit=limit)


# Values far past saturation: exp(-x) overflows at -100 in f32, x**3 is 1e12 at -1e4.
EXTREMES = jnp.array([100.0, -100.0, -1e4, 1e4, 0.0, 30.0, -30.0, 1.0], jnp.float32)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", ["silu", "gelu", "gelu_exact", "swiglu", "swiglu_limit",
                                "glu_silu", "glu_gelu", "glu_gelu_exact", "glu_gelu_limit"])
def test_grads_finite_at_extremes(op, impl):
    x = EXTREMES
    gate = jnp.repeat(x, x.size)  # every (gate, up) pair of extremes
    up = jnp.tile(x, x.size)
    if op == "silu":
        f, f_ref, args = (lambda x: silu(x, implementation=impl)), ref.silu, (x,)
    elif op.startswith("gelu"):
        approx = op == "gelu"
        f = lambda x: gelu(x, approximate=approx, implementation=impl)
        f_ref, args = (lambda x: ref.gelu(x, approximate=approx)), (x,)
    elif op.startswith("swiglu"):
        limit = 7.0 if op.endswith("limit") else None
        f = lambda g, u: swiglu(g, u, limit=limit, implementation=impl)
        f_ref, args = (lambda g, u: ref.swiglu(g, u, limit=limit)), (gate, up)
    else:
        act = op[4:].replace("_limit", "")
        limit = 7.0 if op.endswith("limit") else None
        f = lambda x: gated_linear_unit(x, activation=act, limit=limit, implementation=impl)
        f_ref, args = _glu_ref(act, limit), (jnp.concatenate([gate, up])[None],)
    y, grads = _vjp(f, args, jnp.ones_like(f_ref(*args)))
    for g in grads:
        assert bool(jnp.all(jnp.isfinite(g))), (op, g)
    assert bool(jnp.all(jnp.isfinite(y)))
    # At saturation the exact derivatives are 0 or 1 (times the other factor): no slack needed
    # beyond f32 rounding of products up to 1e4 * 1e4.
    _, grads_ref = _vjp(f_ref, args, jnp.ones_like(y))
    chex.assert_trees_all_close(grads, grads_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_limit_zeroes_grads_where_clamped(activation, impl):
    limit = 0.7
    gate, up = _normal(0, (4, 300), scale=2.0), _normal(1, (4, 300), scale=2.0)
    if activation == "silu":
        (dgate, dup) = _assert_grads_match(
            lambda g, u: swiglu(g, u, limit=limit, implementation=impl),
            lambda g, u: ref.swiglu(g, u, limit=limit), (gate, up))
    else:
        (dx,) = _assert_grads_match(
            lambda x: gated_linear_unit(x, activation=activation, limit=limit, implementation=impl),
            _glu_ref(activation, limit), (jnp.concatenate([gate, up], axis=-1),))
        dgate, dup = dx[:, :300], dx[:, 300:]
    assert bool(jnp.any(gate > limit)) and bool(jnp.any(jnp.abs(up) > limit))
    np.testing.assert_array_equal(np.asarray(dgate)[np.asarray(gate > limit)], 0.0)
    np.testing.assert_array_equal(np.asarray(dup)[np.asarray(jnp.abs(up) > limit)], 0.0)


@pytest.mark.parametrize("impl", IMPLS)
def test_limit_passes_the_derivative_at_the_limit_in_both_modes(impl):
    """A value equal to the limit keeps its derivative (torch.clamp's rule, gpt-oss's
    reference), in reverse and forward mode alike; NaN passes the clamp."""
    gate, up = jnp.array([1.0, 0.5, 1.5, -0.3]), jnp.array([2.0, 1.0, -1.0, 0.2])  # ties: gate[0], up[1], up[2]
    f = lambda g, u: swiglu(g, u, limit=1.0, implementation=impl)  # noqa: E731
    # the unclamped op's derivative at the clamped values, zero only strictly beyond the limit
    plain = lambda g, u: swiglu(g, u, implementation=impl)  # noqa: E731
    inner = jax.jacrev(plain, (0, 1))(jnp.minimum(gate, 1.0), jnp.clip(up, -1, 1))
    want = (np.diag(inner[0]) * np.asarray(gate <= 1.0), np.diag(inner[1]) * np.asarray(jnp.abs(up) <= 1.0))
    modes = (jax.jacrev, jax.jacfwd) if FORWARD_MODE else (jax.jacrev,)  # jax < 0.12: reverse only
    for mode in modes:
        got = mode(f, (0, 1))(gate, up)
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.diag(g), w, rtol=1e-6, err_msg=mode.__name__)
    x = jnp.array([[1.0, 0.5, 2.0, 1.0]])
    g = lambda x: gated_linear_unit(x, limit=1.0, implementation=impl)  # noqa: E731
    if FORWARD_MODE:
        np.testing.assert_allclose(jax.jacfwd(g)(x), jax.jacrev(g)(x), rtol=1e-6)
    assert bool(jnp.isnan(f(jnp.array([jnp.nan]), jnp.array([1.0]))[0]))
    assert bool(jnp.isnan(f(jnp.array([1.0]), jnp.array([jnp.nan]))[0]))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_glu_each_activation(activation, dtype, impl):
    x = _normal(2, (5, 2 * 123), dtype)  # odd d: masked column tail in the glu tile
    _assert_grads_match(lambda x: gated_linear_unit(x, activation=activation, implementation=impl),
                        _glu_ref(activation), (x,), dtype)


@pytest.mark.parametrize("impl", IMPLS)
def test_elementwise_multi_block_tail(impl):
    # 3 * 1500 elements: more than one 2048-element block, with a masked tail.
    x, y = _normal(3, (3, 1500)), _normal(4, (3, 1500))
    _assert_grads_match(lambda x: silu(x, implementation=impl), ref.silu, (x,))
    _assert_grads_match(lambda x: gelu(x, implementation=impl), ref.gelu, (x,))
    _assert_grads_match(lambda g, u: swiglu(g, u, implementation=impl), ref.swiglu, (x, y))


@pytest.mark.parametrize("impl", IMPLS)
def test_softmax_fully_masked_row(impl):
    x = _normal(5, (3, 7)).at[1].set(-jnp.inf).at[2, :3].set(-jnp.inf)
    f = lambda x: softmax(x, implementation=impl)
    dy = _normal(6, x.shape)
    y, (dx,) = _vjp(f, (x,), dy)
    _, (dx_ref,) = _vjp(ref.softmax, (x,), dy)
    np.testing.assert_array_equal(np.asarray(y[1]), 0.0)
    assert bool(jnp.all(jnp.isfinite(dx)))
    np.testing.assert_array_equal(np.asarray(dx[1]), 0.0)
    np.testing.assert_array_equal(np.asarray(dx[2, :3]), 0.0)
    chex.assert_trees_all_close(dx, dx_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("axis", [0, 1, -3])
def test_softmax_axis(axis, impl):
    x = _normal(7, (4, 5, 6))
    _assert_grads_match(lambda x: softmax(x, axis=axis, implementation=impl),
                        lambda x: ref.softmax(x, axis=axis), (x,))


@pytest.mark.parametrize("impl", IMPLS)
def test_softmax_row_longer_than_one_tile(impl):
    # 9000 columns > MAX_TILE: the two-phase (sum, then write) path of the kernel.
    x = _normal(8, (2, 9000))
    _assert_grads_match(lambda x: softmax(x, implementation=impl), ref.softmax, (x,))


UNARY = {  # the factory's new ops and the jax.nn/jnp functions they follow
    "relu": (relu, jax.nn.relu),
    "leaky_relu": (leaky_relu, jax.nn.leaky_relu),
    "leaky_relu_neg": (lambda x, **k: leaky_relu(x, -0.5, **k), lambda x: jax.nn.leaky_relu(x, -0.5)),
    "sigmoid": (sigmoid, jax.nn.sigmoid),
    "tanh": (tanh, jnp.tanh),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", sorted(UNARY))
def test_unary_matches_jax_at_extremes_and_kinks(op, impl):
    """Values past saturation, exact zeros (the kinks: gradient 0 for relu, 1 for leaky_relu,
    as jax.nn), over a multi-block tiling with a masked tail."""
    f, f_jax = UNARY[op]
    x = jnp.concatenate([EXTREMES, jnp.zeros(3), _normal(5, (4489,), scale=3.0)]).reshape(3, 1500)
    _assert_grads_match(lambda x: f(x, implementation=impl), f_jax, (x,))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("slope", [0.01, 0.0, -0.5])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_leaky_relu_keeps_the_branch_as_int8(dtype, slope, impl):
    # One int8 per element, as autodiff of jax.nn.leaky_relu's jnp.where keeps a mask; the
    # gradient and the tangent equal jax's bit for bit, at -0.0, NaN, infinities and an
    # input whose slope * x underflows to 0 (the tangent on jax >= 0.12, with forward mode).
    from jax._src.ad_checkpoint import saved_residuals

    x = jnp.array([-2.0, -0.0, 0.0, 1.5, jnp.nan, -1e-45, 3.0, -jnp.inf, jnp.inf], dtype)
    f = lambda x: leaky_relu(x, slope, implementation=impl)  # noqa: E731
    want = jax.grad(lambda x: jnp.sum(jax.nn.leaky_relu(x.astype(jnp.float32), slope)))(x)
    got = jax.grad(lambda x: jnp.sum(f(x).astype(jnp.float32)))(x)
    tangents = [jax.jvp(f, (x,), (jnp.ones_like(x),))[1]] if FORWARD_MODE else []
    for a in [got, *tangents]:
        assert a.dtype == x.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(want, np.float32))
    assert [v.str_short() for v, _ in saved_residuals(lambda x: jnp.sum(f(x)), x)] == ["int8[9]"]


@pytest.mark.parametrize("impl", IMPLS)
def test_exact_gelu_grad_relative_accurate_in_the_negative_tail(impl):
    """gelu' = Phi(x) + x phi(x) with Phi from erfc: computed as (1 + erf) / 2, Phi cancelled
    to 0 below x = -5.5 and gelu' was 3-10% off there (absolute error ~1e-8, invisible to
    an atol). Relative to float64 truth, down to x = -12 (gelu' ~ -1e-31), and through the
    gated form's gate gradient."""
    x = np.concatenate([np.linspace(-12.0, -3.0, 361), np.linspace(-3.0, 6.0, 37)]).astype(np.float32)
    x64 = x.astype(np.float64)
    truth = 0.5 * np.vectorize(math.erfc)(-x64 / math.sqrt(2)) + x64 * np.exp(-0.5 * x64**2) / math.sqrt(2 * math.pi)
    far = np.abs(x64 + 0.7518) > 0.05  # gelu' has a root near x = -0.7518: relative error means nothing there
    got = jax.grad(lambda v: gelu(v, approximate=False, implementation=impl).sum())(jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(got, np.float64)[far], truth[far], rtol=1e-4)
    glu = lambda v: gated_linear_unit(v, activation="gelu_exact", implementation=impl).sum()
    dgate = jax.grad(glu)(jnp.concatenate([jnp.asarray(x), jnp.ones_like(x)]))[: x.size]
    np.testing.assert_allclose(np.asarray(dgate, np.float64)[far], truth[far], rtol=1e-4)


def _bwd_fn(op):
    def f(*args):
        *xs, dy = args
        return jax.vjp(lambda *a: op(*a, implementation="pallas"), *xs)[1](dy)
    return f


@pytest.mark.parametrize(
    "name, op, n_in, x_shape, y_shape",
    [
        ("silu_bwd", silu, 1, (8192, 4096), (8192, 4096)),
        ("gelu_bwd", gelu, 1, (8192, 4096), (8192, 4096)),
        ("gelu_bwd", lambda x, **k: gelu(x, approximate=False, **k), 1, (8192, 4096), (8192, 4096)),
        ("swiglu_bwd", lambda g, u, **k: swiglu(g, u, limit=7.0, **k), 2, (8192, 4096), (8192, 4096)),
        ("glu_bwd", gated_linear_unit, 1, (8192, 2 * 5120), (8192, 5120)),
        ("glu_bwd", lambda x, **k: gated_linear_unit(x, activation="gelu_exact", limit=7.0, **k), 1, (8192, 2 * 4096), (8192, 4096)),
        ("relu_bwd", relu, 1, (8192, 4096), (8192, 4096)),
        ("tanh_bwd", tanh, 1, (3, 5, 7), (3, 5, 7)),
        ("softmax_bwd", softmax, 1, (8192, 4096), (8192, 4096)),
        ("softmax_bwd", softmax, 1, (8, 32000), (8, 32000)),
        ("softmax_bwd", lambda x, **k: softmax(x, axis=1, **k), 1, (4, 4096, 32), (4, 4096, 32)),
    ],
)
def test_kernel_lowers_for_cuda(name, op, n_in, x_shape, y_shape):
    bf16 = jnp.bfloat16
    args = [jax.ShapeDtypeStruct(x_shape, bf16)] * n_in + [jax.ShapeDtypeStruct(y_shape, bf16)]
    with config.use(interpret=False):
        hlo = C.lower_for_gpu(_bwd_fn(op), *args)
    assert C.triton_kernel_names(hlo) == [name]


@pytest.mark.parametrize(
    "call, exc, words",
    [
        (lambda: swiglu(jnp.ones((2, 3)), jnp.ones((2, 4))), ValueError, ["swiglu", "up", "(2, 3)", "(2, 4)"]),
        (lambda: swiglu(jnp.ones(3), jnp.ones(3, jnp.bfloat16)), TypeError, ["swiglu", "gate", "up", "bfloat16"]),
        (lambda: swiglu(jnp.ones(3), jnp.ones(3), limit=0.0), ValueError, ["swiglu", "limit", "positive", "0.0"]),
        (lambda: gated_linear_unit(jnp.ones((2, 5))), ValueError, ["gated_linear_unit", "x", "even", "(2, 5)"]),
        (lambda: gated_linear_unit(jnp.ones((2, 4)), activation="relu"), ValueError, ["gated_linear_unit", "activation", "silu", "'relu'"]),
        (lambda: gated_linear_unit(jnp.ones((2, 4)), limit=-1), ValueError, ["gated_linear_unit", "limit", "positive", "-1"]),
        (lambda: gated_linear_unit(jnp.ones((2, 4)), limit="7"), TypeError, ["gated_linear_unit", "limit", "number", "'7'"]),
        (lambda: softmax(jnp.ones((2, 4)), axis=2), ValueError, ["softmax", "axis", "[-2, 2)", "got 2"]),
        (lambda: softmax(jnp.ones((2, 4)), axis=0.5), TypeError, ["softmax", "axis", "int", "0.5"]),
        (lambda: gelu(jnp.ones(3), approximate="tanh"), TypeError, ["gelu", "approximate", "bool", "'tanh'"]),
        (lambda: silu(jnp.ones(3, jnp.int32)), TypeError, ["silu", "x", "floating", "int32"]),
        (lambda: sigmoid(jnp.ones(3, jnp.int32)), TypeError, ["sigmoid", "x", "floating", "int32"]),
        (lambda: leaky_relu(jnp.ones(3), jnp.ones(())), TypeError, ["leaky_relu", "negative_slope", "number"]),
    ],
)
def test_bad_arguments(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    for w in words:
        assert w in str(info.value), (w, str(info.value))


# jax.nn.glu and jax.nn.softmax's own signatures: the ops give jax.nn's values and grads.
@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("shape,axis", [((4, 10), -1), ((6, 3), 0), ((2, 4, 6), 1), ((8,), 0)])
def test_glu_matches_jax_nn(shape, axis, impl):
    import jaxbwd

    x = _normal(7, shape, jnp.float32)
    f = lambda x: jaxbwd.glu(x, axis, implementation=impl)
    chex.assert_trees_all_close(f(x), jax.nn.glu(x, axis), atol=1e-6, rtol=1e-6)
    dy = _normal(8, f(x).shape, jnp.float32)
    chex.assert_trees_all_close(jax.vjp(f, x)[1](dy), jax.vjp(lambda x: jax.nn.glu(x, axis), x)[1](dy),
                                atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("axis", [-1, 0, (1, 3), (0, 2), (2, 3), None])
@pytest.mark.parametrize("masked", [False, True])
def test_softmax_matches_jax_nn(axis, masked, impl):
    import jaxbwd

    x = _normal(9, (3, 4, 5, 6), jnp.float32)
    # A mask broadcast along axis 1, with one slice fully masked out (zeros, as jax.nn).
    where = None
    if masked:
        where = jax.random.bernoulli(jax.random.PRNGKey(10), 0.6, (3, 1, 5, 6)).at[0].set(False)
    f = lambda x: jaxbwd.softmax(x, axis, where, implementation=impl)
    g = lambda x: jax.nn.softmax(x, axis, where)
    chex.assert_trees_all_close(f(x), g(x), atol=1e-6, rtol=1e-6)
    dy = _normal(11, x.shape, jnp.float32)
    chex.assert_trees_all_close(jax.vjp(f, x)[1](dy), jax.vjp(g, x)[1](dy), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    "call,exc,words",
    [
        (lambda: __import__("jaxbwd").glu(jnp.ones((3, 4)), 0), ValueError, ["glu", "even", "axis 0", "(3, 4)"]),
        (lambda: __import__("jaxbwd").glu(jnp.ones((3, 4)), 2), ValueError, ["glu", "axis", "[-2, 2)", "got 2"]),
        (lambda: softmax(jnp.ones((2, 4)), (0, 0)), ValueError, ["softmax", "axis", "distinct"]),
        (lambda: softmax(jnp.ones((2, 4)), -1, jnp.ones((4,))), TypeError, ["softmax", "where", "boolean", "float32"]),
        (lambda: softmax(jnp.ones((2, 4)), -1, jnp.ones((3,), bool)), ValueError, ["softmax", "where", "(2, 4)", "(3,)"]),
    ],
)
def test_glu_softmax_bad_arguments(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    for w in words:
        assert w in str(info.value), (w, str(info.value))
