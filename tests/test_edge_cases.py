"""Empty inputs and other edge cases every op must survive, for both implementations."""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxbwd
from jaxbwd import reference, testing
from jaxbwd.vjp._derivatives import FORWARD_MODE

f32, i32 = jnp.float32, jnp.int32

# (name, fn(*diff), diff args): an empty batch / row count, the reduced axis non-empty.
EMPTY = [
    ("rms_norm", lambda x, w, impl: jaxbwd.rms_norm(x, w, implementation=impl), (jnp.ones((0, 8)), jnp.ones((8,)))),
    ("layer_norm", lambda x, w, impl: jaxbwd.layer_norm(x, w, w, implementation=impl), (jnp.ones((2, 0, 8)), jnp.ones((8,)))),
    ("group_norm", lambda x, w, impl: jaxbwd.group_norm(x, w, w, num_groups=2, implementation=impl), (jnp.ones((0, 4, 4, 8)), jnp.ones((8,)))),
    ("softmax", lambda x, impl: jaxbwd.softmax(x, implementation=impl), (jnp.ones((0, 5)),)),
    ("silu", lambda x, impl: jaxbwd.silu(x, implementation=impl), (jnp.ones((0,)),)),
    ("gelu", lambda x, impl: jaxbwd.gelu(x, implementation=impl), (jnp.ones((3, 0)),)),
    ("swiglu", lambda g, u, impl: jaxbwd.swiglu(g, u, implementation=impl), (jnp.ones((0, 4)), jnp.ones((0, 4)))),
    ("glu", lambda x, impl: jaxbwd.glu(x, implementation=impl), (jnp.ones((0, 4)),)),
    ("gated_linear_unit", lambda x, impl: jaxbwd.gated_linear_unit(x, implementation=impl), (jnp.ones((0, 4)),)),
    ("bias_add", lambda x, b, impl: jaxbwd.bias_add(x, b, implementation=impl), (jnp.ones((0, 4)), jnp.ones((4,)))),
    ("cross_entropy", lambda x, impl: jaxbwd.cross_entropy(x, jnp.zeros((0,), i32), reduction="sum", implementation=impl), (jnp.ones((0, 10)),)),
    ("embed", lambda t, impl: jaxbwd.embed(jnp.zeros((0,), i32), t, implementation=impl), (jnp.ones((16, 8)),)),
    ("rope", lambda x, impl: jaxbwd.rope(x, implementation=impl), (jnp.ones((1, 0, 2, 8)),)),
    ("dot_product_attention/B=0", lambda q, impl: jaxbwd.dot_product_attention(q, q, q, implementation=impl), (jnp.ones((0, 4, 2, 16)),)),
    ("dot_product_attention/T=0", lambda q, k, impl: jaxbwd.dot_product_attention(q, k, k, implementation=impl), (jnp.ones((1, 0, 2, 16)), jnp.ones((1, 5, 2, 16)))),
    ("pixel_shuffle", lambda x, impl: jaxbwd.pixel_shuffle(x, 2, implementation=impl), (jnp.ones((0, 3, 3, 8)),)),
    ("upsample2d", lambda x, impl: jaxbwd.upsample2d(x, 2, implementation=impl), (jnp.ones((0, 3, 3, 2)),)),
    ("conv2d", lambda x, w, impl: jaxbwd.conv2d(x, w, padding=1, implementation=impl), (jnp.ones((0, 5, 5, 2)), jnp.ones((3, 3, 2, 4)))),
]


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("name,fn,args", EMPTY, ids=[e[0] for e in EMPTY])
def test_empty_inputs_give_empty_or_zero_results(name, fn, args, impl):
    f = lambda *a: fn(*a, impl)
    out = f(*args)
    grads = jax.grad(lambda *a: jnp.sum(f(*a).astype(f32)), argnums=tuple(range(len(args))))(*args)
    for g, a in zip(grads, args):
        assert g.shape == a.shape
        assert float(jnp.sum(jnp.abs(g))) == 0.0
    assert bool(jnp.all(jnp.isfinite(out)))


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda: jaxbwd.rms_norm(jnp.ones((4, 0)), jnp.ones((0,))), ValueError, r"rms_norm: x must have a non-empty last axis"),
        (lambda: jaxbwd.layer_norm(jnp.ones((4, 0)), jnp.ones((0,)), jnp.ones((0,))), ValueError, r"layer_norm: x must have a non-empty last axis"),
        (lambda: jaxbwd.layer_norm(jnp.ones((4, 8)), jnp.ones((8,)), None), TypeError, r"layer_norm: bias must be an array, got NoneType"),
        (lambda: jaxbwd.layer_norm(jnp.ones((4, 8)), None, jnp.ones((8,))), TypeError, r"layer_norm: weight must be an array, got NoneType"),
        (lambda: jaxbwd.scale(jnp.ones(3), 1j), TypeError, r"scale: factor must be a real Python number"),
        (lambda: jaxbwd.reshape(jnp.ones((4, 8)), (4.0, 8)), TypeError, r"reshape: shape must be a tuple of ints"),
        (lambda: jaxbwd.row_slice(jnp.ones((4, 3)), 1.5, 2), TypeError, r"row_slice: start must be a Python int or an integer scalar array"),
        (lambda: jaxbwd.rope(jnp.ones((1, 4, 2, 8)), positions=jnp.arange(4), start_pos=3), ValueError, r"rope: give positions or start_pos, not both"),
        (lambda: jaxbwd.rope(jnp.ones((1, 4, 2, 8)), start_pos=1.5), TypeError, r"rope: start_pos must be a Python int or an integer scalar array, got 1.5"),
        (lambda: jaxbwd.rope(jnp.ones((1, 4, 2, 8)), start_pos=jnp.float32(1.5)), TypeError, r"rope: start_pos must have an integer dtype"),
        (lambda: jaxbwd.cross_entropy(jnp.ones((4, 0)), jnp.zeros((4,), i32)), ValueError, r"cross_entropy: logits must have a non-empty"),
        (lambda: jaxbwd.embed(jnp.zeros((3,), i32), jnp.ones((0, 8))), ValueError, r"embed: table must have a non-empty"),
        (lambda: jaxbwd.dot_product_attention(jnp.ones((1, 4, 2, 8)), jnp.ones((1, 0, 2, 8)), jnp.ones((1, 0, 2, 8))), ValueError, r"dot_product_attention: key must have a non-empty"),
        (lambda: jaxbwd.dot_product_attention(jnp.ones((1, 4, 0, 8)), jnp.ones((1, 4, 0, 8)), jnp.ones((1, 4, 0, 8))), ValueError, r"dot_product_attention: query must have a non-empty head axis N"),
        (lambda: jaxbwd.dot_product_attention(jnp.ones((1, 4, 2, 8)), jnp.ones((1, 4, 0, 8)), jnp.ones((1, 4, 0, 8))), ValueError, r"dot_product_attention: key must have a non-empty head axis K"),
        # Non-finite static numbers would poison every result: rejected by name.
        (lambda: jaxbwd.dot_product_attention(*[jnp.ones((1, 4, 2, 8))] * 3, scale=float("nan")), ValueError, r"dot_product_attention: scale must be a finite number, got nan"),
        (lambda: jaxbwd.scale(jnp.ones(3), float("inf")), ValueError, r"scale: factor must be a finite number, got inf"),
        (lambda: jaxbwd.rms_norm(jnp.ones((4, 8)), jnp.ones((8,)), eps=float("nan")), ValueError, r"rms_norm: eps must be a finite number, got nan"),
        (lambda: jaxbwd.group_norm(jnp.ones((2, 4, 6)), jnp.ones((6,)), jnp.ones((6,)), num_groups=2.0), TypeError, r"group_norm: num_groups must be a static Python int, got 2.0"),
        (lambda: jaxbwd.row_slice(jnp.ones((4, 3)), 1, np.float32(2)), TypeError, r"row_slice: size must be a static Python int"),
        (lambda: jaxbwd.embed(jnp.zeros((3,), i32), jnp.ones((8, 4)), padding_idx=1.0), TypeError, r"embed: padding_idx must be None or a static Python int, got 1.0"),
        (lambda: jaxbwd.dot_product_attention(*[jnp.ones((1, 4, 2, 8))] * 3, sliding_window=2.5), TypeError, r"dot_product_attention: sliding_window must be a static Python int, got 2.5"),
        (lambda: jaxbwd.dot_product_attention(*[jnp.ones((1, 4, 2, 8))] * 3, local_window_size=(1, 2, 3)), ValueError, r"dot_product_attention: local_window_size must be an int >= 0 or a pair of them, got \(1, 2, 3\)"),
        (lambda: jaxbwd.max_pool2d(jnp.ones((1, 4, 4, 3)), 2.0), TypeError, r"max_pool2d: window_shape must be an int >= 1 or a pair of them, got 2.0"),
        (lambda: jaxbwd.upsample2d(jnp.ones((1, 4, 4, 3)), (2, 2, 2)), ValueError, r"upsample2d: scale must be an int >= 1 or a pair of them, got \(2, 2, 2\)"),
        (lambda: jax.jit(lambda s: jaxbwd.max_pool2d(jnp.ones((1, 4, 4, 3)), (s, 2)))(2), TypeError, r"max_pool2d: window_shape must be an int >= 1 or a pair of them, got a traced value"),
        (lambda: jaxbwd.matmul(jnp.ones((2, 3)), jnp.ones((3, 4)), implementation="bogus"), ValueError, r"^jaxbwd\.matmul: implementation must be None, 'auto', 'pallas', 'xla', 'pallas:triton' or 'pallas:mosaic', got 'bogus'$"),
        (lambda: jaxbwd.max_pool2d(jnp.ones((1, 4, 4, 3)), None), TypeError, r"max_pool2d: window_shape must be an int >= 1 or a pair of them, got None"),
        (lambda: jaxbwd.avg_pool2d(jnp.ones((1, 4, 4, 3)), None), TypeError, r"avg_pool2d: window_shape must be an int >= 1 or a pair of them, got None"),
        # axis/axis_name mixed up: JAX's collectives would read an int as a positional axis
        (lambda: jaxbwd.batch_norm(jnp.ones((4, 6)), jnp.ones(6), jnp.zeros(6), axis_name=0), TypeError, r"batch_norm: axis_name must be None, an axis name \(e.g. a str\) or a tuple of them, got 0"),
        (lambda: jaxbwd.batch_norm(jnp.ones((4, 6)), jnp.ones(6), jnp.zeros(6), axis_name=("data", [1])), TypeError, r"batch_norm: axis_name must be None, an axis name"),
        # a jax array axis: accepted eagerly before, a TracerBoolConversionError under jit
        (lambda: jax.jit(lambda l: jaxbwd.cross_entropy(l, jnp.zeros(6, jnp.int32), axis=jnp.int32(-1)))(jnp.ones((6, 11))), TypeError, r"cross_entropy: axis must be an int or a tuple of ints, got JitTracer"),
        (lambda: jaxbwd.cross_entropy(jnp.ones((6, 11)), jnp.zeros(6, jnp.int32), axis=jnp.int32(-1)), TypeError, r"cross_entropy: axis must be an int or a tuple of ints"),
        # unbatched attention: a list of ints is not a (q, kv) pair of segment ids
        (lambda: jaxbwd.dot_product_attention(jnp.ones((8, 4, 16)), jnp.ones((8, 2, 16)), jnp.ones((8, 2, 16)), segment_ids=[0] * 8), ValueError, r"dot_product_attention: segment_ids must be an array .* got a sequence of length 8"),
        # unbatched attention's shape errors show the shapes given, not with a batch axis of 1
        (lambda: jaxbwd.dot_product_attention(jnp.ones((2, 4, 8)), jnp.ones((2, 4, 8)), jnp.ones((2, 5, 8))), ValueError, r"value must have shape \(2, 4, 8\) \(key's shape \[S, K, H\]; unbatched\), got \(2, 5, 8\)$"),
        (lambda: jaxbwd.dot_product_attention(jnp.ones((2, 4, 8)), jnp.ones((3, 2, 6)), jnp.ones((3, 2, 6))), ValueError, r"key must have shape \[S, K, H=8\] \(query's head dim; unbatched\), got \(3, 2, 6\)$"),
        (lambda: jaxbwd.dot_product_attention(*[jnp.ones((2, 4, 8))] * 3, segment_ids=jnp.zeros((1, 2), i32)), ValueError, r"segment_ids must have shape \(2,\) \(\[T\]; unbatched\), got \(1, 2\)$"),
        (lambda: jaxbwd.dot_product_attention(jnp.ones((2, 4, 8)), jnp.ones((3, 4, 8)), jnp.ones((3, 4, 8)), segment_ids=(jnp.zeros(2, i32), jnp.zeros(2, i32))), ValueError, r"segment_ids\[1\] must have shape \(3,\) \(\[S\]; unbatched\), got \(2,\)$"),
        (lambda: jaxbwd.dot_product_attention(jnp.ones((2, 4, 8)), jnp.ones((3, 4, 8)), jnp.ones((3, 4, 8)), segment_ids=jnp.zeros(2, i32)), ValueError, r"segment_ids must be a pair \(\[T\], \[S\]\) when T != S \(unbatched\), got one array of shape \(2,\) for T=2, S=3$"),
    ],
)
def test_invalid_edge_inputs_raise(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_numpy_integers_are_static_ints():
    # Shapes computed with NumPy give np.int64: accepted wherever a static int is.
    x = jnp.arange(24.0).reshape(2, 2, 6)
    want = jaxbwd.group_norm(x, jnp.ones((6,)), jnp.zeros((6,)), num_groups=3)
    got = jaxbwd.group_norm(x, jnp.ones((6,)), jnp.zeros((6,)), num_groups=np.int64(3))
    chex.assert_trees_all_equal(got, want)
    chex.assert_trees_all_equal(jaxbwd.row_slice(x[0], 0, np.int64(1)), x[0, :1])
    q = jax.random.normal(jax.random.PRNGKey(0), (1, 6, 2, 8))
    chex.assert_trees_all_equal(jaxbwd.dot_product_attention(q, q, q, sliding_window=np.int64(2)),
                                jaxbwd.dot_product_attention(q, q, q, sliding_window=2))
    chex.assert_trees_all_equal(jaxbwd.dot_product_attention(q, q, q, local_window_size=(np.int64(1), 0)),
                                jaxbwd.dot_product_attention(q, q, q, local_window_size=(1, 0)))


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_64bit_labels_past_int32_are_out_of_range(impl):
    # With x64, labels are checked against [0, V) before their cast to int32: 2**32 + 1 is
    # ignored (an out-of-range label, the documented policy), not read as label 1.
    with jax.enable_x64(True):
        logits = jax.random.normal(jax.random.PRNGKey(0), (2, 5), f32)
        labels = jnp.array([2**32 + 1, 1], jnp.int64)
        loss = jaxbwd.cross_entropy(logits, labels, reduction="none", implementation=impl)
        np.testing.assert_allclose(np.asarray(loss), [0.0, float(jax.nn.logsumexp(logits[1]) - logits[1, 1])], rtol=1e-6)
        x, w = jnp.ones((2, 3), f32), jax.random.normal(jax.random.PRNGKey(1), (3, 5), f32)
        lce = jaxbwd.linear_cross_entropy(x, w, labels, reduction="none", implementation=impl)
        assert float(lce[0]) == 0.0 and float(lce[1]) > 0.0


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_ignore_index_outside_the_labels_dtype_matches_no_label(impl):
    # int32 labels with ignore_index 2**40: nothing is ignored (an OverflowError inside JAX
    # before); int64 labels under x64 and uint32 labels with their max: that label is ignored.
    logits = jax.random.normal(jax.random.PRNGKey(0), (3, 5), f32)
    x, w = jnp.ones((3, 4), f32), jax.random.normal(jax.random.PRNGKey(1), (4, 5), f32)
    labels = jnp.array([0, 4, 2], jnp.int32)
    want = jaxbwd.cross_entropy(logits, labels, reduction="none", implementation=impl)
    for ignore in (2**40, -2**40, np.int64(2**40)):
        chex.assert_trees_all_close(jaxbwd.cross_entropy(logits, labels, ignore_index=ignore, reduction="none",
                                                         implementation=impl), want)
        assert float(jaxbwd.linear_cross_entropy(x, w, labels, ignore_index=ignore, reduction="sum",
                                                 implementation=impl)) > 0.0
    with jax.enable_x64(True):
        wide = jnp.array([0, 2**40, 2], jnp.int64)
        got = jaxbwd.cross_entropy(logits, wide, ignore_index=2**40, reduction="none", implementation=impl)
        assert float(got[1]) == 0.0 and np.allclose(np.asarray(got)[[0, 2]], np.asarray(want)[[0, 2]], rtol=1e-6)
        u = jnp.array([0, 2**32 - 1, 2], jnp.uint32)
        got = jaxbwd.cross_entropy(logits, u, ignore_index=2**32 - 1, reduction="none", implementation=impl)
        assert float(got[1]) == 0.0


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("eps", [1e-6, 1e-12])
def test_layer_norm_of_constant_rows_is_exactly_the_bias(impl, eps):
    """A constant row has mean exactly its value and variance 0 (the statistics are shifted
    by the row's first element), so its output is the bias however small eps; jnp.mean
    alone gives 3.0000002 for 1000 threes, and y = -0.24 at eps=1e-12."""
    x = jnp.full((4, 1000), 3.0, f32).at[1].set(-7.5)
    w, b = jnp.linspace(0.5, 2.0, 1000), jnp.linspace(-1.0, 1.0, 1000)
    with jaxbwd.config.use(implementation=impl, interpret=True):
        y = jaxbwd.layer_norm(x, w, b, eps=eps)
        g = jax.grad(lambda x: jnp.sum(jnp.sin(jaxbwd.layer_norm(x, w, b, eps=eps))))(x)
    chex.assert_trees_all_equal(y, jnp.broadcast_to(b, x.shape))
    chex.assert_tree_all_finite(g)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_group_norm_of_constant_groups_is_exactly_the_bias(impl, activation):
    # Group 0 of sample 0 is all 3.0, group 1 all -7.5: jnp.mean's rounding of such a group
    # over 1000 elements left the output 3e-4 off the bias at eps 1e-5.
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 20, 25, 4), f32)
    x = x.at[0, ..., :2].set(3.0).at[0, ..., 2:].set(-7.5)
    w, b = jnp.array([0.5, 1.0, 1.5, 2.0]), jnp.array([-1.0, 0.25, 0.5, 1.0])
    with jaxbwd.config.use(implementation=impl, interpret=True):
        y = jaxbwd.group_norm(x, w, b, num_groups=2, eps=1e-5, activation=activation)
        g = jax.grad(lambda x: jnp.sum(jnp.sin(jaxbwd.group_norm(x, w, b, num_groups=2, activation=activation))))(x)
    want = b if activation is None else jax.nn.silu(b)
    chex.assert_trees_all_equal(y[0], jnp.broadcast_to(want, y[0].shape))
    chex.assert_tree_all_finite(g)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_layer_norm_of_a_row_near_the_f32_maximum_is_finite(impl):
    # The variance overflows and c**2 <= mean(d**2) keeps it inf (not inf - inf = NaN).
    x = jnp.array([[3e38, 0.0, 0.0, 0.0], [1.0, 2.0, 3.0, 4.0]], f32)
    w, b = jnp.ones(4), jnp.arange(4.0)
    with jaxbwd.config.use(implementation=impl, interpret=True):
        y = jaxbwd.layer_norm(x, w, b)
        g = jax.grad(lambda x: jnp.sum(jaxbwd.layer_norm(x, w, b) * b))(x)
    chex.assert_trees_all_equal(y[0], b)  # the variance overflows: rstd = 0, as flax's LayerNorm gives
    chex.assert_trees_all_close(y[1], (x[1] - 2.5) / jnp.sqrt(1.25 + 1e-5) + b, rtol=1e-6)
    chex.assert_tree_all_finite(g)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_layer_norm_rows_mixing_signs_near_the_f32_maximum_give_the_bias(impl):
    # Values 3e38 apart: the variance overflows (rstd = 0) but the sum does not.
    x = jnp.array([[3e38, -3e38, 0.0, 0.0], [1.7e38, -1.7e38, 0.0, 0.0]], f32)
    w, b = jnp.ones(4), jnp.arange(4.0)
    with jaxbwd.config.use(implementation=impl, interpret=True):
        y = jaxbwd.layer_norm(x, w, b)
        g = jax.grad(lambda x: jnp.sum(jaxbwd.layer_norm(x, w, b) * b))(x)
    chex.assert_trees_all_equal(y, jnp.broadcast_to(b, y.shape))
    chex.assert_tree_all_finite(g)


