"""rms_norm and layer_norm: custom derivatives with f32 row statistics as residuals.

Forward (XLA): statistics in f32, output in x's dtype. Saved for the backward: x, weight
and the per-row f32 statistics (rstd, and mean for layer_norm): 4 or 8 bytes per row
beyond the inputs, never the normalised x. Backward: the Pallas kernel in
``jaxbwd/pallas/norms.py`` or the same formula in XLA.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxbwd.pallas import norms as kernels
from jaxbwd.vjp import _base as B
from jaxbwd.vjp._derivatives import custom_op
from jaxbwd import sharding as S


def _stats(x2, eps, centered):
    xf = x2.astype(B.acc_dtype(x2))
    if centered:
        mean, var = B.centered_stats(xf, (-1,))
    else:
        mean = None
        var = jnp.mean(jnp.square(xf), axis=-1)
    return mean, jax.lax.rsqrt(var + eps)


def _normalize(x2, w, b, mean, rstd, offset):
    xf = x2.astype(B.acc_dtype(x2))
    xhat = (xf - mean[:, None] if mean is not None else xf) * rstd[:, None]
    y = xhat * (w.astype(B.acc_dtype(x2)) + offset)
    if b is not None:
        y = y + b.astype(B.acc_dtype(x2))
    return y.astype(x2.dtype)


def _xla_bwd(x2, w, dy, mean, rstd, offset):
    xf, dyf = x2.astype(B.acc_dtype(x2)), dy.astype(B.acc_dtype(x2))
    xhat = (xf - mean[:, None] if mean is not None else xf) * rstd[:, None]
    wdy = dyf * (w.astype(B.acc_dtype(x2)) + offset)
    c1 = jnp.mean(xhat * wdy, axis=-1, keepdims=True)
    corr = xhat * c1
    if mean is not None:
        corr = corr + jnp.mean(wdy, axis=-1, keepdims=True)
    dx = (wdy - corr) * rstd[:, None]
    dw = jnp.sum(dyf * xhat, axis=0)
    db = jnp.sum(dyf, axis=0) if mean is not None else None
    return dx.astype(x2.dtype), dw, db


def _bwd(impl, x2, w, dy, mean, rstd, offset):
    if impl.pallas:
        return kernels.norm_bwd(x2, w, dy, mean, rstd, offset=offset, interpret=impl.interpret)
    return _xla_bwd(x2, w, dy, mean, rstd, offset)


# ---------------------------------------------------------------------------- rms_norm
@functools.partial(custom_op, nondiff_argnums=(2, 3, 4))
def _rms_norm(x, weight, eps, offset, impl):
    x2, lead = B.rows(x)
    _, rstd = _stats(x2, eps, False)
    return _normalize(x2, weight, None, None, rstd, offset).reshape(x.shape)


def _rms_norm_fwd(x, weight, eps, offset, impl):
    x2, _ = B.rows(x)
    _, rstd = _stats(x2, eps, False)
    return _normalize(x2, weight, None, None, rstd, offset).reshape(x.shape), (x, weight, rstd)


def _rms_norm_bwd(eps, offset, impl, res, dy):
    x, weight, rstd = res
    x2, _ = B.rows(x)
    dx, dw, _ = _bwd(impl, x2, weight, dy.reshape(x2.shape), None, rstd, offset)
    return dx.reshape(x.shape), dw.astype(weight.dtype)


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


def _rms_norm_tangent(eps, offset, impl, res, dx, dw):
    x, weight, _ = res
    return jax.jvp(lambda x, w: _rms_norm.fun(x, w, eps, offset, impl), (x, weight), (dx, dw))[1]


_rms_norm.deftangent(_rms_norm_tangent)


def _check_norm_args(op, x, eps, **params):
    B.check_float(op, "x", x)
    B.check_ndim(op, "x", x, min_ndim=1, what="([..., D])")
    B.check_nonempty_axis(op, "x", x, -1, "last axis")
    D = x.shape[-1]
    for name, p in params.items():
        B.check_float(op, name, p)
        B.check_shape(op, name, p, (D,), what=f"(x's last dimension D={D})")
    B.check_positive(op, "eps", eps)


def rms_norm(x, weight, *, eps=1e-6, weight_offset=0.0, implementation=None):
    """Root-mean-square layer normalisation: ``x * rsqrt(mean(x**2) + eps) * (weight_offset + weight)``.

    Args:
      x: [..., D] float32, bfloat16 or float16 (float64 on the XLA path); normalised over the last axis.
      weight: [D] floating; the scale. ``weight_offset=1.0`` gives Gemma's ``(1 + weight)``.
      eps: positive float added to the mean square.
      weight_offset: float added to ``weight`` (0.0 for Llama, 1.0 for Gemma).
      implementation: ``None`` (Pallas on GPU, XLA elsewhere), ``"pallas"`` or ``"xla"``.

    Returns:
      [..., D] in x's dtype. Statistics are computed in float32.

    Residuals: x, weight and rstd [rows] float32.

    Raises:
      TypeError: x or weight not floating; eps traced.
      ValueError: x of rank 0, weight not of shape [D], eps <= 0 or not finite, weight_offset
        not finite, unknown implementation.
      Also the errors common to every op (``help(jaxbwd)``).

    Source: Zhang & Sennrich, "Root Mean Square Layer Normalization" (2019). The backward
    is ``dx = rstd * (w*dy - x_hat * mean(x_hat * w*dy))``, ``dw = sum(dy * x_hat)``.
    """
    op = "rms_norm"
    _check_norm_args(op, x, eps, weight=weight)
    offset = B.check_static_number(op, "weight_offset", weight_offset)
    impl = B.impl(implementation, op, x, weight)
    return S.partitioned("...D,D->...D", lambda x, w: _rms_norm(x, w, float(eps), offset, impl), x, weight)


# -------------------------------------------------------------------------- layer_norm
@functools.partial(custom_op, nondiff_argnums=(3, 4))
def _layer_norm(x, weight, bias, eps, impl):
    x2, _ = B.rows(x)
    mean, rstd = _stats(x2, eps, True)
    return _normalize(x2, weight, bias, mean, rstd, 0.0).reshape(x.shape)


def _layer_norm_fwd(x, weight, bias, eps, impl):
    x2, _ = B.rows(x)
    mean, rstd = _stats(x2, eps, True)
    y = _normalize(x2, weight, bias, mean, rstd, 0.0).reshape(x.shape)
    return y, (x, weight, mean, rstd, jnp.zeros((0,), bias.dtype))


def _layer_norm_bwd(eps, impl, res, dy):
    x, weight, mean, rstd, bias_proto = res
    x2, _ = B.rows(x)
    dx, dw, db = _bwd(impl, x2, weight, dy.reshape(x2.shape), mean, rstd, 0.0)
    return dx.reshape(x.shape), dw.astype(weight.dtype), db.astype(bias_proto.dtype)


_layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


def _layer_norm_tangent(eps, impl, res, dx, dw, db):
    x, weight, _, _, _ = res
    zero_bias = jnp.zeros_like(db)  # y is affine in the bias: its tangent is db itself
    dy = jax.jvp(lambda x, w: _layer_norm.fun(x, w, zero_bias, eps, impl), (x, weight), (dx, dw))[1]
    return (dy.astype(B.acc_dtype(dy)) + db.astype(B.acc_dtype(dy))).astype(dy.dtype)


_layer_norm.deftangent(_layer_norm_tangent)


def layer_norm(x, weight, bias, *, eps=1e-5, implementation=None):
    """Layer normalisation over the last axis: ``(x - mean) * rsqrt(var + eps) * weight + bias``.

    Args:
      x: [..., D] float32, bfloat16 or float16 (float64 on the XLA path).
      weight, bias: [D] floating.
      eps: positive float added to the variance.
      implementation: ``None`` (Pallas on GPU, XLA elsewhere), ``"pallas"`` or ``"xla"``.

    Returns:
      [..., D] in x's dtype; statistics in float32.

    Residuals: x, weight, mean and rstd [rows] float32 (the normalised x is recomputed).

    Numerics: mean and variance by the corrected two-pass algorithm
    (``_base.centered_stats``), so a constant row gives exactly ``bias`` at any eps and a
    large offset or an outlier costs no more than f32 rounding. A row whose values differ by
    more than ~1.8e19 overflows the variance (output ``bias``, as flax's
    ``LayerNorm(use_fast_variance=False)`` gives); one whose sum overflows, or whose values
    differ by more than the f32 maximum from the mean, gives NaN.

    Raises:
      TypeError: x, weight or bias not floating; eps traced.
      ValueError: x of rank 0, weight/bias not of shape [D], eps <= 0 or not finite, unknown implementation.
      Also the errors common to every op (``help(jaxbwd)``).

    Source: Ba, Kiros & Hinton, "Layer Normalization" (2016). Backward:
    ``dx = rstd * (w*dy - x_hat * mean(x_hat * w*dy) - mean(w*dy))``, ``dw = sum(dy * x_hat)``,
    ``db = sum(dy)``.
    """
    op = "layer_norm"
    _check_norm_args(op, x, eps, weight=weight, bias=bias)
    impl = B.impl(implementation, op, x, weight, bias)
    return S.partitioned("...D,D,D->...D", lambda x, w, b: _layer_norm(x, w, b, float(eps), impl), x, weight, bias)
