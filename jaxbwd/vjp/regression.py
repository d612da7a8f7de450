"""mse_loss: mean squared error with optional per-element weights.

Forward and backward are XLA by design. The backward, ``dp = g * c * w * (p - t)``,
``dt = -dp`` (``c = 2/N`` for ``"mean"``, 2 otherwise; ``g`` the incoming cotangent),
``dw = g * c/2 * (p - t)**2``, is one multi-output loop fusion that reads p, t (and w)
and writes the gradients: the minimum traffic, which a Pallas kernel would only match.
Residuals: the inputs p and t (and w), where ``jax.grad`` of the plain formula keeps one
``p - t`` array: in a training step, whose targets stay alive as the batch's input, that is
the same memory (p in place of p - t), and less where the caller keeps p alive too; counted
as residual bytes (``python -m jaxbwd bench``) it is twice autodiff's.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp

from jaxbwd.vjp import _base as B
from jaxbwd.vjp._derivatives import custom_op

REDUCTIONS = ("mean", "sum", "none")


def _cf(x):
    return x.astype(jnp.float64 if x.dtype == jnp.float64 else jnp.float32)


def _reduce(v, reduction):
    if reduction == "none":
        return v
    return jnp.sum(v) / (v.size if reduction == "mean" else 1)


@functools.partial(custom_op, nondiff_argnums=(3, 4), name="mse_loss")
def _mse(p, t, w, reduction, impl):
    r = _cf(p) - _cf(t)
    sq = r * r if w is None else _cf(w) * r * r
    return _reduce(sq, reduction).astype(p.dtype)


def _mse_fwd(p, t, w, reduction, impl):
    return _mse.fun(p, t, w, reduction, impl), (p, t, w)


def _scale(reduction, n):
    # An empty "mean" is NaN (as jnp.mean) and its gradient is empty: any factor serves.
    return 1.0 / max(n, 1) if reduction == "mean" else 1.0


def _mse_bwd(reduction, impl, res, g):
    p, t, w = res
    r = _cf(p) - _cf(t)
    g = _cf(g) * _scale(reduction, r.size)  # a scalar for "mean"/"sum", r's shape for "none"
    dp = 2.0 * g * r if w is None else 2.0 * g * _cf(w) * r
    dw = None if w is None else (g * r * r).astype(w.dtype)
    return dp.astype(p.dtype), (-dp).astype(t.dtype), dw


def _mse_tangent(reduction, impl, res, dp, dt, dw):
    p, t, w = res
    r = _cf(p) - _cf(t)
    dr = _cf(dp) - _cf(dt)
    v = 2.0 * r * dr if w is None else 2.0 * _cf(w) * r * dr + _cf(dw) * r * r
    return _reduce(v, reduction).astype(p.dtype)


_mse.defvjp(_mse_fwd, _mse_bwd)
_mse.deftangent(_mse_tangent)


def mse_loss(predictions, targets, weights=None, *, reduction="mean", implementation=None):
    """Mean squared error ``w * (predictions - targets)**2``, reduced.

    Args:
      predictions: [...] float32, bfloat16 or float16 (float64 on the XLA path).
      targets: predictions' shape and dtype.
      weights: ``None`` or per-element weights of predictions' shape (any floating dtype);
        differentiable too.
      reduction: ``"mean"`` (the sum divided by the number of elements, as
        ``optax.squared_error(p, t).mean()`` and ``torch.nn.MSELoss``; with weights still
        by the element count, not the weights' sum; NaN for empty inputs, as
        ``jnp.mean``), ``"sum"`` or ``"none"``.
      implementation: accepted for uniformity (``None``, ``"pallas"`` or ``"xla"``); both
        run the same XLA formulas (the backward is one fused pass, see the module docstring).

    Returns:
      A scalar (``"mean"``, ``"sum"``) or [...] (``"none"``) in predictions' dtype,
      computed in float32.

    Residuals: predictions, targets and weights (the inputs; nothing derived).

    Raises:
      TypeError: a non-floating argument; predictions and targets of different dtypes.
      ValueError: mismatched shapes; unknown reduction or implementation.
      Also the errors common to every op (``help(jaxbwd)``).

    Source: the least-squares loss; gradient ``d/dp = 2 w (p - t)`` (scaled by 1/N for the mean).
    """
    op = "mse_loss"
    B.check_float(op, "predictions", predictions)
    B.check_float(op, "targets", targets)
    B.check_shape(op, "targets", targets, predictions.shape, what="(predictions' shape)")
    B.check_same_dtype(op, ("predictions", "targets"), (predictions, targets))
    if weights is not None:
        B.check_float(op, "weights", weights)
        B.check_shape(op, "weights", weights, predictions.shape, what="(predictions' shape)")
    if reduction not in REDUCTIONS:
        raise ValueError(f"jaxbwd.{op}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    impl = B.impl(implementation, op)  # no kernels: float64 runs under any choice
    return _mse(predictions, targets, weights, reduction, impl)