@pytest.mark.parametrize("op", ["layer_norm", "group_norm"])
@pytest.mark.parametrize("where", [0, 5])
def test_norm_statistics_with_an_outlier_are_f32_accurate(op, where):
    # A massive activation in one feature (at the slice's first element or elsewhere) among
    # values near 1: the output stays within a few f32 roundings of float64, as flax's
    # two-pass statistics do (a mean shifted by the first element lost 100x here).
    rng = np.random.default_rng(0)
    x = (1.0 + 1e-2 * rng.standard_normal((4, 64, 8))).astype(np.float32)
    x[:, where, :] = 1e3
    w, b = jnp.ones(8), jnp.zeros(8)
    if op == "layer_norm":
        x = x.reshape(4, 512)
        y = jaxbwd.layer_norm(jnp.asarray(x), jnp.ones(512), jnp.zeros(512), implementation="xla")
        x64 = x.astype(np.float64)
        m = x64.mean(-1, keepdims=True)
        want = (x64 - m) / np.sqrt(((x64 - m) ** 2).mean(-1, keepdims=True) + 1e-5)
    else:
        y = jaxbwd.group_norm(jnp.asarray(x), w, b, num_groups=2, implementation="xla")
        xg = x.reshape(4, 64, 2, 4).astype(np.float64)
        m = xg.mean((1, 3), keepdims=True)
        want = ((xg - m) / np.sqrt(((xg - m) ** 2).mean((1, 3), keepdims=True) + 1e-5)).reshape(x.shape)
    rel = np.abs(np.asarray(y, np.float64) - want) / np.abs(want)
    assert rel[np.abs(x) < 100].max() < 2e-6, rel[np.abs(x) < 100].max()


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_batch_norm_of_a_constant_channel_is_exactly_the_bias(impl):
    # Channel 0 is 3.0 over 1000 rows: jnp.mean gives 3.0000002, which at eps 1e-12 left the
    # output 0.46 off the bias (weight 2).
    x = jax.random.normal(jax.random.PRNGKey(0), (10, 100, 2), f32).at[..., 0].set(3.0)
    w, b = jnp.array([2.0, 1.0]), jnp.array([-1.0, 0.5])
    with jaxbwd.config.use(implementation=impl, interpret=True):
        y, stats = jaxbwd.batch_norm(x, w, b, running_mean=jnp.zeros(2), running_var=jnp.ones(2), momentum=0.0,
                                     eps=1e-12)
        g = jax.grad(lambda x: jnp.sum(jnp.sin(jaxbwd.batch_norm(x, w, b, eps=1e-12))))(x)
    chex.assert_trees_all_equal(y[..., 0], jnp.full((10, 100), -1.0))
    chex.assert_trees_all_equal(stats["mean"][0], jnp.float32(3.0))
    assert 0.0 <= float(stats["var"][0]) < 1e-12  # msq - c**2: rounding of the tiny d = 3 - m0
    chex.assert_tree_all_finite(g)


