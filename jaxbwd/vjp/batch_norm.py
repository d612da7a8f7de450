"""batch_norm: batch statistics over every axis but the channel axis, running statistics as flax.

Forward (XLA): per-channel f32 mean and variance over the rows of x viewed as [R, C]
(corrected two-pass; ``lax.pmean`` over ``axis_name`` for data-parallel statistics, as flax's
``BatchNorm(axis_name=...)``), ``y = (x - mean) * rstd * weight + bias``. The running
statistics are updated from the same batch statistics (the same reduction, outside the
op; under jit XLA computes it once). Saved for the backward: x, weight (aliases) and f32 mean/rstd [C].
Backward: the two Pallas kernels of ``jaxbwd/pallas/batch_norm.py`` (per-channel sums,
then dx) or the same formulas in XLA; with ``axis_name`` the two sums, times each
device's weight, are averaged over the devices between the passes.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxbwd import sharding as S
from jaxbwd.pallas import batch_norm as kernels
from jaxbwd.vjp import _base as B
from jaxbwd.vjp._derivatives import FORWARD_MODE, _ranks_allowed, custom_op


def _cf(x):
    return x.astype(jnp.float64 if x.dtype == jnp.float64 else jnp.float32)


def _pmean(v, axis_name):
    return v if axis_name is None else jax.lax.pmean(v, axis_name)


def batch_stats(x2, axis_name=None):
    """Per-channel mean and biased variance of x2 [R, C], f32, over devices too (the corrected
    two-pass statistics of ``_base.centered_stats``: a constant channel is exact)."""
    return B.centered_stats(_cf(x2), (0,), functools.partial(_pmean, axis_name=axis_name))


def _stats_rstd(x, eps, axis_name):
    mean, var = batch_stats(x, axis_name)
    return mean, jax.lax.rsqrt(var + eps)


@functools.partial(custom_op, nondiff_argnums=(3, 4, 5), name="batch_norm")
def _bn(x, w, b, eps, axis_name, impl):
    mean, rstd = _stats_rstd(x, eps, axis_name)
    return ((_cf(x) - mean) * rstd * _cf(w) + _cf(b)).astype(x.dtype)


def _bn_fwd(x, w, b, eps, axis_name, impl):
    # The statistics are computed here, from x, so that a second derivative (which
    # differentiates the backward through its residuals) sees how they depend on x.
    mean, rstd = _stats_rstd(x, eps, axis_name)
    return ((_cf(x) - mean) * rstd * _cf(w) + _cf(b)).astype(x.dtype), (x, w, mean, rstd)


def _bn_bwd(eps, axis_name, impl, res, dy):
    x, w, mean, rstd = res
    R = x.shape[0]
    if impl.pallas:
        sdy, sdyx = kernels.reduce_sums(x, dy, mean, rstd, interpret=impl.interpret)
    else:
        xhat = (_cf(x) - mean) * rstd
        sdy, sdyx = jnp.sum(_cf(dy), axis=0), jnp.sum(_cf(dy) * xhat, axis=0)
    # dx needs the means of w * dy and w * dy * x_hat over every row of every device: w
    # inside the mean, since under a vmap (an ensemble) or in a shard_map with unreplicated
    # parameters each member has its own. dweight/dbias stay per device (summed by the
    # data-parallel step like any other parameter gradient).
    wf = _cf(w)
    c1, c2 = (rstd * _pmean(wf * s / R, axis_name) for s in (sdy, sdyx))
    w_rstd = wf * rstd
    if impl.pallas:
        dx = kernels.dx(x, dy, mean, rstd, w_rstd, c1, c2, interpret=impl.interpret)
    else:
        xhat = (_cf(x) - mean) * rstd
        dx = (w_rstd * _cf(dy) - c1 - xhat * c2).astype(x.dtype)
    return dx, sdyx.astype(w.dtype), sdy.astype(w.dtype)


def _bn_tangent(eps, axis_name, impl, res, dx, dw, db):
    x, w, mean, rstd = res
    xhat = (_cf(x) - mean) * rstd
    dxf = _cf(dx)
    m, mx = _pmean(jnp.mean(dxf, axis=0), axis_name), _pmean(jnp.mean(dxf * xhat, axis=0), axis_name)
    out = _cf(w) * rstd * (dxf - m - xhat * mx) + _cf(dw) * xhat + _cf(db)
    return out.astype(x.dtype)


_bn.defvjp(_bn_fwd, _bn_bwd)
_bn.deftangent(_bn_tangent)


def batch_norm(x, weight, bias, *, running_mean=None, running_var=None, momentum=0.99, eps=1e-5,
               training=True, axis=-1, axis_name=None, implementation=None):
    """Batch normalisation over every axis but ``axis`` (NHWC: over N, H, W per channel).

    Args:
      x: [..., C, ...] float32, bfloat16 or float16 (float64 on the XLA path), rank >= 2, channels on ``axis``.
      weight, bias: [C], one floating dtype (flax's ``scale`` and ``bias``).
      running_mean, running_var: [C] floating or ``None`` (flax's ``batch_stats``).
      momentum: static number in [0, 1]: ``new = momentum * running + (1 - momentum) * batch``
        (flax's convention; torch's momentum is ``1 - this``). The variance is the biased
        batch variance, as flax.
      eps: positive static number added to the variance.
      training: static bool. True: normalise with the batch statistics. False: with
        ``running_mean``/``running_var`` (required), an affine map differentiated by XLA.
      axis: the channel axis (default -1, NHWC).
      axis_name: ``None`` or a named axis (``shard_map``/``pmap``/``vmap``) over which the
        statistics and the backward's sums are averaged (cross-device batch norm).
      implementation: ``None`` (Pallas on GPU, XLA elsewhere), ``"pallas"`` or ``"xla"``.

    Returns:
      ``y`` in x's shape and dtype; in training with running statistics given,
      ``(y, {"mean": new_mean, "var": new_var})`` (running statistics' dtype; no gradient
      flows through them), as flax's mutable ``batch_stats`` collection.

    Residuals (training): x, weight (aliases) and f32 mean, rstd [C]. Backward: Pallas
    ``batch_norm_bwd_reduce`` (f32 per-channel sums of dy and dy * x_hat, deterministic
    partials: dbias, dweight) then ``batch_norm_bwd_dx``; or the same in XLA.

    Raises:
      TypeError: non-floating x, weight, bias; weight and bias of different dtypes;
        training not a bool; static numbers traced; an int (or unhashable) ``axis_name``.
      ValueError: rank < 2; axis out of range; weight/bias/running shapes not [C]; only one
        of running_mean/running_var; running statistics missing when not training; eps <= 0;
        momentum outside [0, 1]; in training, an ``axis_name`` that no enclosing
        shard_map/pmap/vmap binds; unknown implementation.
      Also the errors common to every op (``help(jaxbwd)``).

    Source: Ioffe & Szegedy, "Batch Normalization: Accelerating Deep Network Training by
    Reducing Internal Covariate Shift" (2015), algorithm 1 and section 3.
    """
    op = "batch_norm"
    B.check_float(op, "x", x)
    B.check_ndim(op, "x", x, min_ndim=2, what="([N, ..., C])")
    axis = B.static_int(op, "axis", axis)
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"jaxbwd.{op}: axis must be in [{-x.ndim}, {x.ndim}) for x of shape {tuple(x.shape)}, got {axis}")
    axis = int(axis) % x.ndim
    Cn = x.shape[axis]
    B.check_nonempty_axis(op, "x", x, axis, f"channel axis {axis}")
    if training and x.size == 0:
        raise ValueError(f"jaxbwd.{op}: training=True needs at least one element per channel for the batch "
                         f"statistics, got x of shape {tuple(x.shape)}")
    for name, v in (("weight", weight), ("bias", bias)):
        B.check_float(op, name, v)
        B.check_shape(op, name, v, (Cn,), what=f"(x's channel count on axis {axis})")
    B.check_same_dtype(op, ("weight", "bias"), (weight, bias))
    if (running_mean is None) != (running_var is None):
        raise ValueError(f"jaxbwd.{op}: give both running_mean and running_var or neither, got "
                         f"running_mean={'None' if running_mean is None else 'an array'}, "
                         f"running_var={'None' if running_var is None else 'an array'}")
    if running_mean is not None:
        for name, v in (("running_mean", running_mean), ("running_var", running_var)):
            B.check_float(op, name, v)
            B.check_shape(op, name, v, (Cn,), what=f"(x's channel count on axis {axis})")
    eps = B.check_static_number(op, "eps", eps)
    B.check_positive(op, "eps", eps)
    momentum = B.check_static_number(op, "momentum", momentum)
    if not 0.0 <= momentum <= 1.0:
        raise ValueError(f"jaxbwd.{op}: momentum must be in [0, 1], got {momentum!r}")
    if not isinstance(training, (bool, np.bool_)):
        raise TypeError(f"jaxbwd.{op}: training must be a Python bool, got {training!r}")
    if training:
        B.check_axis_name(op, axis_name)
    impl = B.impl(implementation, op, x, weight, bias)

    xm = x if axis == x.ndim - 1 else jnp.moveaxis(x, axis, -1)
    x2 = xm.reshape(-1, Cn)
    if not training:
        if running_mean is None:
            raise ValueError(f"jaxbwd.{op}: training=False normalises with running_mean and running_var; got None")
        rstd = jax.lax.rsqrt(_cf(running_var) + eps)
        y2 = ((_cf(x2) - _cf(running_mean)) * rstd * _cf(weight) + _cf(bias)).astype(x.dtype)
        return _restore(y2, xm, axis)
    # Rows sharded over explicit mesh axes run per shard, the statistics averaged over those
    # axes too (as axis_name's); with equal shards the mean of shard means is the mean.
    names = () if axis_name is None else axis_name if isinstance(axis_name, tuple) else (axis_name,)

    def per_shard(x2, w, b, axes):
        if names and not FORWARD_MODE:
            # jax < 0.12 runs a custom_vjp's backward after vmap has unbound its axis name, so
            # the backward's pmean over axis_name would fail there: autodiff of the same
            # forward formula instead (what flax's BatchNorm does), the residuals autodiff's.
            return _ranks_allowed(_bn.fun)(x2, w, b, eps, names + tuple(axes), impl)
        return _bn(x2, w, b, eps, (names + tuple(axes)) or None, impl)

    y = _restore(S.partitioned("rC,C,C->rC", per_shard, x2, weight, bias, axes_of="r"), xm, axis)
    if running_mean is None:
        return y
    # The same reduction as the op's forward; under jit XLA computes it once (CSE).
    mean, var = jax.tree_util.tree_map(jax.lax.stop_gradient, batch_stats(x2, axis_name))
    new = {"mean": (momentum * _cf(running_mean) + (1 - momentum) * mean).astype(running_mean.dtype),
           "var": (momentum * _cf(running_var) + (1 - momentum) * var).astype(running_var.dtype)}
    return y, new


def _restore(y2, xm, axis):
    y = y2.reshape(xm.shape)
    return y if axis == xm.ndim - 1 else jnp.moveaxis(y, -1, axis)
