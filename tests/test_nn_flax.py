"""jaxbwd.nn in place of flax's modules: flax's constructor arguments, outputs, grads, dtypes.

The cases follow the ones flax checks for its own normalization, linear, embed and conv
modules (masks, reduction axes, use_scale/use_bias off, group sizes, 1-D/2-D/3-D kernels,
circular/reflect/causal padding, grouped and masked kernels, unbatched and multi-batch
inputs, mixed precision), each run with jaxbwd's module and compared to flax's module of
the same name and arguments, for both implementations (Pallas kernels in interpret mode).
Where the module's docstring says a configuration takes the kernel path, the test also
checks that jaxbwd's op (one primitive; a custom_vjp before jax 0.12) is in the traced computation.
"""
from __future__ import annotations

import chex
import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxbwd
import jaxbwd.nn as jnn
import jaxbwd.nn.nnx as jnnx

IMPLS = ["xla", "pallas"]


def _rand(shape, seed=0, dtype=jnp.float32):
    return jax.random.normal(jax.random.PRNGKey(seed), shape).astype(dtype)


def _uses_jaxbwd(fn, *args) -> bool:
    # A jaxbwd op is one hijax primitive (its rules named) from jax 0.12, a custom_vjp before.
    text = str(jax.make_jaxpr(fn)(*args))
    return "_Rules(name=" in text or "custom_vjp_call" in text


def _tol(*trees):
    """bf16/f16 tolerances when any leaf of ``trees`` is 16-bit (its rounding shows in grads too)."""
    leaves = [l for t in trees for l in jax.tree_util.tree_leaves(t) if hasattr(l, "dtype")]
    narrow = any(jnp.issubdtype(l.dtype, jnp.floating) and jnp.dtype(l.dtype).itemsize <= 2 for l in leaves)
    return dict(atol=2e-2, rtol=2e-2) if narrow else dict(atol=1e-5, rtol=1e-5)


def _linen_case(name, kwargs, x, kernel, impl, call_kwargs=None, method=None):
    """jaxbwd.nn.<name>(**kwargs) against flax.linen.<name>(**kwargs): params, value, dtype, grads."""
    call_kwargs = call_kwargs or {}
    ours = getattr(jnn, name)(**kwargs, implementation=impl)
    theirs = getattr(fnn, name)(**kwargs)
    params = theirs.init(jax.random.PRNGKey(1), x, **call_kwargs)
    chex.assert_trees_all_equal(ours.init(jax.random.PRNGKey(1), x, **call_kwargs), params)

    def f(mod, p, x):
        return mod.apply(p, x, **call_kwargs) if method is None else mod.apply(p, x, method=method)

    y, want = f(ours, params, x), f(theirs, params, x)
    assert y.dtype == want.dtype and y.shape == want.shape
    tol = _tol(want, x, params)
    chex.assert_trees_all_close(y, want, **tol)
    if jnp.issubdtype(x.dtype, jnp.floating):
        loss = lambda mod: lambda p, x: jnp.sum(jnp.sin(f(mod, p, x).astype(jnp.float32)))
        g, gw = jax.grad(loss(ours), argnums=(0, 1))(params, x), jax.grad(loss(theirs), argnums=(0, 1))(params, x)
    else:
        loss = lambda mod: lambda p: jnp.sum(jnp.sin(f(mod, p, x).astype(jnp.float32)))
        g, gw = jax.grad(loss(ours))(params), jax.grad(loss(theirs))(params)
    chex.assert_trees_all_close(g, gw, **tol)
    assert _uses_jaxbwd(lambda p, x: f(ours, p, x), params, x) == kernel, "kernel path as documented"
    return y


# ----------------------------------------------------------------------------- norms
NORM_CASES = [
    # name, kwargs, input shape, takes the kernel path
    ("RMSNorm", {}, (2, 3, 8), True),
    ("RMSNorm", {"use_scale": False, "epsilon": 1e-5}, (2, 3, 4), True),
    ("RMSNorm", {"use_scale": False, "epsilon": 1e-5, "reduction_axes": 1}, (2, 3, 4), False),
    ("RMSNorm", {"reduction_axes": (1, 2)}, (2, 3, 4), False),
    ("RMSNorm", {"feature_axes": -2, "reduction_axes": -2}, (2, 5, 4), False),
    ("RMSNorm", {"force_float32_reductions": False}, (2, 3, 8), False),
    ("RMSNorm", {"scale_init": fnn.initializers.uniform()}, (7, 8), True),
    ("LayerNorm", {}, (2, 3, 8), True),
    ("LayerNorm", {"use_bias": False, "use_scale": False, "epsilon": 1e-5}, (2, 3, 4), True),
    ("LayerNorm", {"use_bias": False}, (2, 3, 4), True),
    ("LayerNorm", {"use_fast_variance": False}, (2, 3, 4), True),
    ("LayerNorm", {"reduction_axes": 1, "feature_axes": -1}, (2, 3, 4), False),
    ("LayerNorm", {"reduction_axes": (1, 2)}, (2, 3, 4), False),
    ("LayerNorm", {"reduction_axes": (0, 1, 2)}, (2, 3, 4), False),
    ("LayerNorm", {"reduction_axes": -2, "feature_axes": (1, 3),
                   "bias_init": fnn.initializers.uniform(), "scale_init": fnn.initializers.uniform()}, (2, 3, 4, 5), False),
    ("GroupNorm", {"num_groups": 2, "use_bias": False, "use_scale": False, "epsilon": 1e-5}, (2, 5, 4, 4, 32), True),
    ("GroupNorm", {"num_groups": 4}, (2, 3, 3, 8), True),
    ("GroupNorm", {"num_groups": None, "group_size": 1,
                   "bias_init": fnn.initializers.uniform(), "scale_init": fnn.initializers.uniform()}, (2, 3, 4, 5), True),
    ("GroupNorm", {"num_groups": 1}, (2, 3, 4, 5), True),
    ("GroupNorm", {"num_groups": 2, "reduction_axes": (0, 1, 3, 4)}, (2, 5, 4, 4, 32), False),
    ("GroupNorm", {"num_groups": 2, "reduction_axes": (-3, -2, -1)}, (3, 4, 32), False),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name,kwargs,shape,kernel", NORM_CASES,
                         ids=[f"{n}-{i}" for i, (n, *_r) in enumerate(NORM_CASES)])
def test_linen_norms_match_flax(name, kwargs, shape, kernel, impl):
    _linen_case(name, kwargs, _rand(shape), kernel, impl)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", ["RMSNorm", "LayerNorm", "GroupNorm"])
@pytest.mark.parametrize("x_dtype,dtype,param_dtype", [
    (jnp.bfloat16, None, jnp.float32),      # flax promotes to float32
    (jnp.bfloat16, None, jnp.bfloat16),
    (jnp.float32, jnp.bfloat16, jnp.float32),
    (jnp.bfloat16, jnp.float32, jnp.bfloat16),
])
def test_linen_norm_dtype_promotion(name, x_dtype, dtype, param_dtype, impl):
    kw = {"dtype": dtype, "param_dtype": param_dtype}
    if name == "GroupNorm":
        kw["num_groups"] = 2
    _linen_case(name, kw, _rand((2, 3, 8), dtype=x_dtype), True, impl)


@pytest.mark.parametrize("name,extra", [("LayerNorm", 2), ("RMSNorm", 1), ("GroupNorm", 2)])
def test_linen_norm_masks_take_flax_path(name, extra):
    # A masked normalisation: statistics over the unmasked entries only.
    x = _rand((3, 4, 14))
    m = jax.random.bernoulli(jax.random.PRNGKey(5), 0.5, x.shape).at[..., :extra].set(True)
    kw = {"num_groups": 7, "use_bias": False, "use_scale": False} if name == "GroupNorm" else {}
    y = _linen_case(name, kw, jnp.where(m, x, jnp.nan), False, "xla", call_kwargs={"mask": m})
    if name == "LayerNorm":
        np.testing.assert_allclose(y.mean(-1, where=m), 0, atol=1e-4)
        np.testing.assert_allclose(y.var(-1, where=m), 1, atol=1e-4)
    elif name == "RMSNorm":
        np.testing.assert_allclose(jnp.square(y).mean(-1, where=m), 1, atol=1e-4)


def test_linen_layer_norm_large_offset_two_pass():
    # Rows shifted by 1e6, against float64: the shifted two-pass statistics leave only the
    # float32 rounding of the mean (its ulp at 1e6 is 1/16, so up to 1/32 off; the same
    # formula on jnp.mean is 0.043 off here)
    x = _rand((2, 3, 4)) + 1e6
    y = jnn.LayerNorm(use_bias=False, use_scale=False, epsilon=1e-5, use_fast_variance=False).init_with_output(
        jax.random.PRNGKey(0), x)[0]
    x64 = np.asarray(x, np.float64)
    want = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(y, want, atol=1 / 32, rtol=0)