def test_row_slice_python_int_start_is_range_checked_array_start_clamps_as_under_jit():
    with pytest.raises(ValueError, match=r"row_slice: start must be in \[0, 2\] for size=2, got 3"):
        jaxbwd.row_slice(jnp.ones((4, 3)), 3, 2)
    x = jnp.arange(12.0).reshape(4, 3)
    for start in (jnp.int32(3), jnp.int32(-1), jnp.uint32(2**31 + 1)):
        eager = jaxbwd.row_slice(x, start, 2)
        chex.assert_trees_all_equal(eager, jax.jit(lambda s: jaxbwd.row_slice(x, s, 2))(start),  # noqa: B023
                                    jax.lax.dynamic_slice_in_dim(x, jnp.asarray(start), 2))
    np.testing.assert_array_equal(jaxbwd.row_slice(jnp.arange(12.0).reshape(4, 3), np.int64(1), 2), np.arange(3.0, 9.0).reshape(2, 3))


# Arrays of more than 2**31 elements (and more than 4 GiB, so Pallas addresses them with
# 64-bit offsets): the kernels must index [rows, cols] views, never a flat int32 index that
# wraps. Lowered from ShapeDtypeStructs: nothing is allocated.
_BIG = 2**31 + 2**27
LARGE = [
    ("silu", lambda x: jaxbwd.silu(x, implementation="pallas"), ((65536, 40960),), "silu_bwd"),
    ("gelu 1-D", lambda x: jaxbwd.gelu(x, implementation="pallas"), ((_BIG,),), "gelu_bwd"),
    ("gelu 1-D odd", lambda x: jaxbwd.gelu(x, implementation="pallas"), ((2**31 + 1,),), "gelu_bwd"),
    ("swiglu", lambda g, u: jaxbwd.swiglu(g, u, implementation="pallas"), ((65536, 40960), (65536, 40960)), "swiglu_bwd"),
    ("gated_linear_unit", lambda x: jaxbwd.gated_linear_unit(x, implementation="pallas"), ((65536, 81920),), "glu_bwd"),
    ("pixel_shuffle", lambda x: jaxbwd.pixel_shuffle(x, 2, implementation="pallas"), ((64, 512, 512, 256),), "pixel_shuffle_bwd"),
    ("unpatchify", lambda t: jaxbwd.unpatchify(t, grid=64, patch_size=8, channels=160, implementation="pallas"),
     ((64, 4096, 10240),), "unpatchify_bwd"),
    ("upsample2d", lambda x: jaxbwd.upsample2d(x, 2, implementation="pallas"), ((64, 256, 256, 640),), "upsample2d_bwd"),
]


