"""group_norm (optionally fused with SiLU): custom_vjp with f32 (mean, rstd) per (n, group).

Forward (XLA): statistics in f32 over each group's spatial extent and channels, output in
x's dtype. Saved for the backward: x, weight, bias and mean, rstd [N, G] float32, never
the normalised x or the sigmoid. Backward: the Pallas kernel in
``jaxbwd/pallas/group_norm.py`` or the same formula in XLA.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxbwd.pallas import group_norm as kernels
from jaxbwd.vjp import _base as B
from jaxbwd.vjp._derivatives import custom_op
from jaxbwd import sharding as S

ACTIVATIONS = (None, "silu")


def _grouped(x, G):
    """[N, ..., C] -> [N, S, G, Cg] (a free reshape)."""
    N, Cc = x.shape[0], x.shape[-1]
    return x.reshape(N, math.prod(x.shape[1:-1]), G, Cc // G)


def _stats(x, G, eps):
    xf = _grouped(x, G).astype(B.acc_dtype(x))
    mean, var = B.centered_stats(xf, (1, 3))
    return mean, jax.lax.rsqrt(var + eps)


def _pre_activation(x, w, b, mean, rstd, G):
    """z = x_hat * w + b in the accumulation dtype, shape [N, S, G, Cg]."""
    dt = B.acc_dtype(x)
    xg = _grouped(x, G).astype(dt)
    xhat = (xg - mean[:, None, :, None]) * rstd[:, None, :, None]
    wg = w.astype(dt).reshape(G, -1)
    bg = b.astype(dt).reshape(G, -1)
    return xhat, xhat * wg + bg


def _forward(x, w, b, G, eps, silu):
    mean, rstd = _stats(x, G, eps)
    _, z = _pre_activation(x, w, b, mean, rstd, G)
    if silu:
        z = z * jax.nn.sigmoid(z)
    return z.reshape(x.shape).astype(x.dtype), mean, rstd


def _xla_bwd(x, w, b, dy, mean, rstd, G, silu):
    dt = B.acc_dtype(x)
    xhat, z = _pre_activation(x, w, b, mean, rstd, G)
    dz = _grouped(dy, G).astype(dt)
    if silu:
        sig = jax.nn.sigmoid(z)
        dz = dz * sig * (1.0 + z * (1.0 - sig))
    wdz = dz * w.astype(dt).reshape(G, -1)
    c1 = jnp.mean(wdz, axis=(1, 3), keepdims=True)
    c2 = jnp.mean(wdz * xhat, axis=(1, 3), keepdims=True)
    dx = (wdz - c1 - xhat * c2) * rstd[:, None, :, None]
    dw = jnp.sum(dz * xhat, axis=(0, 1)).reshape(-1)
    db = jnp.sum(dz, axis=(0, 1)).reshape(-1)
    return dx.reshape(x.shape).astype(x.dtype), dw, db


@functools.partial(custom_op, nondiff_argnums=(3, 4, 5, 6))
def _group_norm(x, weight, bias, num_groups, eps, silu, impl):
    return _forward(x, weight, bias, num_groups, eps, silu)[0]


def _group_norm_fwd(x, weight, bias, num_groups, eps, silu, impl):
    y, mean, rstd = _forward(x, weight, bias, num_groups, eps, silu)
    return y, (x, weight, bias, mean, rstd)


def _group_norm_bwd(num_groups, eps, silu, impl, res, dy):
    x, weight, bias, mean, rstd = res
    if impl.pallas and x.size > 0:
        N, Cc = x.shape[0], x.shape[-1]
        dx, dw, db = kernels.group_norm_bwd(
            x.reshape(N, -1, Cc), weight, bias, dy.reshape(N, -1, Cc), mean, rstd,
            num_groups=num_groups, silu=silu, interpret=impl.interpret,
        )
        dx = dx.reshape(x.shape)
    else:
        dx, dw, db = _xla_bwd(x, weight, bias, dy, mean, rstd, num_groups, silu)
    return dx, dw.astype(weight.dtype), db.astype(bias.dtype)


_group_norm.defvjp(_group_norm_fwd, _group_norm_bwd)


def _group_norm_tangent(num_groups, eps, silu, impl, res, dx, dw, db):
    x, weight, bias = res[:3]
    f = lambda x, w, b: _forward(x, w, b, num_groups, eps, silu)[0]
    return jax.jvp(f, (x, weight, bias), (dx, dw, db))[1]


_group_norm.deftangent(_group_norm_tangent)


def group_norm(x, weight, bias, *, num_groups, eps=1e-5, activation=None, implementation=None):
    """Group normalisation over (spatial dims, channels of a group), channels last.

    ``y = (x - mean_ng) * rstd_ng * weight + bias``, statistics per sample n and group g of
    ``C / num_groups`` consecutive channels; with ``activation="silu"``, ``y * sigmoid(y)``
    (the GroupNorm+SiLU of UNets, fused in forward and backward).

    Args:
      x: [N, ..., C] float32, bfloat16 or float16 (float64 on the XLA path), any number (>= 0) of spatial dims
        (images [N, H, W, C], volumes [N, D, H, W, C], sequences [N, L, C]).
      weight, bias: [C] floating.
      num_groups: positive int dividing C (32 in Stable Diffusion's UNet).
      eps: positive float added to the variance.
      activation: ``None`` or ``"silu"``.
      implementation: ``None`` (Pallas on GPU, XLA elsewhere), ``"pallas"`` or ``"xla"``.

    Returns:
      [N, ..., C] in x's dtype; statistics in float32.

    Residuals: x, weight, bias and mean, rstd [N, num_groups] float32 (x_hat and the
    sigmoid are recomputed in the backward).

    Numerics: as :func:`jaxbwd.layer_norm`'s, per (sample, group): a constant group gives
    exactly ``bias`` (then SiLU) at any eps.

    Raises:
      TypeError: x, weight or bias not floating; num_groups not an int; eps traced.
      ValueError: x of rank < 2, weight/bias not [C], num_groups not dividing C, eps <= 0,
        unknown activation or implementation.
      Also the errors common to every op (``help(jaxbwd)``).

    Source: Wu & He, "Group Normalization" (ECCV 2018). Backward per (n, g), over its M
    elements: ``dx = rstd * (w*dz - mean(w*dz) - x_hat * mean(w*dz * x_hat))``,
    ``dweight = sum(dz * x_hat)``, ``dbias = sum(dz)``, with ``dz = dy`` or, fused SiLU,
    ``dz = dy * sig(z) * (1 + z * (1 - sig(z)))``.
    """
    op = "group_norm"
    B.check_float(op, "x", x)
    B.check_ndim(op, "x", x, min_ndim=2, what="([N, ..., C])")
    Cc = x.shape[-1]
    for name, p in (("weight", weight), ("bias", bias)):
        B.check_float(op, name, p)
        B.check_shape(op, name, p, (Cc,), what=f"(x's channel dimension C={Cc})")
    num_groups = B.static_int(op, "num_groups", num_groups)
    if num_groups <= 0 or Cc % num_groups:
        raise ValueError(
            f"jaxbwd.{op}: num_groups must be a positive divisor of x's channel count C={Cc}, got {num_groups}"
        )
    B.check_positive(op, "eps", eps)
    if activation not in ACTIVATIONS:
        raise ValueError(f"jaxbwd.{op}: activation must be None or 'silu', got {activation!r}")
    impl = B.impl(implementation, op, x, weight, bias)
    # Samples split freely; spatial dims and channels are reduced over (gathered if sharded).
    xs = "n" + "".join(chr(ord("P") + i) for i in range(x.ndim - 2)) + "C"
    return S.partitioned(f"{xs},C,C->{xs}", lambda x, w, b: _group_norm(x, w, b, num_groups, float(eps),
                                                                      activation == "silu", impl), x, weight, bias)