def test_linen_group_norm_closed_form():
    x = _rand((2, 5, 4, 4, 32))
    y = jnn.GroupNorm(num_groups=2, use_bias=False, use_scale=False, epsilon=1e-5).init_with_output(
        jax.random.PRNGKey(0), x)[0]
    xg = x.reshape(2, 5, 4, 4, 2, 16)
    want = (xg - xg.mean((1, 2, 3, 5), keepdims=True)) * jax.lax.rsqrt(xg.var((1, 2, 3, 5), keepdims=True) + 1e-5)
    np.testing.assert_allclose(y, want.reshape(x.shape), atol=1e-4)


@pytest.mark.parametrize("kwargs", [{"num_groups": 3}, {"num_groups": 3, "reduction_axes": (0, 1, 2, 3)},
                                    {"num_groups": 2, "group_size": 4}])
def test_linen_group_norm_raises_as_flax(kwargs):
    with pytest.raises(ValueError):
        jnn.GroupNorm(**kwargs).init(jax.random.PRNGKey(0), _rand((2, 5, 4, 4, 32)))


def test_linen_group_norm_activation_on_both_paths():
    x = _rand((2, 3, 4, 8))
    for kw in ({"num_groups": 2}, {"num_groups": 2, "reduction_axes": (0, 1, 2, 3)}):
        p = fnn.GroupNorm(**kw).init(jax.random.PRNGKey(1), x)
        y = jnn.GroupNorm(**kw, activation="silu").apply(p, x)
        chex.assert_trees_all_close(y, jax.nn.silu(fnn.GroupNorm(**kw).apply(p, x)), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="activation"):
        jnn.GroupNorm(num_groups=2, activation="relu").init(jax.random.PRNGKey(1), x)


def test_linen_positional_order_is_flax():
    # flax's positional order: GroupNorm(num_groups, group_size, epsilon, ...), Conv(features, kernel_size, strides,
    # padding, ...), Dense(features, use_bias, dtype, ...), LayerNorm(epsilon, dtype, ...).
    x = _rand((2, 6, 6, 8))
    for ours, theirs in [(jnn.GroupNorm(4, None, 1e-3), fnn.GroupNorm(4, None, 1e-3)),
                         (jnn.Conv(3, (2, 2), 2, "VALID"), fnn.Conv(3, (2, 2), 2, "VALID")),
                         (jnn.Dense(5, False, jnp.bfloat16), fnn.Dense(5, False, jnp.bfloat16)),
                         (jnn.LayerNorm(1e-3, jnp.bfloat16), fnn.LayerNorm(1e-3, jnp.bfloat16))]:
        p = theirs.init(jax.random.PRNGKey(0), x)
        y, want = ours.apply(p, x), theirs.apply(p, x)
        assert y.dtype == want.dtype
        chex.assert_trees_all_close(y, want, **_tol(want, p))


def test_rms_norm_weight_offset_needs_kernel_path():
    x = _rand((2, 3, 8))
    p = {"params": {"scale": jnp.zeros((8,))}}
    y = jnn.RMSNorm(weight_offset=1.0).apply(p, x)
    chex.assert_trees_all_close(y, fnn.RMSNorm(use_scale=False).apply({}, x), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="jaxbwd.nn.RMSNorm: weight_offset"):
        jnn.RMSNorm(weight_offset=1.0, reduction_axes=1).init(jax.random.PRNGKey(0), x)
    with pytest.raises(ValueError, match=r"jaxbwd.nn.RMSNorm: weight_offset .* got .*epsilon=0.0"):
        jnn.RMSNorm(weight_offset=1.0, epsilon=0.0).init(jax.random.PRNGKey(0), x)
    # nnx: the same extra (Gemma's 1 + scale, scale initialised to zeros)
    zeros = nnx.initializers.zeros_init()
    y = jnnx.RMSNorm(8, weight_offset=1.0, scale_init=zeros, rngs=nnx.Rngs(0))(x)
    chex.assert_trees_all_close(y, nnx.RMSNorm(8, use_scale=False, rngs=nnx.Rngs(0))(x), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="jaxbwd.nn.nnx.RMSNorm: weight_offset"):
        jnnx.RMSNorm(8, weight_offset=1.0, reduction_axes=1, rngs=nnx.Rngs(0))(x)
    # an offset of a scale parameter that use_scale=False leaves out: refused, not ignored
    off = r"RMSNorm: weight_offset offsets the scale parameter, .* got weight_offset=1.0 with use_scale=False"
    with pytest.raises(ValueError, match="jaxbwd.nn." + off):
        jnn.RMSNorm(use_scale=False, weight_offset=1.0)
    with pytest.raises(ValueError, match="jaxbwd.nn.nnx." + off):
        jnnx.RMSNorm(8, use_scale=False, weight_offset=1.0, rngs=nnx.Rngs(0))
    chex.assert_trees_all_close(jnn.RMSNorm(use_scale=False, weight_offset=0.0).apply({}, x),
                                fnn.RMSNorm(use_scale=False).apply({}, x), atol=1e-5)


# ---------------------------------------------------------------------- dense, embed
DENSE_CASES = [
    ({"features": 4}, (1, 3), jnp.float32, True),
    ({"features": 4}, (2, 7, 3), jnp.float32, True),                      # extra batch dims
    ({"features": 4, "use_bias": False}, (5, 3), jnp.float32, True),
    ({"features": 4}, (3,), jnp.float32, True),                           # unbatched
    ({"features": 4}, (2, 3), jnp.bfloat16, True),                        # bf16 x, f32 params -> f32
    ({"features": 4, "dtype": jnp.bfloat16}, (2, 3), jnp.float32, True),
    ({"features": 4, "param_dtype": jnp.bfloat16}, (2, 3), jnp.bfloat16, True),
    ({"features": 4, "precision": jax.lax.Precision.HIGHEST}, (2, 3), jnp.float32, False),
    ({"features": 4, "dot_general": jax.lax.dot_general}, (2, 3), jnp.float32, False),
    ({"features": 4, "kernel_init": fnn.initializers.ones, "bias_init": fnn.initializers.ones}, (1, 3), jnp.float32, True),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kwargs,shape,x_dtype,kernel", DENSE_CASES)
def test_linen_dense_matches_flax(kwargs, shape, x_dtype, kernel, impl):
    _linen_case("Dense", kwargs, _rand(shape, dtype=x_dtype), kernel, impl)


def test_linen_dense_closed_form():
    y = jnn.Dense(4, kernel_init=fnn.initializers.ones, bias_init=fnn.initializers.ones).init_with_output(
        jax.random.PRNGKey(0), jnp.ones((1, 3)))[0]
    np.testing.assert_allclose(y, np.full((1, 4), 4.0))


IDS = jnp.array([[0, 3, 9], [2, 2, 5]])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kwargs,ids,kernel", [
    ({"num_embeddings": 10, "features": 3}, IDS, True),
    ({"num_embeddings": 10, "features": 3, "dtype": jnp.bfloat16}, IDS, True),
    ({"num_embeddings": 10, "features": 3, "param_dtype": jnp.bfloat16}, IDS, True),
    ({"num_embeddings": 10, "features": 3}, jnp.array([-1, -10, 10, 12, 4]), True),   # wrap and NaN rows, as jnp.take
    ({"num_embeddings": 1, "features": 3}, jnp.array([0, 0]), False),
    ({"num_embeddings": 10, "features": 3}, jnp.array(4), True),                      # scalar id
])
def test_linen_embed_matches_flax(kwargs, ids, kernel, impl):
    ours, theirs = jnn.Embed(**kwargs, implementation=impl), fnn.Embed(**kwargs)
    params = theirs.init(jax.random.PRNGKey(1), ids)
    chex.assert_trees_all_equal(ours.init(jax.random.PRNGKey(1), ids), params)
    y, want = ours.apply(params, ids), theirs.apply(params, ids)
    assert y.dtype == want.dtype
    np.testing.assert_array_equal(np.isnan(np.asarray(y, np.float32)), np.isnan(np.asarray(want, np.float32)))
    chex.assert_trees_all_close(jnp.nan_to_num(y), jnp.nan_to_num(want))
    assert _uses_jaxbwd(lambda p: ours.apply(p, ids), params) == kernel
    ok = (ids >= -kwargs["num_embeddings"]) & (ids < kwargs["num_embeddings"])
    loss = lambda mod: lambda p: jnp.sum(jnp.where(ok[..., None], jnp.sin(mod.apply(p, ids)), 0).astype(jnp.float32))
    chex.assert_trees_all_close(jax.grad(loss(ours))(params), jax.grad(loss(theirs))(params), **_tol(want, params))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("q_dtype,dtype", [(jnp.float32, None), (jnp.bfloat16, None), (jnp.float32, jnp.bfloat16)])