@pytest.mark.parametrize("name,fn,shapes,kernel", LARGE, ids=[c[0] for c in LARGE])
def test_kernels_lower_past_int32_elements(name, fn, shapes, kernel):
    from jaxbwd.pallas import _common

    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes]
    assert max(np.prod(s) for s in shapes) > 2**31

    def bwd(*a):
        out, vjp = jax.vjp(fn, *a)
        return vjp(out)

    with jaxbwd.config.use(interpret=False):
        text = _common.lower_for_gpu(bwd, *args)
    ir = _common.triton_ir(text)[kernel]
    offsets = [line.rsplit(",", 1)[-1] for line in ir.splitlines() if "tt.addptr" in line]
    assert offsets and all("i64" in o for o in offsets), f"{kernel}: 32-bit address offsets: {offsets[:3]}"


@pytest.mark.parametrize("shape,rows,cols", [
    ((65536, 40960), 65536, 40960), ((2**31 + 2**27,), (2**31 + 2**27) // 1024, 1024), ((8, 3), 3, 8), ((7,), 7, 1),
    # odd sizes past int32 elements: a divisor that is not a power of two
    ((2**31 + 1,), (2**31 + 1) // 3, 3), ((3 * 5 * 7 * 2**28,), 3 * 5 * 7 * 2**18, 1024),
    ((5 * 7 * (2**31 - 1),), 2**31 - 1, 35), ((1, 3 * 715827883), 715827883, 3),
])
def test_elementwise_views_stay_in_int32(shape, rows, cols):
    from jaxbwd.pallas import _common

    assert _common.as_2d("silu", shape) == (rows, cols)


def test_unsplittable_huge_input_is_a_clear_error():
    from jaxbwd.pallas import _common

    with pytest.raises(ValueError, match=r"jaxbwd.silu: rows = 4294967311 exceeds the kernels' int32 index range"):
        _common.as_2d("silu", (2**32 + 15,))


_S, _BF, _BIG = jax.ShapeDtypeStruct, jnp.bfloat16, 2**31


@pytest.mark.parametrize("op,what,fn,args", [
    ("rms_norm", "cols", lambda x, w: jnp.sum(jaxbwd.rms_norm(x, w)), (_S((1, _BIG), _BF), _S((_BIG,), _BF))),
    ("rms_norm", "rows", lambda x, w: jnp.sum(jaxbwd.rms_norm(x, w)), (_S((_BIG + 16, 16), _BF), _S((16,), _BF))),
    ("layer_norm", "cols", lambda x, w: jnp.sum(jaxbwd.layer_norm(x, w, w)), (_S((1, _BIG), _BF), _S((_BIG,), _BF))),
    ("softmax", "cols", lambda x: jnp.sum(jnp.sin(jaxbwd.softmax(x))), (_S((1, _BIG), _BF),)),
    ("cross_entropy", "classes", lambda x, y: jaxbwd.cross_entropy(x, y), (_S((1, _BIG), _BF), _S((1,), jnp.int32))),
    ("bias_add", "cols", lambda x, b: jnp.sum(jaxbwd.bias_add(x, b)), (_S((1, _BIG), _BF), _S((_BIG,), _BF))),
    ("embed", "features", lambda t: jnp.sum(jaxbwd.embed(jnp.zeros(2, jnp.int32), t)), (_S((2, _BIG), _BF),)),
])
def test_row_kernels_past_int32_are_a_clear_error(op, what, fn, args):
    """A row-wise kernel's dimension past int32 (traced only, nothing allocated): the
    ValueError the README promises, not an overflow inside JAX."""
    with jaxbwd.config.use(implementation="pallas", interpret=True):
        with pytest.raises(ValueError, match=rf"jaxbwd\.{op}: {what} = \d+ exceeds the kernels' int32 index range"):
            jax.eval_shape(jax.grad(fn), *args)


@pytest.mark.parametrize("op,what,fn,args", [
    ("cross_entropy", "classes", lambda x, y: jaxbwd.cross_entropy(x, y, label_smoothing=0.1),
     (_S((1, _BIG), _BF), _S((1,), jnp.int32))),
    ("embed", "num_embeddings", lambda t: jnp.sum(jaxbwd.embed(jnp.zeros(2, jnp.int32), t)), (_S((_BIG + 8, 2), _BF),)),
])
def test_xla_gathers_past_int32_are_a_clear_error(op, what, fn, args):
    """The XLA path's gathers along an axis past int32 overflow inside JAX while x64 is off
    (traced only): the same named ValueError as the kernels'; with x64 on they trace."""
    with jaxbwd.config.use(implementation="xla"):
        with pytest.raises(ValueError, match=rf"jaxbwd\.{op}: {what} = \d+ exceeds JAX's int32 index range"):
            jax.eval_shape(jax.grad(fn), *args)
        with jax.enable_x64(True):
            assert jax.eval_shape(jax.grad(fn), *args).shape == args[0].shape


# ------------------------------------------- index arrays narrower than the sizes they index


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("dt", [jnp.uint8, jnp.int8, jnp.int16])
def test_narrow_integer_indices_are_compared_in_int32(dt, impl):
    """uint8/int8/int16 ids, labels and lengths address V or S past their dtype's range
    (V = 40000 for int16): compared in their own dtype, V wrapped (uint8 300 is 44) and
    valid entries were dropped or ignored."""
    V = 40000 if dt == jnp.int16 else 300
    idx = np.array([5, 100, 120] if dt != jnp.int16 else [5, 30000, 32000])
    ids = jnp.asarray(idx, dt)
    key = jax.random.PRNGKey(0)
    table = jax.random.normal(key, (V, 4), f32)
    chex.assert_trees_all_equal(jaxbwd.embed(ids, table, implementation=impl), table[idx])
    g = jax.grad(lambda t: jnp.sum(jaxbwd.embed(ids, t, implementation=impl)))(table)
    chex.assert_trees_all_equal(g[idx], jnp.ones((3, 4), f32))
    logits = jax.random.normal(key, (3, V), f32)
    want = optax_ce(logits, idx)
    chex.assert_trees_all_close(jaxbwd.cross_entropy(logits, ids, reduction="none", implementation=impl), want,
                                rtol=1e-5, atol=1e-5)
    x, w = jax.random.normal(key, (3, 8), f32), jax.random.normal(jax.random.PRNGKey(1), (8, V), f32) / 3
    chex.assert_trees_all_close(jaxbwd.linear_cross_entropy(x, w, ids, reduction="none", implementation=impl),
                                optax_ce(x @ w, idx), rtol=1e-4, atol=1e-4)
    if dt == jnp.int16:
        return
    # key lengths: 200 of S = 300 keys (uint8 clips 200 to 0..300 = 44 in its own dtype)
    q = jax.random.normal(key, (1, 4, 1, 8), f32)
    kv = jax.random.normal(jax.random.PRNGKey(2), (1, 300, 1, 8), f32)
    att = lambda n: jaxbwd.dot_product_attention(q, kv, kv, key_value_seq_lengths=n, implementation=impl)  # noqa: E731
    chex.assert_trees_all_close(att(jnp.array([100], dt)), att(jnp.array([100], i32)), atol=1e-6)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_cross_entropy_where_with_unsigned_labels(impl):
    """A row with no class left under ``where`` is ignored; uint32 labels cannot hold the
    default ignore_index -100 (an OverflowError before), so it takes an out-of-range label."""
    logits = jax.random.normal(jax.random.PRNGKey(0), (3, 300), f32)
    where = jnp.ones((3, 300), bool).at[1].set(False)
    want = jaxbwd.cross_entropy(logits, jnp.asarray([5, 100, 250], i32), where=where, implementation=impl)
    for dt in (jnp.uint32, jnp.uint8):
        got = jaxbwd.cross_entropy(logits, jnp.asarray([5, 100, 250], dt), where=where, implementation=impl)
        chex.assert_trees_all_equal(got, want)


def optax_ce(logits, labels):
    import optax

    return optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(labels, i32))


# ------------------------------------------------- integers past int32, float64 on the kernels


def test_row_slice_traced_start_past_int32_clamps_as_dynamic_slice():
    # Clipped in start's own dtype before the cast to int32 (which would wrap); negative
    # starts count from the end, as lax.dynamic_slice's.
    xs = jnp.arange(40.0).reshape(10, 4)
    for start in (jnp.uint32(2**31 + 1), jnp.uint8(200), jnp.int8(-3), jnp.int8(-128), jnp.int16(3), jnp.int32(-11)):
        want = jax.lax.dynamic_slice_in_dim(xs, start, 4)
        for impl in ("xla", "pallas"):
            got = jax.jit(lambda s: jaxbwd.row_slice(xs, s, 4, implementation=impl))(start)  # noqa: B023
            chex.assert_trees_all_equal(got, want)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_rope_positions_past_int32_do_not_wrap(impl):
    # The angle is float32(position) * inv_freq: positions past int32 (a static start_pos,
    # uint32 or, with x64, int64 ids) give the angles of float32 positions, not of wrapped ones.
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 8, 1, 16), f32)
    at = lambda p: jaxbwd.rope(x, positions=jnp.asarray(p, f32), implementation=impl)  # noqa: E731
    wide = np.arange(8, dtype=np.float64)
    _close = lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=0)  # noqa: E731
    _close(jaxbwd.rope(x, start_pos=2**40, implementation=impl), at(wide + 2**40))
    _close(jaxbwd.rope(x, positions=jnp.arange(8, dtype=jnp.uint32) + jnp.uint32(2**31 + 5), implementation=impl),
           at(wide + 2**31 + 5))
    with jax.enable_x64(True):
        got = jaxbwd.rope(x, positions=jnp.arange(8, dtype=jnp.int64) + 2**32, implementation=impl)
        g = jax.grad(lambda x: jnp.sum(jaxbwd.rope(x, start_pos=jnp.int64(2**33), implementation=impl) ** 2))(x)
    _close(got, at(wide + 2**32))
    assert not np.allclose(np.asarray(got), np.asarray(jaxbwd.rope(x, implementation=impl)))
    np.testing.assert_allclose(np.asarray(g), 2 * np.asarray(x), rtol=1e-5, atol=1e-5)  # a rotation
    # Narrow traced starts are widened to int32 before the sum (int16 32765 + 7 would wrap).
    for start in (jnp.int16(32765), jnp.int8(125), jnp.uint8(253), jnp.uint16(65533)):
        got = jax.jit(lambda s: jaxbwd.rope(x, start_pos=s, implementation=impl))(start)  # noqa: B023
        want = jaxbwd.rope(x, positions=jnp.arange(8, dtype=i32) + int(start), implementation=impl)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)  # wrapped: off by ~4


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_64bit_segment_ids_equal_only_when_equal(impl):
    # 0 and 2**32 are different segments (a cast to int32 would merge them).
    q = jax.random.normal(jax.random.PRNGKey(0), (1, 8, 1, 16), f32)
    run = lambda seg: jaxbwd.dot_product_attention(q, q, q, segment_ids=seg, implementation=impl)  # noqa: E731
    want = run(jnp.array([[0] * 4 + [1] * 4], i32))
    with jax.enable_x64(True):
        got = run(jnp.array([[0] * 4 + [2**32] * 4], jnp.int64))
        pair = run((jnp.array([[-5] * 4 + [2**40] * 4], jnp.int64), jnp.array([[-5] * 4 + [2**40] * 4], jnp.int64)))
        with pytest.raises(TypeError, match="dot_product_attention: segment_ids.0. and segment_ids.1. must have dtypes"):
            run((jnp.ones((1, 8), jnp.int64), jnp.ones((1, 8), jnp.uint64)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(pair), np.asarray(want), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_key_lengths_with_extreme_segment_ids(impl):
    # Keys past the length get an id no query holds; with ids at int32's minimum, min - 1
    # would wrap to int32's maximum, an id the queries hold.
    q = jax.random.normal(jax.random.PRNGKey(0), (1, 4, 1, 16), f32)
    lo, hi = np.iinfo(np.int32).min, np.iinfo(np.int32).max
    seg = jnp.array([[lo, hi, hi, hi]], i32)
    got = jaxbwd.dot_product_attention(q, q, q, segment_ids=seg, key_value_seq_lengths=jnp.array([2]), implementation=impl)
    same = (seg[0][:, None] == seg[0][None, :]) & (jnp.arange(4)[None, :] < 2)
    want = jaxbwd.dot_product_attention(q, q, q, mask=same[None, None], implementation="xla")
    np.testing.assert_allclose(np.asarray(got)[0, 1:], np.asarray(want)[0, 1:], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got)[0, 0], np.asarray(want)[0, 0], rtol=1e-5, atol=1e-5)


def test_float64_takes_xla_unless_pallas_is_named():
    # The kernels compute in float32: a float64 input runs XLA's formulas (float64
    # accuracy) under the default, and asking for the kernels by name is an error.
    with jax.enable_x64(True):
        q = jax.random.normal(jax.random.PRNGKey(1), (1, 8, 2, 16), jnp.float64)
        want = jaxbwd.dot_product_attention(q, q, q, is_causal=True, implementation="xla")
        with jaxbwd.config.use(implementation="pallas"):
            got = jaxbwd.dot_product_attention(q, q, q, is_causal=True)
            g = jax.grad(lambda x: jnp.sum(jaxbwd.silu(x) ** 2))(q)
        gw = jax.grad(lambda x: jnp.sum(jaxbwd.silu(x, implementation="xla") ** 2))(q)
        with pytest.raises(TypeError, match=r"dot_product_attention: implementation='pallas' has no float64 kernels"):
            jaxbwd.dot_product_attention(q, q, q, implementation="pallas")
        with pytest.raises(TypeError, match=r"jaxbwd.silu: implementation='pallas' has no float64 kernels"):
            jaxbwd.silu(q, implementation="pallas")
    assert got.dtype == jnp.float64
    chex.assert_trees_all_equal(got, want)
    chex.assert_trees_all_equal(g, gw)


@pytest.mark.parametrize("name,call", [
    ("rms_norm", lambda x, p: jaxbwd.rms_norm(x, p, implementation="pallas")),
    ("layer_norm", lambda x, p: jaxbwd.layer_norm(x, p, p, implementation="pallas")),
    ("bias_add", lambda x, p: jaxbwd.bias_add(x, p, implementation="pallas")),
    ("group_norm", lambda x, p: jaxbwd.group_norm(x[:, None, None], p, p, num_groups=2, implementation="pallas")),
    ("linear_cross_entropy", lambda x, p: jaxbwd.linear_cross_entropy(x, jnp.outer(p, p), jnp.zeros(3, i32),
                                                                        implementation="pallas")),
])
def test_float64_weights_are_seen_too(name, call):
    # A float64 operand other than the first makes the gradient float64 too: the same rule.
    with jax.enable_x64(True):
        with pytest.raises(TypeError, match=rf"jaxbwd.{name}: implementation='pallas' has no float64 kernels"):
            call(jnp.ones((3, 4), f32), jnp.ones((4,), jnp.float64))


def test_rope_float64_angles_are_float64():
    # float64 x keeps float64 positions and angles: fractional and interpolated positions
    # and positions past 2**24 (where float32 cannot count) are as exact as float64 allows.
    with jax.enable_x64(True):
        x = jax.random.normal(jax.random.PRNGKey(0), (1, 6, 1, 8), jnp.float64)

        def formula(pos, x=x):
            ang = jnp.asarray(pos, jnp.float64)[..., None, None] * 10000.0 ** (-jnp.arange(0, 8, 2) / 8.0)
            a, b = x[..., :4], x[..., 4:]
            return jnp.concatenate([a * jnp.cos(ang) - b * jnp.sin(ang), b * jnp.cos(ang) + a * jnp.sin(ang)], -1)

        frac = jnp.array([[0.1, 1.7, 2.25, 1000.3, 12345.6789, 5.0]])
        big = jnp.array([[0, 1, 2**24 + 1, 123456789, 2**30 + 3, 5]], i32)
        ar = jnp.arange(6)[None]
        for impl in ("xla", None):
            for got, want, tol in [
                (jaxbwd.rope(x, scale_factor=3.0, implementation=impl), formula(ar / 3.0), 1e-15),
                (jaxbwd.rope(x, positions=frac, implementation=impl), formula(frac), 1e-11),
                # an angle of 1e9 radians carries 1e-7 of it from inv_freq's last bit alone
                (jaxbwd.rope(x, positions=big, implementation=impl), formula(big), 1e-6),
                (jaxbwd.rope(x, start_pos=2**24 + 1, implementation=impl), formula(ar + 2**24 + 1), 1e-8),
            ]:
                assert got.dtype == jnp.float64
                np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=tol)
            g = jax.grad(lambda x: jnp.sum(jaxbwd.rope(x, positions=frac, implementation=impl) * jnp.cos(x)))(x)  # noqa: B023
            gw = jax.grad(lambda x: jnp.sum(formula(frac, x) * jnp.cos(x)))(x)
            np.testing.assert_allclose(np.asarray(g), np.asarray(gw), rtol=0, atol=1e-11)


