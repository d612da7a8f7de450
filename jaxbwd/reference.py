"""Plain-jnp forwards of every op: the ground truth that tests differentiate with autodiff.

Each function has the op's signature without ``implementation`` and is written for
clarity, not speed. Statistics are taken in float32 and results cast back to the input
dtype, as the ops do.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _f32(x):
    return x.astype(jnp.float32) if x.dtype != jnp.float64 else x


def rms_norm(x, weight, *, eps=1e-6, weight_offset=0.0):
    """Reference RMSNorm (Zhang & Sennrich 2019)."""
    xf = _f32(x)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * (_f32(weight) + weight_offset)).astype(x.dtype)


def layer_norm(x, weight, bias, *, eps=1e-5):
    """Reference LayerNorm (Ba et al. 2016)."""
    xf = _f32(x)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    return ((xf - mean) * jax.lax.rsqrt(var + eps) * _f32(weight) + _f32(bias)).astype(x.dtype)


def softmax(x, *, axis=-1):
    """Reference softmax; a row that is entirely -inf gives zeros (not NaN)."""
    xf = _f32(x)
    m = jnp.max(xf, axis=axis, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(xf - jax.lax.stop_gradient(m))
    s = jnp.sum(e, axis=axis, keepdims=True)
    return (e / jnp.where(s == 0, 1.0, s)).astype(x.dtype)


def silu(x):
    """Reference SiLU / swish: x * sigmoid(x)."""
    return (_f32(x) * jax.nn.sigmoid(_f32(x))).astype(x.dtype)


def gelu(x, *, approximate=True):
    """Reference GELU (Hendrycks & Gimpel 2016), tanh form when ``approximate``."""
    return jax.nn.gelu(_f32(x), approximate=approximate).astype(x.dtype)


def _clamp(gate, up, limit):
    if limit is None:
        return gate, up
    return jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)


def swiglu(gate, up, *, limit=None):
    """Reference SwiGLU (Shazeer 2020): silu(gate) * up, clamped as gpt-oss when ``limit``."""
    g, u = _clamp(_f32(gate), _f32(up), limit)
    return (g * jax.nn.sigmoid(g) * u).astype(gate.dtype)


def glu(x, *, activation="silu", limit=None):
    """Reference gated linear unit over the halves of the last axis: act(x[..., :d]) * x[..., d:]."""
    d = x.shape[-1] // 2
    g, u = _clamp(_f32(x[..., :d]), _f32(x[..., d:]), limit)
    act = {
        "silu": lambda v: v * jax.nn.sigmoid(v),
        "gelu": lambda v: jax.nn.gelu(v, approximate=True),
        "gelu_exact": lambda v: jax.nn.gelu(v, approximate=False),
    }[activation]
    return (act(g) * u).astype(x.dtype)


def bias_add(x, bias):
    """Reference bias addition over the last axis."""
    return (x + bias.astype(x.dtype)).astype(x.dtype)


def matmul(x, w):
    """Reference matrix product [..., K] @ [K, M]."""
    return jnp.matmul(x, w, preferred_element_type=jnp.promote_types(jnp.result_type(x, w), jnp.float32)).astype(jnp.result_type(x, w))


def scale(x, factor):
    """Reference scaling by a static factor."""
    return (x * factor).astype(x.dtype)


def residual_add(a, b):
    """Reference broadcasting addition."""
    return a + b


def reshape(x, shape):
    """Reference reshape."""
    return x.reshape(shape)


def row_slice(x, start, size):
    """Reference dynamic row slice (start clamped as lax.dynamic_slice)."""
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=0)
