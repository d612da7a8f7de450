"""matmul, bias_add, scale, residual_add.

matmul, scale and residual_add keep XLA backward rules on purpose: their gradients are
GEMMs (cuBLAS already run at roofline), a multiply, and a broadcast reduction
that XLA fuses. bias_add's dbias is a column-sum Pallas kernel with f32 accumulation.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxbwd.pallas import linear as kernels
from jaxbwd.vjp import _base as B
from jaxbwd.vjp._derivatives import custom_op
from jaxbwd import sharding as S


# ------------------------------------------------------------------------------ matmul
# out_sharding: under an explicit mesh each product states its result's sharding (a
# gradient keeps its operand's), as JAX's own dot_general transpose does; None elsewhere.
@custom_op
def _matmul(x, w):
    acc = B.acc_dtype(x, w)
    out = S.matmul_out_spec(x, w)
    y = B.dot_16bit(lambda x, w: jnp.matmul(x, w, preferred_element_type=acc, out_sharding=out), x, w)
    return y.astype(jnp.result_type(x, w))


def _matmul_fwd(x, w):
    return _matmul.fun(x, w), (x, w)


def _matmul_bwd(res, dy):
    x, w = res
    acc, lead = B.acc_dtype(x, w), tuple(range(x.ndim - 1))
    x_spec, w_spec = S.spec(x), S.spec(w)
    dx = B.dot_16bit(lambda dy, w: jnp.matmul(dy, w.T, preferred_element_type=acc, out_sharding=x_spec), dy, w)
    dw = B.dot_16bit(lambda x, dy: jax.lax.dot_general(x, dy, ((lead, lead), ((), ())), preferred_element_type=acc,
                                                       out_sharding=w_spec), x, dy)
    dx = dx.astype(x.dtype)
    return dx, dw.astype(w.dtype)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)
# Bilinear: d(x @ w) = dx @ w + x @ dw.
_matmul.deftangent(lambda res, dx, dw: _matmul.fun(dx, res[1]) + _matmul.fun(res[0], dw))


def matmul(x, w, *, implementation=None):
    """``x @ w`` with f32 accumulation: [..., K] @ [K, M] -> [..., M].

    Args:
      x: [..., K] floating. w: [K, M] floating.
      implementation: accepted for uniformity; both choices run XLA's dot (cuBLAS on GPU),
        which a hand-written kernel does not beat.

    Returns:
      [..., M] in ``result_type(x, w)``.

    Residuals: x and w. Backward: ``dx = dy @ w.T``, ``dw = x.T @ dy`` (f32 accumulation).

    Raises:
      TypeError: non-floating x or w.
      ValueError: w not rank 2, x rank 0, or x's last dim != w's first dim.
      Also the errors common to every op (``help(jaxbwd)``).

    Source: the chain rule for a matrix product.
    """
    op = "matmul"
    B.check_float(op, "x", x)
    B.check_float(op, "w", w)
    B.check_ndim(op, "w", w, ndim=2, what="([K, M])")
    B.check_ndim(op, "x", x, min_ndim=1, what="([..., K])")
    if x.shape[-1] != w.shape[0]:
        raise ValueError(
            f"jaxbwd.matmul: w must have shape [K={x.shape[-1]}, M] to match x's last dim, got {tuple(w.shape)}"
        )
    B.impl(implementation, op)
    with S.operands_mesh(x, w):  # out_sharding needs the mesh of explicitly sharded operands
        return _matmul(x, w)


# ---------------------------------------------------------------------------- bias_add
@functools.partial(custom_op, nondiff_argnums=(2,))
def _bias_add(x, bias, impl):
    return (x + bias.astype(x.dtype)).astype(x.dtype)


def _bias_add_fwd(x, bias, impl):
    # Nothing but bias's dtype is needed for the backward: dx = dy, dbias = sum(dy).
    return _bias_add.fun(x, bias, impl), jnp.zeros((0,), bias.dtype)


def _bias_add_bwd(impl, res, dy):
    dy2 = dy.reshape(math.prod(dy.shape[:-1]), dy.shape[-1])  # not -1: D may be 0
    if impl.pallas and dy2.size > 0:
        db = kernels.column_sum_f32(dy2, interpret=impl.interpret)
    else:
        db = jnp.sum(dy2.astype(B.acc_dtype(dy2)), axis=0)
    return dy, db.astype(res.dtype)


_bias_add.defvjp(_bias_add_fwd, _bias_add_bwd)
_bias_add.deftangent(lambda impl, res, dx, db: _bias_add.fun(dx, db, impl))  # linear


def bias_add(x, bias, *, implementation=None):
    """``x + bias`` over the last axis.

    Args:
      x: [..., D] floating. bias: [D] floating.
      implementation: ``None`` (Pallas on GPU, XLA elsewhere), ``"pallas"`` or ``"xla"``.

    Returns:
      [..., D] in x's dtype.

    Residuals: none (0 bytes). Backward: ``dx = dy``; ``dbias = sum over rows of dy``, a
    Pallas column-sum kernel with f32 accumulation and a fixed reduction order.

    Raises:
      TypeError: non-floating x or bias.
      ValueError: x rank 0, bias not of shape [D].
      Also the errors common to every op (``help(jaxbwd)``).

    Source: the chain rule; the reduction follows the split-K pattern (partials, then a sum).
    """
    op = "bias_add"
    B.check_float(op, "x", x)
    B.check_float(op, "bias", bias)
    B.check_ndim(op, "x", x, min_ndim=1, what="([..., D])")
    B.check_shape(op, "bias", bias, (x.shape[-1],), what=f"(x's last dimension D={x.shape[-1]})")
    impl = B.impl(implementation, op, x, bias)
    return S.partitioned("...d,d->...d", lambda x, b: _bias_add(x, b, impl), x, bias)


# ------------------------------------------------------------------------------- scale
def _times(x, factor):
    """x * factor computed in (at least) float32 and rounded once to x's dtype: a float16 x
    times 1e5 is finite where the product fits (the factor itself does not fit float16)."""
    return (x.astype(B.acc_dtype(x)) * factor).astype(x.dtype)


@functools.partial(custom_op, nondiff_argnums=(1,))
def _scale(x, factor):
    return _times(x, factor)


_scale.defvjp(lambda x, f: (_scale.fun(x, f), None), lambda f, _, dy: (_times(dy, f),))
_scale.deftangent(lambda f, _, dx: _scale.fun(dx, f))  # linear


def scale(x, factor, *, implementation=None):
    """``x * factor`` for a static Python number ``factor`` (e.g. LoRA's alpha / rank).

    Args:
      x: [...] floating. factor: Python int or float.
      implementation: accepted for uniformity; the backward ``dx = dy * factor`` is XLA.

    Returns:
      [...] in x's dtype, computed in float32 (float64 for float64 x) and rounded once, as
      the gradient is: the factor must fit that dtype (1e40 is inf in float32). Residuals:
      none.

    Raises:
      TypeError: non-floating x; factor not a Python number (e.g. traced).
      ValueError: factor NaN or infinite.
      Also the errors common to every op (``help(jaxbwd)``).

    Source: Hu et al., "LoRA" (2021), the alpha/r scaling of the update.
    """
    op = "scale"
    B.check_float(op, "x", x)
    factor = B.check_static_number(op, "factor", factor)
    B.impl(implementation, op)
    return _scale(x, factor)


# ------------------------------------------------------------------------ residual_add
def _unbroadcast(g, shape, dtype):
    extra = g.ndim - len(shape)
    axes = tuple(range(extra)) + tuple(
        i + extra for i, n in enumerate(shape) if n == 1 and g.shape[i + extra] != 1
    )
    if axes:
        g = jnp.sum(g.astype(B.acc_dtype(g)), axis=axes)
    return g.reshape(shape).astype(dtype)


@custom_op
def _residual_add(a, b):
    return jnp.add(a, b)


def _residual_add_fwd(a, b):
    # Only shapes and dtypes are needed: kept as zero-size arrays, not the operands.
    # Zero-size carriers of each operand's shape and dtype: 0 bytes saved.
    return _residual_add.fun(a, b), (jnp.zeros(a.shape + (0,), a.dtype), jnp.zeros(b.shape + (0,), b.dtype))


def _residual_add_bwd(res, dy):
    pa, pb = res
    return _unbroadcast(dy, pa.shape[:-1], pa.dtype), _unbroadcast(dy, pb.shape[:-1], pb.dtype)


_residual_add.defvjp(_residual_add_fwd, _residual_add_bwd)
_residual_add.deftangent(lambda res, da, db: _residual_add.fun(da, db))  # linear


def residual_add(a, b, *, implementation=None):
    """``a + b`` with NumPy broadcasting; the backward sums the cotangent over broadcast dims.

    Args:
      a, b: floating arrays whose shapes broadcast together.
      implementation: accepted for uniformity; the backward is XLA (identity + reduction).

    Returns:
      broadcast shape, ``result_type(a, b)``. Residuals: none.

    Raises:
      TypeError: non-floating a or b.
      ValueError: shapes that do not broadcast.
      Also the errors common to every op (``help(jaxbwd)``).

    Source: the chain rule; gradients of broadcast operands are summed over the broadcast axes.
    """
    op = "residual_add"
    B.check_float(op, "a", a)
    B.check_float(op, "b", b)
    try:
        jnp.broadcast_shapes(a.shape, b.shape)  # symbolic dims (jax.export) too
    except ValueError:
        raise ValueError(
            f"jaxbwd.residual_add: a and b must have broadcastable shapes, got {tuple(a.shape)} and {tuple(b.shape)}"
        ) from None
    B.impl(implementation, op)
    return _residual_add(a, b)