def test_float64_runs_under_pallas_in_ops_without_kernels():
    # Ops with no kernels (XLA by design) have no float32 kernel to refuse: float64 runs
    # under any implementation, as it does in matmul, scale and residual_add.
    with jax.enable_x64(True):
        x = jax.random.normal(jax.random.PRNGKey(2), (2, 4, 4, 8), jnp.float64)
        x2 = x.reshape(8, 32)
        for name, call in [("glu", lambda i: jaxbwd.glu(x2, implementation=i)),
                           ("mse_loss", lambda i: jaxbwd.mse_loss(x2, jnp.cos(x2), implementation=i)),
                           ("avg_pool2d", lambda i: jaxbwd.avg_pool2d(x, 2, 2, implementation=i)),
                           ("adaptive_avg_pool2d", lambda i: jaxbwd.adaptive_avg_pool2d(x, 3, implementation=i)),
                           ("matmul", lambda i: jaxbwd.matmul(x2, x2.T, implementation=i))]:
            got, want = call("pallas"), call("xla")
            assert got.dtype == jnp.float64, name
            chex.assert_trees_all_equal(got, want)


def test_numpy_float64_without_x64_is_float32():
    # Without x64, jax reads a NumPy float64 array as float32: the kernels take it.
    x = np.random.default_rng(0).standard_normal((4, 8))
    y = jaxbwd.silu(x, implementation="pallas")
    assert y.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y), np.asarray(jaxbwd.silu(x, implementation="xla")), rtol=1e-6, atol=1e-6)