def test_linen_embed_attend_promotes_as_flax(q_dtype, dtype, impl):
    # A tied LM head with bf16 activations and f32 embeddings gives f32 logits, as flax.
    kw = {"num_embeddings": 10, "features": 3, "dtype": dtype}
    ours, theirs = jnn.Embed(**kw, implementation=impl), fnn.Embed(**kw)
    params = theirs.init(jax.random.PRNGKey(1), IDS)
    q = _rand((2, 5, 3), dtype=q_dtype)
    f = lambda mod: lambda p, q: mod.apply(p, q, method="attend")
    y, want = f(ours)(params, q), f(theirs)(params, q)
    assert y.dtype == want.dtype
    tol = _tol(want, q)
    chex.assert_trees_all_close(y, want, **tol)
    loss = lambda mod: lambda p, q: jnp.sum(jnp.sin(f(mod)(p, q).astype(jnp.float32)))
    chex.assert_trees_all_close(jax.grad(loss(ours), (0, 1))(params, q), jax.grad(loss(theirs), (0, 1))(params, q), **tol)
    assert _uses_jaxbwd(f(ours), params, q)


# ----------------------------------------------------------------------------- conv
def _ones_conv(**kw):
    return dict(kernel_init=fnn.initializers.ones, bias_init=fnn.initializers.ones, **kw)


CONV_CASES = [
    ({"features": 4, "kernel_size": (3,), "padding": "VALID", **_ones_conv()}, (1, 8, 3), True),
    ({"features": 4, "kernel_size": (3,), "padding": "VALID", "use_bias": False, **_ones_conv()}, (1, 8, 3), True),
    ({"features": 4, "kernel_size": (3,), "padding": "VALID", **_ones_conv()}, (2, 5, 8, 3), True),   # 2 batch dims
    ({"features": 4, "kernel_size": (3,), "padding": "VALID", **_ones_conv()}, (8, 3), True),         # unbatched
    ({"features": 4, "kernel_size": (3,), "padding": "VALID", "mask": jnp.tril(jnp.ones((3, 3, 4)))}, (8, 3), True),
    ({"features": 4, "kernel_size": (3,), "feature_group_count": 2, "padding": "VALID"}, (1, 8, 4), True),
    ({"features": 2, "kernel_size": 3, "padding": "CIRCULAR"}, (3, 8, 3), True),
    ({"features": 2, "kernel_size": (9,), "padding": "CIRCULAR"}, (1, 8, 1), True),
    ({"features": 2, "kernel_size": (3,), "padding": "CIRCULAR", "kernel_dilation": 3}, (1, 11, 1), True),
    ({"features": 2, "kernel_size": (3, 3), "padding": "CIRCULAR"}, (2, 4, 5, 3), True),
    ({"features": 1, "kernel_size": (3,), "strides": (2,), "padding": "REFLECT"}, (1, 5, 1), True),
    ({"features": 1, "kernel_size": (3, 3), "padding": "REFLECT"}, (1, 3, 3, 1), True),
    ({"features": 4, "kernel_size": (3,), "padding": "CAUSAL", **_ones_conv()}, (1, 8, 4), True),
    ({"features": 3, "kernel_size": (3, 3), "strides": 2, "padding": "SAME"}, (2, 7, 9, 4), True),
    ({"features": 3, "kernel_size": (3, 2), "padding": ((1, 0), (2, 1)), "kernel_dilation": (1, 2)}, (1, 6, 7, 2), True),
    ({"features": 3, "kernel_size": (3, 3), "padding": 1}, (1, 5, 5, 2), True),
    ({"features": 4, "kernel_size": (3, 3), "feature_group_count": 4}, (1, 5, 5, 4), True),            # depthwise
    ({"features": 3, "kernel_size": (2, 2, 2)}, (1, 4, 4, 4, 2), False),                               # 3-D
    ({"features": 3, "kernel_size": (3, 3), "input_dilation": 2, "padding": 1}, (1, 4, 4, 2), False),
    ({"features": 3, "kernel_size": (3, 3), "padding": "SAME_LOWER"}, (1, 4, 4, 2), False),
    ({"features": 3, "kernel_size": (3, 3), "precision": jax.lax.Precision.HIGHEST}, (1, 4, 4, 2), False),
    # Empty outputs: flax returns them, jaxbwd.conv2d would raise, so flax's code runs.
    ({"features": 4, "kernel_size": (5, 5), "padding": "VALID"}, (2, 4, 4, 3), False),
    ({"features": 4, "kernel_size": (3, 3), "padding": -1}, (2, 4, 4, 3), False),
    ({"features": 4, "kernel_size": (3, 3), "padding": "VALID", "kernel_dilation": 2}, (2, 4, 4, 3), False),
    ({"features": 3, "kernel_size": (3, 3), **_ones_conv()}, (1, 4, 4, 0), False),  # no input channels (ones:
    # jax 0.10's default initializer divides by the zero fan-in)
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kwargs,shape,kernel", CONV_CASES, ids=[f"conv{i}" for i in range(len(CONV_CASES))])
def test_linen_conv_matches_flax(kwargs, shape, kernel, impl):
    _linen_case("Conv", kwargs, _rand(shape), kernel, impl)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("x_dtype,dtype,param_dtype", [(jnp.bfloat16, None, jnp.float32),
                                                       (jnp.float32, jnp.bfloat16, jnp.float32)])
def test_linen_conv_dtype_promotion(x_dtype, dtype, param_dtype, impl):
    _linen_case("Conv", {"features": 3, "kernel_size": (3, 3), "dtype": dtype, "param_dtype": param_dtype},
                _rand((1, 5, 5, 2), dtype=x_dtype), True, impl)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("padding,crop", [(((-1, 1), (0, 0)), (slice(1, None), slice(None))),
                                          (((2, -2), (-1, -1)), (slice(0, -2), slice(1, -1))),
                                          (-1, (slice(1, -1), slice(1, -1)))])
def test_linen_conv_negative_padding_crops_on_the_kernel_path(padding, crop, impl):
    # Negative padding is a crop of the input (lax.conv_general_dilated's meaning). The
    # reference is flax's Conv on the input cropped by slicing, with the rest of the padding:
    # flax's own negative-padding call is not one, as XLA:CPU in jaxlib 0.10.2 computes its
    # backward from out-of-bounds reads (openxla/xla#48713).
    x = _rand((2, 7, 6, 3))
    pad = ((padding, padding), (padding, padding)) if isinstance(padding, int) else padding
    ours = jnn.Conv(4, (3, 3), padding=padding, implementation=impl)
    theirs = fnn.Conv(4, (3, 3), padding=tuple((max(lo, 0), max(hi, 0)) for lo, hi in pad))
    cropped = lambda x: x[(slice(None),) + crop]
    params = theirs.init(jax.random.PRNGKey(1), cropped(x))
    chex.assert_trees_all_equal(ours.init(jax.random.PRNGKey(1), x), params)
    loss = lambda f: lambda p, x: jnp.sum(jnp.sin(f(p, x)))
    y, g = ours.apply(params, x), jax.grad(loss(ours.apply), argnums=(0, 1))(params, x)
    ref = lambda p, x: theirs.apply(p, cropped(x))
    want, gw = ref(params, x), jax.grad(loss(ref), argnums=(0, 1))(params, x)
    assert y.shape == want.shape
    chex.assert_trees_all_close((y, g), (want, gw), atol=1e-5, rtol=1e-5)
    assert _uses_jaxbwd(lambda p, x: ours.apply(p, x), params, x)


def test_linen_conv_closed_forms():
    # Constant inputs and kernels: each output counts the taps it sees.
    y = jnn.Conv(4, (3,), padding="CAUSAL", **_ones_conv()).init_with_output(jax.random.PRNGKey(0), jnp.ones((1, 8, 4)))[0]
    np.testing.assert_allclose(y[0, :, 0], [5, 9, 13, 13, 13, 13, 13, 13])
    m = jnp.tril(jnp.ones((3, 3, 4)))
    y = jnn.Conv(4, (3,), padding="VALID", mask=m, **_ones_conv()).init_with_output(
        jax.random.PRNGKey(0), jnp.ones((8, 3)))[0]
    np.testing.assert_allclose(y, np.tile([10.0, 7.0, 4.0, 1.0], (6, 1)))
    # Reflect padding with a stride on 1..5 and kernel (1, 2, 1).
    k = jnp.array([1.0, 2.0, 1.0]).reshape(3, 1, 1)
    y = jnn.Conv(1, (3,), strides=(2,), padding="REFLECT", kernel_init=lambda *_: k).init_with_output(
        jax.random.PRNGKey(0), jnp.arange(1.0, 6.0).reshape(1, 5, 1))[0]
    np.testing.assert_allclose(y[0, :, 0], [2 + 2 + 2, 2 + 6 + 4, 4 + 10 + 4])


# ------------------------------------------------------------------------------ NNX
def _nnx_case(name, args, kwargs, x, kernel, impl, call=lambda m, x: m(x)):
    ours = getattr(jnnx, name)(*args, **kwargs, rngs=nnx.Rngs(0), implementation=impl)
    theirs = getattr(nnx, name)(*args, **kwargs, rngs=nnx.Rngs(0))
    chex.assert_trees_all_equal(nnx.state(ours, nnx.Param), nnx.state(theirs, nnx.Param))
    y, want = call(ours, x), call(theirs, x)
    assert y.dtype == want.dtype and y.shape == want.shape
    tol = _tol(want, x, nnx.state(theirs, nnx.Param))
    chex.assert_trees_all_close(y, want, **tol)
    loss = lambda m: jnp.sum(jnp.sin(call(m, x).astype(jnp.float32)))
    g, gw = nnx.grad(loss)(ours), nnx.grad(loss)(theirs)
    chex.assert_trees_all_close(nnx.state(g, nnx.Param), nnx.state(gw, nnx.Param), **tol)
    graphdef, state = nnx.split(ours)
    assert _uses_jaxbwd(lambda s, x: call(nnx.merge(graphdef, s), x), state, x) == kernel


NNX_CASES = [
    ("RMSNorm", (8,), {}, (2, 3, 8), True),
    ("RMSNorm", (5,), {"feature_axes": -2, "reduction_axes": -2}, (2, 5, 4), False),
    ("RMSNorm", (8,), {"dtype": jnp.bfloat16}, (2, 3, 8), True),
    ("RMSNorm", (8,), {"use_scale": False}, (2, 3, 8), True),
    ("LayerNorm", (8,), {}, (2, 3, 8), True),
    ("LayerNorm", (8,), {"use_bias": False, "use_scale": False}, (2, 3, 8), True),
    ("LayerNorm", (4,), {"reduction_axes": (1, 2), "feature_axes": -1}, (2, 3, 4), False),
    ("LayerNorm", (8,), {"param_dtype": jnp.bfloat16}, (2, 3, 8), True),
    ("GroupNorm", (8, 4), {}, (2, 3, 3, 8), True),                               # num_groups positional
    ("GroupNorm", (8, None, 2), {}, (2, 3, 3, 8), True),                         # group_size positional
    ("GroupNorm", (8, 2), {"dtype": jnp.bfloat16}, (2, 3, 3, 8), True),
    ("Linear", (3, 4), {}, (2, 3), True),
    ("Linear", (3, 4), {"use_bias": False, "param_dtype": jnp.bfloat16}, (2, 3), True),
    ("Linear", (3, 4), {"dtype": jnp.bfloat16}, (2, 3), True),
    ("Linear", (3, 4), {"precision": jax.lax.Precision.HIGHEST}, (2, 3), False),
    ("Linear", (3, 4), {"preferred_element_type": jnp.float32}, (2, 3), False),
    ("Conv", (3, 4, (3,)), {"padding": "VALID"}, (2, 5, 8, 3), True),
    ("Conv", (3, 4, (3, 3), 2), {}, (2, 7, 7, 3), True),                         # strides positional
    ("Conv", (4, 4, (3,)), {"feature_group_count": 2, "padding": "CAUSAL"}, (1, 8, 4), True),
    ("Conv", (3, 2, (3, 3)), {"padding": "CIRCULAR", "mask": jnp.tril(jnp.ones((3, 3, 3, 2)))}, (4, 5, 3), True),
    ("Conv", (2, 3, (2, 2, 2)), {}, (1, 4, 4, 4, 2), False),
    ("Conv", (2, 3, (3, 3)), {"input_dilation": 2, "padding": 1}, (1, 4, 4, 2), False),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name,args,kwargs,shape,kernel", NNX_CASES,
                         ids=[f"{n}-{i}" for i, (n, *_r) in enumerate(NNX_CASES)])
def test_nnx_modules_match_flax(name, args, kwargs, shape, kernel, impl):
    _nnx_case(name, args, kwargs, _rand(shape), kernel, impl)


def test_nnx_masked_norms_take_flax_path():
    x = _rand((2, 3, 3, 8))
    m = jax.random.bernoulli(jax.random.PRNGKey(5), 0.5, x.shape).at[..., :4].set(True)
    for name, args in [("GroupNorm", (8, 2)), ("LayerNorm", (8,)), ("RMSNorm", (8,))]:
        _nnx_case(name, args, {}, jnp.where(m, x, 0.0), False, "xla", call=lambda mod, x: mod(x, mask=m))


@pytest.mark.parametrize("impl", IMPLS)
def test_nnx_bf16_inputs_promote_as_flax(impl):
    x = _rand((2, 3, 8), dtype=jnp.bfloat16)
    for name, args in [("RMSNorm", (8,)), ("LayerNorm", (8,)), ("Linear", (8, 4)), ("GroupNorm", (8, 2))]:
        _nnx_case(name, args, {}, x, True, impl)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kwargs,x_dtype,kernel", [
    ({}, jnp.float32, True),
    ({"axis": 1, "momentum": 0.9}, jnp.float32, True),
    ({"use_scale": False, "dtype": jnp.bfloat16}, jnp.float32, True),
    ({"param_dtype": jnp.bfloat16, "use_bias": False}, jnp.bfloat16, True),
    ({"axis_index_groups": [[0]]}, jnp.float32, False),
    ({"promote_dtype": lambda a, dtype=None: a, "use_scale": False}, jnp.bfloat16, True),  # no promotion
    ({"momentum": 1.5}, jnp.float32, False),  # outside the op's range: flax's code
])
def test_nnx_batch_norm_matches_flax(kwargs, x_dtype, kernel, impl):
    """jaxbwd.nn.nnx.BatchNorm against nnx.BatchNorm: a training call (output, parameter and
    input grads, updated running statistics), then an eval call on those statistics."""
    x = (2.0 + _rand((4, 5, 6, 8))).astype(x_dtype)
    c = x.shape[kwargs.get("axis", -1)]
    ours = jnnx.BatchNorm(c, **kwargs, rngs=nnx.Rngs(0), implementation=impl)
    theirs = nnx.BatchNorm(c, **kwargs, rngs=nnx.Rngs(0))
    chex.assert_trees_all_equal(nnx.state(ours), nnx.state(theirs))
    tol = _tol(x, nnx.state(theirs, nnx.Param), kwargs.get("dtype"))
    loss = lambda m, x: jnp.sum(jnp.sin(m(x).astype(jnp.float32)))  # noqa: E731
    g, gw = nnx.grad(loss, argnums=(0, 1))(ours, x), nnx.grad(loss, argnums=(0, 1))(theirs, x)
    chex.assert_trees_all_close(g, gw, **tol)
    y, want = ours(x), theirs(x)
    assert y.dtype == want.dtype
    chex.assert_trees_all_close(y.astype(jnp.float32), want.astype(jnp.float32), **tol)
    chex.assert_trees_all_equal_shapes_and_dtypes(nnx.state(ours, nnx.BatchStat), nnx.state(theirs, nnx.BatchStat))
    chex.assert_trees_all_close(nnx.state(ours, nnx.BatchStat), nnx.state(theirs, nnx.BatchStat), **tol)
    assert not jnp.allclose(ours.mean[...], 0.0)  # the statistics moved
    y, want = ours(x, use_running_average=True), theirs(x, use_running_average=True)
    chex.assert_trees_all_close(y.astype(jnp.float32), want.astype(jnp.float32), **tol)
    graphdef, state = nnx.split(ours)
    assert _uses_jaxbwd(lambda s, x: nnx.merge(graphdef, s)(x), state, x) == kernel