def test_head_dim_past_256_takes_xla_unless_pallas_is_named():
    q = jax.random.normal(jax.random.PRNGKey(0), (1, 4, 1, 264), f32)
    want = jaxbwd.dot_product_attention(q, q, q, implementation="xla")
    with jaxbwd.config.use(implementation="pallas"):
        chex.assert_trees_all_equal(jaxbwd.dot_product_attention(q, q, q), want)
    with pytest.raises(ValueError, match=r"dot_product_attention: query's head dim H must be <= 256 for the Pallas kernels, got H=264"):
        jaxbwd.dot_product_attention(q, q, q, implementation="pallas")


@pytest.mark.parametrize("pool", ["max_pool2d", "avg_pool2d"])
@pytest.mark.parametrize("padding,error", [(((1.7, 0), (0, 0)), TypeError), (((True, 0), (0, 0)), TypeError),
                                           (((-1, 0), (0, 0)), ValueError), (((1,), (0, 0)), ValueError),
                                           ((("a", "b"),), ValueError), (((None, 0),), ValueError),
                                           (((1, 0), (0, 0), (None, 1)), ValueError), (5, ValueError),
                                           (((None, 0), (0, 0)), TypeError)])
def test_pool_padding_must_be_non_negative_ints(pool, padding, error):
    x = jnp.ones((2, 8, 8, 4), f32)
    with pytest.raises(error, match=rf"jaxbwd.{pool}: padding must be .* with non-negative ints"):
        getattr(jaxbwd, pool)(x, 2, 1, padding)
    assert getattr(jaxbwd, pool)(x, 2, 1, ((jnp.int32(1), np.int64(0)), (0, 0))).shape == (2, 8, 7, 4)


@pytest.mark.parametrize("where", [(16,), (2,), (2, 8, 16, 1), (2, 7)])
def test_cross_entropy_where_of_another_shape_is_named(where):
    with pytest.raises(ValueError, match=r"jaxbwd.cross_entropy: where must have logits' shape \(2, 8, 16\) or logits' "
                                         rf"shape without the class axes \(2, 8\), got \({', '.join(map(str, where))},?\)"):
        jaxbwd.cross_entropy(jnp.zeros((2, 8, 16)), jnp.zeros((2, 8), i32), where=jnp.ones(where, bool))


def test_cross_entropy_labels_message_names_the_class_axis():
    with pytest.raises(ValueError, match=r"labels must have shape \(16,\) \(logits' shape without the class axis\), got \(4,\)"):
        jaxbwd.cross_entropy(jnp.zeros((4, 16)), jnp.zeros((4,), i32), axis=0)


def test_config_errors_name_the_setter():
    with pytest.raises(ValueError, match=r"jaxbwd.config.use: implementation must be"):
        with jaxbwd.config.use(implementation="gpu"):
            pass
    with pytest.raises(ValueError, match=r"jaxbwd.config.set_default: pallas_backend must be None, .auto., .triton. or .mosaic., got .cuda.$"):
        jaxbwd.config.set_default(pallas_backend="cuda")


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_max_pool_selects_as_xla_in_windows_with_nans(impl):
    # NaNs and -inf in windows (also windows over padding): the gradient goes where XLA's
    # select_and_scatter (flax's max_pool under autodiff) sends it; the tangent map is the
    # same selection (its transpose is the vjp).
    import flax.linen as fnn
    rng = np.random.default_rng(0)
    x = rng.integers(0, 3, (2, 5, 6, 3)).astype(np.float32)
    x[rng.random(x.shape) < 0.2] = np.nan
    x[rng.random(x.shape) < 0.1] = -np.inf
    x = jnp.asarray(x)
    t = jnp.asarray(rng.normal(size=x.shape), f32)
    for window, strides, padding in [((2, 2), (1, 1), "VALID"), ((3, 2), (2, 1), "SAME"), ((2, 3), (1, 2), ((1, 0), (1, 1)))]:
        y, vjp = jax.vjp(lambda v: jaxbwd.max_pool2d(v, window, strides, padding, implementation=impl), x)
        y_ref, vjp_ref = jax.vjp(lambda v: fnn.max_pool(v, window, strides, padding), x)
        chex.assert_trees_all_equal(jnp.isnan(y), jnp.isnan(y_ref))
        assert int(jnp.isnan(y).sum()) > 0
        ct = jnp.asarray(rng.normal(size=y.shape), f32)
        (dx,), (dx_ref,) = vjp(ct), vjp_ref(ct)
        chex.assert_trees_all_close(dx, dx_ref, rtol=1e-6, atol=1e-6)
        if FORWARD_MODE:  # jax < 0.12 has no forward mode of the ops
            dy = jax.jvp(lambda v: jaxbwd.max_pool2d(v, window, strides, padding, implementation=impl), (x,), (t,))[1]
            np.testing.assert_allclose(jnp.vdot(ct, dy), jnp.vdot(t, dx), rtol=1e-5)