@pytest.mark.parametrize("impl", IMPLS)
def test_nnx_batch_norm_running_statistics_over_many_steps_bf16(impl):
    """dtype=bfloat16: the float32 running statistics move by 1% a step as flax's do (an
    update through bfloat16 would stall them)."""
    ours = jnnx.BatchNorm(4, momentum=0.99, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), implementation=impl)
    theirs = nnx.BatchNorm(4, momentum=0.99, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    for step in range(40):
        x = 2.0 + 1.2 * _rand((16, 4), seed=step)
        ours(x), theirs(x)
    chex.assert_trees_all_close(nnx.state(ours, nnx.BatchStat), nnx.state(theirs, nnx.BatchStat), rtol=1e-4, atol=1e-4)
    assert float(ours.var[...].min()) != 1.0  # moved from its initial value


@pytest.mark.parametrize("impl", IMPLS)
def test_dropout_modules_flax_keys_jaxbwd_masks(impl):
    """linen and nnx Dropout: flax's key (explicit, from the rng collection or the module's
    stream) goes into jaxbwd.dropout; flax's own code for deterministic, rate 0/1,
    broadcast_dims; the backward regenerates the mask (grads zero exactly where dropped)."""
    import flax.linen as fnn

    import jaxbwd.nn as jnn

    x = _rand((4, 64))
    k = jax.random.PRNGKey(3)
    want = jaxbwd.dropout(x, 0.3, rng=k)
    lin = jnn.Dropout(0.3, implementation=impl)
    chex.assert_trees_all_equal(lin.apply({}, x, False, rng=k), want)
    drawn = fnn.Dropout(0.0).apply({}, x, False, rngs={"dropout": k}, method=lambda m, x, _: m.make_rng("dropout"))
    chex.assert_trees_all_equal(lin.apply({}, x, False, rngs={"dropout": k}), jaxbwd.dropout(x, 0.3, rng=drawn))
    g = jax.grad(lambda x: jnp.sum(lin.apply({}, x, False, rng=k) * x))(x)
    np.testing.assert_array_equal(np.asarray(g == 0), np.asarray(want == 0))
    for kw, call in [({"broadcast_dims": (0,)}, (x, False)), ({}, (x, True)), ({"rate": 1.0}, (x, False)), ({"rate": 0.0}, (x, False)),
                     ({"deterministic": True}, (x,)), ({"deterministic": False, "broadcast_dims": (0,)}, (x,)),
                     ({"deterministic": False, "rate": 1.0}, (x,))]:
        rate = kw.pop("rate", 0.3)
        chex.assert_trees_all_equal(jnn.Dropout(rate, **kw).apply({}, *call, rng=k), fnn.Dropout(rate, **kw).apply({}, *call, rng=k))
    # deterministic in the constructor (flax's usual eval setup) and the kernel path from it;
    # given in both places, flax's error.
    chex.assert_trees_all_equal(jnn.Dropout(0.3, deterministic=False, implementation=impl).apply({}, x, rng=k), want)
    with pytest.raises(ValueError, match="passed to the constructor and at call time"):
        jnn.Dropout(0.3, deterministic=True).apply({}, x, True, rng=k)

    ours = jnnx.Dropout(0.3, rngs=nnx.Rngs(dropout=5), implementation=impl)
    theirs = nnx.Dropout(0.3, rngs=nnx.Rngs(dropout=5))
    chex.assert_trees_all_equal(ours(x, rngs=k), want)
    y = ours(x)  # a key from the module's own stream, drawn as flax draws it
    theirs(x)
    chex.assert_trees_all_equal(nnx.state(ours), nnx.state(theirs))  # the streams advanced alike
    assert 0.2 < float(jnp.mean(y == 0)) < 0.4
    for kw, call in [({"broadcast_dims": (0,)}, {}), ({}, {"deterministic": True})]:
        a = jnnx.Dropout(0.3, **kw, rngs=nnx.Rngs(dropout=5))(x, **call)
        chex.assert_trees_all_equal(a, nnx.Dropout(0.3, **kw, rngs=nnx.Rngs(dropout=5))(x, **call))
    with pytest.raises(ValueError, match="no `rngs` argument"):
        jnnx.Dropout(0.3)(x)


@pytest.mark.parametrize("impl", IMPLS)
def test_nnx_embed_and_attend_match_flax(impl):
    ids = jnp.array([[1, 4, 9], [0, -1, 11]])
    ours = jnnx.Embed(10, 3, rngs=nnx.Rngs(0), implementation=impl)
    theirs = nnx.Embed(10, 3, rngs=nnx.Rngs(0))
    y, want = ours(ids), theirs(ids)
    np.testing.assert_array_equal(np.isnan(y), np.isnan(want))
    chex.assert_trees_all_close(jnp.nan_to_num(y), jnp.nan_to_num(want))
    q = _rand((2, 3), dtype=jnp.bfloat16)
    _nnx_case("Embed", (10, 3), {}, q, True, impl, call=lambda m, x: m.attend(x))
    assert ours.attend(q).dtype == jnp.float32
    labels = jnp.array([9, -100])  # q holds 2 tokens of 3 features
    fused = ours.attend_cross_entropy(q, labels, z_loss=1e-3)
    chex.assert_trees_all_close(fused, jaxbwd.cross_entropy(ours.attend(q), labels, z_loss=1e-3), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- a model swapped whole
def _lm1b_style(nn, dtype):
    """A small decoder laid out as flax's lm1b example (post-embedding positions, pre-norm
    blocks of causal self-attention and a ReLU MLP, a final norm, tied logits), written
    against a module namespace ``nn`` so flax's modules and jaxbwd's can be swapped in."""

    class MlpBlock(fnn.Module):
        @fnn.compact
        def __call__(self, x):
            y = nn.Dense(32, dtype=dtype, kernel_init=fnn.initializers.xavier_uniform(),
                         bias_init=fnn.initializers.normal(stddev=1e-6))(x)
            y = fnn.relu(y)
            return nn.Dense(x.shape[-1], dtype=dtype, kernel_init=fnn.initializers.xavier_uniform(),
                            bias_init=fnn.initializers.normal(stddev=1e-6))(y)

    class Block(fnn.Module):
        @fnn.compact
        def __call__(self, x, mask):
            y = nn.LayerNorm(dtype=dtype)(x)
            y = nn.MultiHeadDotProductAttention(num_heads=2, dtype=dtype, qkv_features=16, use_bias=False,
                                                broadcast_dropout=False, dropout_rate=0.0, deterministic=True,
                                                kernel_init=fnn.initializers.xavier_uniform())(y, mask=mask)
            x = x + y
            return x + MlpBlock()(nn.LayerNorm(dtype=dtype)(x))

    class Decoder(fnn.Module):
        @fnn.compact
        def __call__(self, tokens):
            embed = nn.Embed(num_embeddings=40, features=16, embedding_init=fnn.initializers.normal(stddev=1.0))
            x = embed(tokens).astype(dtype)
            pos = self.param("pos_embedding", fnn.initializers.normal(stddev=0.02), (1, tokens.shape[1], 16))
            x = x + pos
            mask = fnn.combine_masks(fnn.make_attention_mask(tokens > 0, tokens > 0, dtype=dtype),
                                     fnn.make_causal_mask(tokens, dtype=dtype))
            for i in range(2):
                x = Block(name=f"encoderdecoderblock_{i}")(x, mask)
            x = nn.LayerNorm(dtype=dtype, name="encoderdecoder_norm")(x)
            return embed.attend(x.astype(dtype)) / jnp.sqrt(x.shape[-1])

    return Decoder()


class _Jaxbwd:
    def __init__(self, impl):
        self.impl = impl

    def __getattr__(self, name):
        return lambda *a, **k: getattr(jnn, name)(*a, **k, implementation=self.impl)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lm1b_style_model_swapped_gives_flax_loss_and_grads(dtype, impl):
    tokens = jnp.array([[5, 9, 3, 17, 2, 0, 0, 0], [1, 4, 4, 8, 39, 12, 6, 7]])
    theirs, ours = _lm1b_style(fnn, dtype), _lm1b_style(_Jaxbwd(impl), dtype)
    params = theirs.init(jax.random.PRNGKey(0), tokens[:, :-1])
    chex.assert_trees_all_equal(ours.init(jax.random.PRNGKey(0), tokens[:, :-1]), params)

    def loss(model):
        def f(p):
            logits = model.apply(p, tokens[:, :-1])
            weights = (tokens[:, 1:] > 0).astype(jnp.float32)
            ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tokens[:, 1:])
            return jnp.sum(ce * weights) / jnp.sum(weights)
        return f

    (l1, g1), (l2, g2) = jax.value_and_grad(loss(ours))(params), jax.value_and_grad(loss(theirs))(params)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == jnp.float32 else dict(atol=5e-2, rtol=5e-2)
    chex.assert_trees_all_close(l1, l2, **tol)
    chex.assert_trees_all_close(g1, g2, **tol)
    assert _uses_jaxbwd(lambda p: ours.apply(p, tokens[:, :-1]), params)


# ------------------------------------------------------------------------ attention
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", ["self", "features", "enc_dec", "causal", "bf16", "bf16-fp32-softmax", "dropout", "sow"])
def test_linen_mhdpa_matches_flax(case, impl):
    x = _rand((2, 6, 16))
    kw, call, kernel = {"num_heads": 4}, {}, True
    args = (x,)
    if case == "features":
        kw.update(qkv_features=8, out_features=5, use_bias=False)
    elif case == "enc_dec":
        args = (x, _rand((2, 9, 16), seed=1))
    elif case == "causal":  # a dense mask: the op's documented XLA path (no custom_vjp)
        call = {"mask": fnn.make_causal_mask(jnp.ones((2, 6)))}
        kernel = False
    elif case == "bf16":
        kw.update(dtype=jnp.bfloat16)
    elif case == "bf16-fp32-softmax":  # flax's float32 weights promote the result to float32
        kw.update(dtype=jnp.bfloat16, force_fp32_for_softmax=True)
    elif case == "dropout":  # active dropout: flax's own function (same rng, same result)
        kw.update(dropout_rate=0.5, deterministic=False)
        kernel = False
    elif case == "sow":  # sown attention weights need flax's function
        call = {"sow_weights": True}
        kernel = False
    ours = jnn.MultiHeadDotProductAttention(**kw, implementation=impl)
    theirs = fnn.MultiHeadDotProductAttention(**kw)
    rngs = {"params": jax.random.PRNGKey(1), "dropout": jax.random.PRNGKey(2)}
    params = theirs.init(rngs, *args, **call)
    chex.assert_trees_all_equal(ours.init(rngs, *args, **call)["params"], params["params"])
    p = {"params": params["params"]}
    f = lambda mod: lambda p, *a: mod.apply(p, *a, **call, rngs={"dropout": jax.random.PRNGKey(3)},
                                            mutable=["intermediates"])[0]
    y, want = f(ours)(p, *args), f(theirs)(p, *args)
    assert y.dtype == want.dtype
    # bf16: flax's softmax runs in bf16 without force_fp32_for_softmax, jaxbwd's in f32.
    tol = dict(atol=5e-2, rtol=5e-2) if case.startswith("bf16") else _tol(want)
    chex.assert_trees_all_close(y, want, **tol)
    loss = lambda mod: lambda p, *a: jnp.sum(jnp.sin(f(mod)(p, *a).astype(jnp.float32)))
    chex.assert_trees_all_close(jax.grad(loss(ours), argnums=(0, 1))(p, *args),
                                jax.grad(loss(theirs), argnums=(0, 1))(p, *args), **tol)
    assert _uses_jaxbwd(f(ours), p, *args) == kernel


def test_linen_attention_fn_shapes_flax_takes_or_rejects():
    q, k = _rand((1, 3, 2, 4)), _rand((1, 5, 2, 4), seed=1)
    v6 = _rand((1, 5, 2, 6), seed=2)  # another value depth: flax's function runs
    chex.assert_trees_all_close(jnn.dot_product_attention(q, k, v6), fnn.dot_product_attention(q, k, v6), atol=1e-6)
    with pytest.raises(AssertionError, match="num_heads must match"):  # flax's check: no GQA here
        jnn.dot_product_attention(q, k[:, :, :1], k[:, :, :1])


def test_linen_and_nnx_modules_complex_and_out_of_range_follow_flax():
    """Configurations the ops do not take run flax's code: complex inputs (flax normalises
    and multiplies complex arrays), BatchNorm momentum outside [0, 1]."""
    xc = (_rand((2, 3, 8)) + 1j * _rand((2, 3, 8), seed=1)).astype(jnp.complex64)
    for name, kw in [("LayerNorm", {}), ("RMSNorm", {}), ("Dense", {"features": 3}), ("GroupNorm", {"num_groups": 2}),
                     ("Conv", {"features": 3, "kernel_size": (2,)}), ("BatchNorm", {"use_running_average": False})]:
        ours, theirs = getattr(jnn, name)(**kw), getattr(fnn, name)(**kw)
        p = theirs.init(jax.random.PRNGKey(1), xc)
        chex.assert_trees_all_equal(ours.init(jax.random.PRNGKey(1), xc), p)
        apply = lambda m: m.apply(p, xc, mutable=["batch_stats"])[0] if name == "BatchNorm" else m.apply(p, xc)
        chex.assert_trees_all_close(apply(ours), apply(theirs), atol=1e-6)
    rngs = lambda: nnx.Rngs(0)  # noqa: E731
    for name, args in [("LayerNorm", (8,)), ("RMSNorm", (8,)), ("Linear", (8, 3)), ("GroupNorm", (8, 2)),
                       ("Conv", (8, 3, (2,))), ("BatchNorm", (8,))]:
        chex.assert_trees_all_close(getattr(jnnx, name)(*args, rngs=rngs())(xc), getattr(nnx, name)(*args, rngs=rngs())(xc),
                                    atol=1e-6)
    x = _rand((4, 3, 8))
    bn = lambda m: m.apply(m.init(jax.random.PRNGKey(1), x), x, mutable=["batch_stats"])  # noqa: E731
    chex.assert_trees_all_close(bn(jnn.BatchNorm(use_running_average=False, momentum=1.5)),
                                bn(fnn.BatchNorm(use_running_average=False, momentum=1.5)), atol=1e-5)
    qc = (_rand((2, 4, 2, 8)) + 1j * _rand((2, 4, 2, 8), seed=2)).astype(jnp.complex64)
    chex.assert_trees_all_close(jnnx.dot_product_attention(qc, qc, qc), nnx.dot_product_attention(qc, qc, qc),
                                atol=1e-6)


def test_linen_and_nnx_modules_with_8_bit_floats_run_flax_code():
    """The ops refuse 8-bit floats; the modules take them as flax's do, through flax's code."""
    f8 = jnp.float8_e4m3fn
    x = _rand((2, 4, 8)).astype(f8)
    for name, kw in [("Dense", {"features": 3, "param_dtype": f8}),
                     ("Conv", {"features": 3, "kernel_size": (2,), "param_dtype": f8}),
                     ("Dropout", {"rate": 0.5, "deterministic": False})]:  # (flax's norms refuse fp8)
        ours, theirs = getattr(jnn, name)(**kw), getattr(fnn, name)(**kw)
        p = theirs.init(jax.random.PRNGKey(1), x)
        rngs = {"dropout": jax.random.PRNGKey(2)}
        chex.assert_trees_all_equal(ours.apply(p, x, rngs=rngs), theirs.apply(p, x, rngs=rngs))
    emb, femb = jnn.Embed(16, 8, param_dtype=f8), fnn.Embed(16, 8, param_dtype=f8)
    ids = jnp.array([[1, 5, 3]])
    p = femb.init(jax.random.PRNGKey(1), ids)
    chex.assert_trees_all_equal(emb.apply(p, ids), femb.apply(p, ids))
    chex.assert_trees_all_equal(emb.apply(p, x[:, :, :8], method="attend"), femb.apply(p, x[:, :, :8], method="attend"))
    lin, flin = jnnx.Linear(8, 3, param_dtype=f8, rngs=nnx.Rngs(0)), nnx.Linear(8, 3, param_dtype=f8, rngs=nnx.Rngs(0))
    chex.assert_trees_all_equal(lin(x), flin(x))


def test_attention_fns_integer_bias_and_wide_heads_follow_flax():
    """A bool bias is added as 0/1, as flax adds it; head dims past the Pallas kernels' 256
    run the XLA path under a Pallas default (flax computes them)."""
    q = _rand((1, 4, 2, 8))
    b = jnp.asarray(np.random.default_rng(0).random((1, 2, 4, 4)) > 0.5)
    chex.assert_trees_all_close(jnn.dot_product_attention(q, q, q, bias=b), fnn.dot_product_attention(q, q, q, bias=b),
                                atol=1e-6)
    for bias in (b, jnp.asarray(np.random.default_rng(1).integers(-2, 3, (1, 2, 4, 4)), jnp.int32)):
        chex.assert_trees_all_close(jnnx.dot_product_attention(q, q, q, bias=bias),
                                    nnx.dot_product_attention(q, q, q, bias=bias), atol=1e-6)
    wide = _rand((1, 4, 1, 264))
    with jaxbwd.config.use(implementation="pallas"):
        chex.assert_trees_all_close(jnn.dot_product_attention(wide, wide, wide),
                                    fnn.dot_product_attention(wide, wide, wide), atol=1e-6)


def test_modules_check_implementation_when_built():
    """A linen module whose call falls back to flax's code still rejects a bad
    ``implementation``, at construction, naming itself."""
    x = _rand((2, 3, 4))
    with pytest.raises(ValueError, match=r"jaxbwd.nn.LayerNorm: implementation must be"):
        jnn.LayerNorm(implementation="cuda", reduction_axes=(1, 2)).init(jax.random.PRNGKey(0), x)
    with pytest.raises(ValueError, match=r"jaxbwd.nn.MultiHeadDotProductAttention: implementation must be"):
        jnn.MultiHeadDotProductAttention(num_heads=2, implementation="cuda")
    jnn.MultiHeadDotProductAttention(num_heads=2, implementation="pallas:mosaic")  # config.use takes it too
    # "auto" is the settings' default, as None: a block's choice reaches the attention_fn
    seen = []

    def spy(fn):
        def attn(*args, **kwargs):
            seen.append(jaxbwd.config.default_implementation())
            return fn(*args, **kwargs)
        return attn

    for impl in (None, "auto"):
        with jaxbwd.config.use(implementation="pallas"):
            jnn.MultiHeadDotProductAttention(num_heads=2, implementation=impl, attention_fn=spy(jnn.dot_product_attention)
                                             ).init(jax.random.PRNGKey(0), x)
            jnnx.MultiHeadAttention(2, 4, attention_fn=spy(jnnx.dot_product_attention), implementation=impl,
                                    decode=False, rngs=nnx.Rngs(0))(x)
    assert seen == ["pallas"] * 4, seen
    with pytest.raises(ValueError, match=r"jaxbwd.nn.nnx.LayerNorm: implementation must be"):
        jnnx.LayerNorm(4, implementation="cuda", rngs=nnx.Rngs(0))
    jnn.LayerNorm(implementation="pallas:triton").init(jax.random.PRNGKey(0), x)  # an op's per-call form
    # the module's own name under a lifted transform and in a subclass
    with pytest.raises(ValueError, match=r"jaxbwd.nn.LayerNorm: implementation must be"):
        fnn.remat(jnn.LayerNorm)(implementation="cuda").init(jax.random.PRNGKey(0), x)
    with pytest.raises(ValueError, match=r"jaxbwd.nn.nnx.LayerNorm: implementation must be"):
        type("MyNorm", (jnnx.LayerNorm,), {})(4, implementation="cuda", rngs=nnx.Rngs(0))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dt", [jnp.uint8, jnp.int8])
def test_embed_narrow_ids_past_their_range_match_flax(dt, impl):
    """A vocabulary larger than the ids' dtype holds (300 > uint8's 255): flax's jnp.take
    reads the rows; the wrap of V in the ids' dtype made rows of valid ids NaN."""
    ids = jnp.asarray([5, 100, 120 if dt == jnp.int8 else 250], dt)
    v = fnn.Embed(300, 4).init(jax.random.PRNGKey(0), ids)
    chex.assert_trees_all_equal(jnn.Embed(300, 4, implementation=impl).apply(v, ids),
                                fnn.Embed(300, 4).apply(v, ids))
    chex.assert_trees_all_equal(jnnx.Embed(300, 4, rngs=nnx.Rngs(0), implementation=impl)(ids),
                                nnx.Embed(300, 4, rngs=nnx.Rngs(0))(ids))
    if dt == jnp.int8:
        # A negative id counts from the end as an int32 id does: row 297 for -3 (jnp.take
        # wraps -3 + 300 in int8, to row 41).
        got = jnn.Embed(300, 4, implementation=impl).apply(v, jnp.asarray([-3], dt))
        chex.assert_trees_all_equal(got, v["params"]["embedding"][297][None])


def test_attention_fns_with_no_keys_give_flax_zeros():
    q, kv = _rand((1, 2, 1, 4)), jnp.ones((1, 0, 1, 4))
    chex.assert_trees_all_equal(jnn.dot_product_attention(q, kv, kv), fnn.dot_product_attention(q, kv, kv))
    chex.assert_trees_all_equal(jnnx.dot_product_attention(q, kv, kv), nnx.dot_product_attention(q, kv, kv))


@pytest.mark.parametrize("impl", IMPLS)
def test_batch_norm_grad_through_a_named_vmap(impl):
    """BatchNorm(axis_name=...) under vmap(axis_name=...) and grad, flax's multi-replica
    pattern: the batched backward's shape probe traced the collective outside the axis.
    Each member has its own scale and bias (an ensemble): the input gradient averages
    w * dy over the members, not dy alone."""
    x = _rand((4, 3, 8))

    def grads(m):
        v = jax.vmap(lambda a: m.init(jax.random.PRNGKey(0), a), axis_name="d")(x)
        params = jax.tree_util.tree_map(lambda a: a + 0.3 * _rand(a.shape, seed=1), v["params"])
        loss = lambda p, x: jnp.sum(jnp.sin(jax.vmap(  # noqa: E731
            lambda vv, a: m.apply(vv, a, mutable=["batch_stats"])[0], axis_name="d")({**v, "params": p}, x)))
        return jax.grad(loss, argnums=(0, 1))(params, x)

    chex.assert_trees_all_close(grads(jnn.BatchNorm(use_running_average=False, axis_name="d", implementation=impl)),
                                grads(fnn.BatchNorm(use_running_average=False, axis_name="d")), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("x_dtype", [jnp.float64, jnp.float32, jnp.bfloat16])
def test_batch_norm_running_statistics_dtype_as_flax(x_dtype):
    """flax stores float32 statistics and its update promotes them with the batch's (at
    least float32): float64 inputs leave float64 statistics, as exact as flax's."""
    with jax.enable_x64(True):
        x = jnp.asarray(_rand((16, 8)) * 3 + 1, x_dtype)
        stats = []
        for m in (jnn.BatchNorm(use_running_average=False, momentum=0.9, implementation="xla"),
                  fnn.BatchNorm(use_running_average=False, momentum=0.9)):
            v = m.init(jax.random.PRNGKey(0), x)
            for _ in range(2):
                v = {**v, **m.apply(v, x, mutable=["batch_stats"])[1]}
            stats.append(v["batch_stats"])
    chex.assert_trees_all_equal_dtypes(*stats)
    chex.assert_trees_all_close(*stats, rtol=1e-6 if x_dtype == jnp.float64 else 1e-5, atol=1e-6)


def test_batch_norm_of_an_empty_batch_is_flax_s():
    """flax normalises an empty batch to an empty result (the op needs one element per
    channel for its statistics): the modules run flax's code there."""
    x = jnp.zeros((0, 4, 4, 8))
    v = fnn.BatchNorm(use_running_average=False).init(jax.random.PRNGKey(0), x)
    got, new = jnn.BatchNorm(use_running_average=False).apply(v, x, mutable=["batch_stats"])
    want, new_want = fnn.BatchNorm(use_running_average=False).apply(v, x, mutable=["batch_stats"])
    chex.assert_trees_all_equal((got, new), (want, new_want))
    ours, theirs = jnnx.BatchNorm(8, rngs=nnx.Rngs(0)), nnx.BatchNorm(8, rngs=nnx.Rngs(0))
    chex.assert_trees_all_equal(ours(x), theirs(x))
    chex.assert_trees_all_equal((ours.mean[...], ours.var[...]), (theirs.mean[...], theirs.var[...]))


@pytest.mark.parametrize("make", [
    lambda impl: ("linen", jnn.Dense(8, implementation=impl, param_dtype=jnp.float64)),
    lambda impl: ("linen", jnn.MultiHeadDotProductAttention(num_heads=2, implementation=impl,
                                                            param_dtype=jnp.float64)),
    lambda impl: ("nnx", jnnx.MultiHeadAttention(num_heads=2, in_features=8, decode=False, implementation=impl,
                                                 param_dtype=jnp.float64, rngs=nnx.Rngs(0))),
], ids=["Dense", "MultiHeadDotProductAttention", "nnx.MultiHeadAttention"])
def test_float64_modules_follow_the_ops_rule(make):
    """float64 under a module's implementation="pallas" is the op's TypeError in every
    module (the attention modules, whose op is reached through flax's attention_fn, too);
    under "xla" the module runs in float64."""
    with jax.enable_x64(True):
        x = jnp.asarray(_rand((2, 4, 8)), jnp.float64)

        def run(impl):
            kind, m = make(impl)
            return m(x) if kind == "nnx" else m.apply(m.init(jax.random.PRNGKey(0), x), x)

        with pytest.raises(TypeError, match=r"implementation='pallas' has no float64 kernels"):
            run("pallas")
        assert run("xla").dtype == jnp.float64


@pytest.mark.parametrize("shape,heads,match", [
    ((4, 16), (4, 2), r"x must be \[B, T, features\] \(rank 3\), got shape \(4, 16\)"),
    ((1, 4, 4, 16), (4, 2), r"x must be \[B, T, features\] \(rank 3\), got shape \(1, 4, 4, 16\)"),
    ((1, 4, 16), (3, 2), r"num_heads must be a multiple of num_kv_heads, got num_heads=3, num_kv_heads=2"),
])
def test_attention_modules_name_their_bad_input(shape, heads, match):
    x = jnp.ones(shape)
    with pytest.raises(ValueError, match=r"jaxbwd.nn.Attention: " + match):
        jnn.Attention(*heads, 8).init(jax.random.PRNGKey(0), x)
    with pytest.raises(ValueError, match=r"jaxbwd.nn.nnx.Attention: " + match):
        jnnx.Attention(16, *heads, 8, rngs=nnx.Rngs(0))(x)


@pytest.mark.parametrize("field,value,error,match", [
    ("head_dim", 16 / 4, TypeError, r"head_dim must be a static Python int, got 4.0"),
    ("head_dim", -8, ValueError, r"head_dim must be an int >= 1, got -8"),
    ("head_dim", 5, ValueError, r"head_dim must be even \(RoPE rotates pairs\), got 5"),
    ("num_heads", "4", TypeError, r"num_heads must be a static Python int, got '4'"),
    ("num_kv_heads", 0, ValueError, r"num_kv_heads must be an int >= 1, got 0"),
    ("num_kv_heads", True, TypeError, r"num_kv_heads must be a static Python int, got True"),
    ("rope_theta", 0.0, ValueError, r"rope_theta must be a positive number, got 0.0"),
])
def test_attention_modules_check_their_configuration(field, value, error, match):
    """Sizes such as ``d_model / n_heads`` (a float) or a negative count fail in the
    module's own terms, before flax's Dense or a reshape sees them."""
    x = jnp.ones((1, 4, 16))
    cfg = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 8, field: value}
    with pytest.raises(error, match=r"jaxbwd.nn.Attention: " + match):
        jnn.Attention(**cfg).init(jax.random.PRNGKey(0), x)
    with pytest.raises(error, match=r"jaxbwd.nn.nnx.Attention: " + match):
        jnnx.Attention(16, **cfg, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("hidden,error,match", [
    (8 * 16 / 3, TypeError, r"hidden must be a static Python int, got 42.66"),
    (0, ValueError, r"hidden must be an int >= 1, got 0"),
    (-4, ValueError, r"hidden must be an int >= 1, got -4"),
])
def test_swiglu_mlp_modules_check_hidden(hidden, error, match):
    x = jnp.ones((2, 16))
    with pytest.raises(error, match=r"jaxbwd.nn.SwiGLUMLP: " + match):
        jnn.SwiGLUMLP(hidden).init(jax.random.PRNGKey(0), x)
    with pytest.raises(error, match=r"jaxbwd.nn.nnx.SwiGLUMLP: " + match):
        jnnx.SwiGLUMLP(16, hidden, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"jaxbwd.nn.nnx.SwiGLUMLP: features must be a static Python int, got 16.0"):
        jnnx.SwiGLUMLP(16.0, 32, rngs=nnx.Rngs(0))


def test_linen_attention_fn_signature_is_flax():
    import inspect

    assert list(inspect.signature(jnn.dot_product_attention).parameters) == \
        list(inspect.signature(fnn.dot_product_attention).parameters)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kw", [{}, {"num_kv_heads": 2}, {"qkv_features": 8, "out_features": 5, "normalize_qk": True}],
                         ids=["mha", "gqa", "features-normalize_qk"])
@pytest.mark.parametrize("call", ["plain", "is_causal", "mask"])
def test_nnx_multi_head_attention_matches_flax(kw, call, impl):
    x = _rand((2, 6, 16))
    extra = {"plain": {}, "is_causal": {"is_causal": True},
             "mask": {"mask": nnx.make_causal_mask(jnp.ones((2, 6)))}}[call]
    args = dict(num_heads=4, in_features=16, decode=False, **kw)
    ours = jnnx.MultiHeadAttention(**args, rngs=nnx.Rngs(0), implementation=impl)
    theirs = nnx.MultiHeadAttention(**args, rngs=nnx.Rngs(0))
    chex.assert_trees_all_equal(nnx.state(ours, nnx.Param), nnx.state(theirs, nnx.Param))
    chex.assert_trees_all_close(ours(x, **extra), theirs(x, **extra), atol=1e-5, rtol=1e-5)
    loss = lambda m: jnp.sum(jnp.sin(m(x, **extra)))
    # normalize_qk's LayerNorms amplify f32 rounding differences of the attention grads.
    chex.assert_trees_all_close(nnx.state(nnx.grad(loss)(ours), nnx.Param),
                                nnx.state(nnx.grad(loss)(theirs), nnx.Param), atol=1e-4, rtol=1e-3)
    graphdef, state = nnx.split(ours)
    # Without a dense mask the flash op (a custom_vjp) runs; a dense mask takes its XLA path.
    assert _uses_jaxbwd(lambda s, x: nnx.merge(graphdef, s)(x, **extra), state, x) == (call != "mask")


def test_norm_modules_with_zero_features_return_flax_empty_result():
    # A last axis of size 0 runs flax's code, as flax returns the empty array (the ops refuse
    # an empty reduction axis).
    x = jnp.ones((2, 0))
    for mine, theirs in [(jnn.LayerNorm(), fnn.LayerNorm()), (jnn.RMSNorm(), fnn.RMSNorm())]:
        got, params = mine.init_with_output(jax.random.PRNGKey(0), x)
        want, fparams = theirs.init_with_output(jax.random.PRNGKey(0), x)
        chex.assert_trees_all_equal_shapes_and_dtypes((got, params), (want, fparams))
    for mine, theirs in [(jnnx.LayerNorm, nnx.LayerNorm), (jnnx.RMSNorm, nnx.RMSNorm)]:
        chex.assert_trees_all_equal_shapes_and_dtypes(mine(0, rngs=nnx.Rngs(0))(x), theirs(0, rngs=nnx.Rngs(0))(x))


@pytest.mark.parametrize("make", [
    lambda F, eps: F.LayerNorm(8, epsilon=eps, rngs=nnx.Rngs(0)),
    lambda F, eps: F.RMSNorm(8, epsilon=eps, rngs=nnx.Rngs(0)),
    lambda F, eps: F.GroupNorm(8, num_groups=2, epsilon=eps, rngs=nnx.Rngs(0)),
    lambda F, eps: F.BatchNorm(8, epsilon=eps, use_running_average=False, rngs=nnx.Rngs(0)),
])
def test_nnx_norms_take_a_jax_scalar_epsilon_as_flax(make):
    # A jax array epsilon (traced under nnx.jit) is flax's to handle: it raised the op's
    # "eps must be a real Python number" eagerly and a TracerBoolConversionError under jit.
    x = _rand((2, 4, 4, 8))
    ours, theirs = make(jnnx, jnp.float32(1e-5)), make(nnx, jnp.float32(1e-5))
    for call in (lambda m, x: m(x), nnx.jit(lambda m, x: m(x))):
        chex.assert_trees_all_close(call(ours, x), call(theirs, x), atol=1e-6, rtol=1e-6)


def test_linen_norms_take_a_jax_scalar_epsilon_as_flax():
    x = _rand((2, 8))
    for name in ("LayerNorm", "RMSNorm", "BatchNorm"):
        kw = dict(epsilon=jnp.float32(1e-5), **({"use_running_average": False} if name == "BatchNorm" else {}))
        ours, theirs = getattr(jnn, name)(**kw), getattr(fnn, name)(**kw)
        params = theirs.init(jax.random.PRNGKey(0), x)
        y, want = (jax.jit(lambda p, x, m=m: m.apply(p, x, mutable=["batch_stats"])[0])(params, x)
                   for m in (ours, theirs))
        chex.assert_trees_all_close(y, want, atol=1e-6, rtol=1e-6)


def _to_float8(*arrays, dtype=None, inexact=True):
    """A custom promote_dtype of quantised compute: every operand cast to float8_e4m3fn."""
    arrays = arrays[0] if len(arrays) == 1 and isinstance(arrays[0], tuple) else arrays  # nnx passes a tuple
    return tuple(None if a is None else jnp.asarray(a).astype(jnp.float8_e4m3fn) for a in arrays)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_custom_promote_dtype_to_float8_runs_flax_code(impl):
    # The ops take 16-to-64-bit floats; the dtype check ran before the module's promote_dtype,
    # so Linear/Dense and Conv raised where flax returns float8.
    x = _rand((2, 5, 5, 8))
    with jaxbwd.config.use(implementation=impl, interpret=True):
        for make in (lambda F: F.Linear(8, 4, promote_dtype=_to_float8, rngs=nnx.Rngs(0)),
                     lambda F: F.Conv(8, 4, (3, 3), promote_dtype=_to_float8, rngs=nnx.Rngs(0))):
            y, want = make(jnnx)(x), make(nnx)(x)
            assert y.dtype == want.dtype == jnp.float8_e4m3fn
            chex.assert_trees_all_equal(y.astype(jnp.float32), want.astype(jnp.float32))
        for make in (lambda F: F.LayerNorm(8, promote_dtype=_to_float8, rngs=nnx.Rngs(0)),
                     lambda F: F.RMSNorm(8, promote_dtype=_to_float8, rngs=nnx.Rngs(0)),
                     lambda F: F.GroupNorm(8, num_groups=2, promote_dtype=_to_float8, rngs=nnx.Rngs(0)),
                     lambda F: F.BatchNorm(8, use_running_average=False, promote_dtype=_to_float8, rngs=nnx.Rngs(0))):
            with pytest.raises(Exception) as theirs:  # flax's code does not promote float8 with float32
                make(nnx)(x)
            with pytest.raises(type(theirs.value)):
                make(jnnx)(x)
        for make in (lambda M: M.Dense(4, promote_dtype=_to_float8), lambda M: M.Conv(4, (3, 3), promote_dtype=_to_float8)):
            params = make(fnn).init(jax.random.PRNGKey(0), x)
            chex.assert_trees_all_equal(make(jnn).init(jax.random.PRNGKey(0), x), params)
            y, want = make(jnn).apply(params, x), make(fnn).apply(params, x)
            assert y.dtype == want.dtype == jnp.float8_e4m3fn
            chex.assert_trees_all_equal(y.astype(jnp.float32), want.astype(jnp.float32))


def test_nnx_group_norm_without_parameters_checks_the_channel_count_as_flax():
    # No scale or bias gives the op no [C] shape to check: 6 channels in 2 groups of 3 ran
    # where the module was built for 2 groups of 4.
    x = _rand((2, 4, 4, 6))
    kw = dict(num_groups=2, use_scale=False, use_bias=False, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="cannot reshape"):
        nnx.GroupNorm(8, **kw)(x)
    with pytest.raises(TypeError, match="cannot reshape"):
        jnnx.GroupNorm(8, **kw)(x)


def test_jaxbwd_nn_nnx_is_reachable_from_jaxbwd_nn():
    import subprocess
    import sys
    code = "import jaxbwd.nn; print(jaxbwd.nn.nnx.Linear.__mro__[1].__module__)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0 and "flax.nnx" in r.stdout, r.stderr[-2000:]