def test_adaptive_avg_pool_float64_is_exact():
    with jax.enable_x64(True):
        x = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 7, 3), jnp.float64)
        y = jaxbwd.adaptive_avg_pool2d(x, (2, 3))
        ref = jnp.stack([jnp.stack([x[:, (i * 5) // 2:-(-((i + 1) * 5) // 2), (j * 7) // 3:-(-((j + 1) * 7) // 3)].mean((1, 2))
                                    for j in range(3)], 1) for i in range(2)], 1)
        assert y.dtype == jnp.float64
        # f64 rounding: a sum in another order is off by a few ulps (1.6e-14 on jaxlib 0.10.2's
        # XLA:CPU); an f32 path would be off by 1e-7.
        np.testing.assert_allclose(y, ref, rtol=1e-13)
        np.testing.assert_array_equal(jaxbwd.adaptive_avg_pool2d(jnp.ones((1, 5, 5, 1), jnp.float64), 1), 1.0)


def test_conv2d_padding_takes_numpy_int_arrays():
    x, w = jnp.ones((1, 6, 6, 3), f32), jnp.ones((3, 3, 3, 4), f32)
    want = jaxbwd.conv2d(x, w, padding=((1, 2), (0, 1)))
    chex.assert_trees_all_equal(jaxbwd.conv2d(x, w, padding=np.array([[1, 2], [0, 1]])), want)
    chex.assert_trees_all_equal(jaxbwd.conv2d(x, w, padding=np.array([1, 1])), jaxbwd.conv2d(x, w, padding=1))
    assert jaxbwd.conv2d(x, w, padding=np.array(1)).shape == (1, 6, 6, 4)
    for bad in (np.array([[1.5, 1], [1, 1]]), np.array([[True, False], [True, True]])):
        with pytest.raises(TypeError, match=r"jaxbwd.conv2d: padding must be a static Python int, got array"):
            jaxbwd.conv2d(x, w, padding=bad)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_eager_ops_pass_debug_nans_and_debug_infs(impl):
    """Called eagerly (not under jit), jax.debug_nans / debug_infs check each primitive's
    output: none may hold NaN or inf where the result is finite. The XLA attention forward started its running
    max at -inf; the embed backward left unused partial rows uninitialised (NaN in interpret
    mode), so debug_nans re-ran it without end (RecursionError)."""
    q = jax.random.normal(jax.random.PRNGKey(0), (1, 8, 2, 16))
    table, ids = jnp.ones((16, 32)), jnp.array([1, 3, 3, 7] + [5] * 70)  # id 5: a hot run
    att = lambda q: jnp.sum(jaxbwd.dot_product_attention(q, q, q, is_causal=True, implementation=impl))
    emb = lambda t: jnp.sum(jaxbwd.embed(ids, t, implementation=impl) ** 2)
    want = (jax.jit(jax.value_and_grad(att))(q), jax.jit(jax.grad(emb))(table))
    with jaxbwd.config.use(interpret=True), jax.debug_nans(True), jax.debug_infs(True):
        got = (jax.value_and_grad(att)(q), jax.grad(emb)(table))
    chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_8_bit_floats_are_refused_by_name(dtype):
    # Every op, every differentiable argument: a TypeError naming the op and the dtype (the
    # kernels and formulas are written for 16- to 64-bit floats; 8-bit results and gradients
    # would be silently rounded to 8 bits).
    from jaxbwd import registry

    for spec in registry.ops():
        if spec.family == "user":  # registered by other tests: a user op's dtypes are its author's
            continue
        args, kwargs = spec.examples[0].make(jax.random.PRNGKey(0), jnp.dtype("float32"))
        for i in spec.diff_argnums:
            bad = list(args)
            bad[i] = bad[i].astype(dtype)
            with pytest.raises(TypeError, match=rf"^jaxbwd\.{spec.name}: .*got {dtype}"):
                spec.fn(*bad, **kwargs)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_group_norm_with_empty_groups_returns_an_empty_array(impl):
    # Empty spatial axes or C = 0: a zero-size result, as flax's GroupNorm gives (not a
    # division by zero in the statistics).
    with jaxbwd.config.use(implementation=impl, interpret=True):
        for shape, C, G in [((2, 0, 6), 6, 2), ((2, 3, 0), 0, 1), ((1, 0, 4, 4), 4, 2)]:
            x, w = jnp.ones(shape, f32), jnp.ones((C,), f32)
            chex.assert_shape(jaxbwd.group_norm(x, w, w, num_groups=G), shape)
            g = jax.grad(lambda x: jnp.sum(jaxbwd.group_norm(x, w, w, num_groups=G)))(x)  # noqa: B023
            chex.assert_shape(g, shape)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_cross_entropy_of_zero_rows_with_where_or_axis_is_zero(impl):
    # The mean over no rows is 0.0 with or without where/axis (the flattening spelled -1,
    # which cannot be inferred for a zero-size array).
    labels = jnp.zeros((0,), jnp.int32)
    cases = [(jnp.ones((0, 3)), dict(where=jnp.ones((0,), bool))), (jnp.ones((0, 3)), dict(where=jnp.ones((0, 3), bool))),
             (jnp.ones((3, 0)), dict(axis=0)), (jnp.ones((0, 2, 3)), dict(axis=(1, 2)))]
    with jaxbwd.config.use(implementation=impl, interpret=True):
        for logits, kw in cases:
            assert float(jaxbwd.cross_entropy(logits, labels, **kw)) == 0.0
            g = jax.grad(lambda x: jaxbwd.cross_entropy(x, labels, **kw))(logits)  # noqa: B023
            chex.assert_shape(g, logits.shape)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_softmax_of_a_row_with_plus_inf_is_nan_as_jax_nn(impl):
    # Was [0, nan, 0]: the +inf max was replaced by 0 as a -inf one is, hiding the bad row.
    x = jnp.array([[1.0, jnp.inf, 2.0], [1.0, jnp.nan, 2.0], [-jnp.inf, -jnp.inf, -jnp.inf], [1.0, 2.0, 3.0]], f32)
    with jaxbwd.config.use(implementation=impl, interpret=True):
        y = jaxbwd.softmax(x)
        g = jax.grad(lambda x: jnp.sum(jnp.sin(jaxbwd.softmax(x))))(x)  # the kernel under "pallas"
    assert bool(jnp.all(jnp.isnan(y[:2])))  # jax.nn.softmax's rows; an all -inf row is 0 (documented)
    chex.assert_trees_all_close(y[2:], jnp.stack([jnp.zeros(3), jax.nn.softmax(x[3])]), rtol=1e-6)
    chex.assert_trees_all_close(y, reference.softmax(x), rtol=1e-6)  # NaN where NaN
    assert bool(jnp.all(jnp.isnan(g[:2])))
    g_nn = jax.grad(lambda x: jnp.sum(jnp.sin(jax.nn.softmax(x))))(x)
    chex.assert_trees_all_close(g[2:], jnp.stack([jnp.zeros(3), g_nn[3]]), rtol=1e-6)


def _vmapped_weight_case(op):
    """f(x, w) of one op with x shared and w batched under vmap, and (x, a batch of 2 w)."""
    k = jax.random.split(jax.random.PRNGKey(3), 2)
    labels = jnp.array([1, 0, 10, 3, 4, 5])
    if op == "dense-attention":  # a bias sends attention to its dense XLA path
        x = jax.random.normal(k[0], (1, 6, 2, 8))
        bias = jnp.linspace(-1, 1, 72).reshape(1, 2, 6, 6)
        return (lambda q, kv: jaxbwd.dot_product_attention(q, kv, kv, bias=bias, implementation="xla"),
                x, jax.random.normal(k[1], (2, 1, 6, 2, 8)))
    x = jax.random.normal(k[0], (6, 8))
    if op == "matmul":
        return lambda x, w: jaxbwd.matmul(x, w, implementation="xla"), x, jax.random.normal(k[1], (2, 8, 13))
    transpose = op.endswith("transpose_w")
    w = jax.random.normal(k[1], (2, 13, 8) if transpose else (2, 8, 13)) * 0.5
    return (lambda x, w: jaxbwd.linear_cross_entropy(x, w, labels, transpose_w=transpose, implementation="xla"),
            x, w)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("op", ["matmul", "linear_cross_entropy", "linear_cross_entropy-transpose_w", "dense-attention"])
def test_16bit_grads_of_a_vmapped_weight_on_the_xla_path(op, dtype):
    """vmap over a weight against shared activations, 16-bit, XLA path: XLA's CPU runtime has
    no 16-bit x 16-bit -> f32 dot in the layouts this gives (``vjp._base.dot_operands``); the
    gradients equal the float32 ones to 16-bit rounding."""
    f, x, ws = _vmapped_weight_case(op)

    def grads(x, ws):
        return jax.grad(lambda ws: jnp.sum(jax.vmap(lambda w: f(x, w))(ws).astype(jnp.float32)))(ws)

    g = jax.jit(grads)(x.astype(dtype), ws.astype(dtype))
    assert g.dtype == jnp.dtype(dtype)
    want = grads(x.astype(dtype).astype(jnp.float32), ws.astype(dtype).astype(jnp.float32))
    testing.assert_close(g, want, testing.TOL[dtype])


@pytest.mark.parametrize("platform, operand", [("cuda", "bf16"), ("cpu", "f32")])
def test_16bit_xla_dots_upcast_only_where_lowered_for_cpu(platform, operand):
    """The CPU workaround above is chosen per lowering platform: lowered for CUDA (from this
    CPU machine too) the XLA path's dots keep bfloat16 operands for the tensor cores."""
    import re

    x, w = jax.ShapeDtypeStruct((6, 8), jnp.bfloat16), jax.ShapeDtypeStruct((8, 13), jnp.bfloat16)
    f = jax.value_and_grad(lambda x, w: jnp.sum(jaxbwd.matmul(x, w, implementation="xla").astype(jnp.float32)),
                           argnums=(0, 1))
    text = jax.jit(f).trace(x, w).lower(lowering_platforms=(platform,)).as_text()
    dots = re.findall(r"stablehlo\.dot_general[^\n]*: \((tensor<[^)]*)\)", text)
    assert len(dots) == 3, dots  # the forward's y and the backward's dx and dw
    assert all(re.fullmatch(rf"tensor<\w+x{operand}>, tensor<\w+x{operand}>", d) for d in dots), dots


@pytest.mark.parametrize("x,factor,want", [(1e-3, 1e5, 100.0625), (1e4, 1e-8, 1.0e-4), (0.5, 65536, 32768.0)])
def test_scale_of_float16_rounds_once(x, factor, want):
    """``scale`` multiplies in float32 and rounds once: the factor need not fit float16 (1e5
    and 65536 overflow it, 1e-8 flushes to zero), only the product; the gradient too."""
    x16 = jnp.float16(x)
    want16 = jnp.float16(float(x16) * factor)
    assert float(want16) == pytest.approx(want, rel=1e-3)
    out, vjp = jax.vjp(lambda v: jaxbwd.scale(v, factor), x16)
    assert out.dtype == jnp.float16 and out == want16
    (g,) = vjp(x16)  # a cotangent of x's size: the gradient is the same product
    assert g.dtype == jnp.float16 and g == want16
