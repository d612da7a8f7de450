"""rope: rotary position embedding whose backward rotates dy by the negative angle.

Forward (XLA): angles ``pos * theta**(-2i/H)`` in float32 (float64 for float64 x), the
rotation applied in f32 and cast back. Saved for the backward: the int32 positions
[B, T] only; the op is linear in x, so neither x nor cos/sin tables are kept. Backward:
the Pallas ``rope_bwd`` kernel (angles recomputed in f32 in registers) or the same
rotation in XLA.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxbwd.pallas import rope as kernels
from jaxbwd.vjp import _base as B
from jaxbwd import sharding as S


def _rotate(x, pos, theta, interleaved, sign):
    """x [B, T, N, H] rotated by ``sign`` times the angle of each (position, pair)."""
    H = x.shape[-1]
    acc = B.acc_dtype(x)
    xf = x.astype(acc)
    inv_freq = jnp.exp(jnp.arange(H // 2, dtype=acc) * (-2.0 * math.log(theta) / H))
    ang = pos.astype(jnp.float32).astype(acc)[:, :, None, None] * inv_freq
    cos, sin = jnp.cos(ang), sign * jnp.sin(ang)
    if interleaved:
        a, b = xf[..., 0::2], xf[..., 1::2]
        y = jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(x.shape)
    else:
        a, b = xf[..., : H // 2], xf[..., H // 2:]
        y = jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    return y.astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _rope(x, pos, theta, interleaved, impl):
    return _rotate(x, pos, theta, interleaved, 1.0)


def _rope_fwd(x, pos, theta, interleaved, impl):
    return _rotate(x, pos, theta, interleaved, 1.0), pos


def _rope_bwd(theta, interleaved, impl, pos, dy):
    if impl.pallas:
        dx = kernels.rope_bwd(dy, pos, theta=theta, interleaved=interleaved, interpret=impl.interpret)
    else:
        dx = _rotate(dy, pos, theta, interleaved, -1.0)
    return dx, None


_rope.defvjp(_rope_fwd, _rope_bwd)


def _is_static_int(v):
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def rope(x, *, positions=None, start_pos=0, theta=10000.0, interleaved=False, implementation=None):
    """Rotary position embedding of queries or keys ``x`` [B, T, N, H].

    Pair i of head dimension H at position p is rotated by ``p * theta**(-2i/H)``. Half-split
    (Llama/NeoX, default) pairs x[..., i] with x[..., i + H/2]; ``interleaved=True`` (GPT-J)
    pairs x[..., 2i] with x[..., 2i + 1]. Any number of heads N (q heads or GQA's fewer kv
    heads) works the same.

    Args:
      x: [B, T, N, H] float32, bfloat16 or float16; H even.
      positions: ``None``, or int [T] (shared) or [B, T] (per sequence, e.g. packing).
      start_pos: used when ``positions`` is None: positions are ``start_pos + arange(T)``.
        A Python int or an int scalar array (may be traced, e.g. a KV-cache offset).
      theta: positive static float, the rotary base.
      interleaved: static bool, GPT-J pairing instead of half-split.
      implementation: ``None`` (Pallas on GPU, XLA elsewhere), ``"pallas"`` or ``"xla"``.

    Returns:
      [B, T, N, H] in x's dtype; angles and rotation computed in float32.

    Residuals: the int32 positions [B, T] (no x, no cos/sin tables).

    Raises:
      TypeError: x not floating; positions or start_pos not integer; theta or interleaved
        not static.
      ValueError: x not of rank 4, H odd, positions not [T] or [B, T], start_pos not a
        scalar, theta <= 0, unknown implementation.

    Source: Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding"
    (2021). The backward is the transpose rotation: dy rotated by the negative angle.
    """
    op = "rope"
    B.check_float(op, "x", x)
    B.check_ndim(op, "x", x, ndim=4, what="([B, T, N, H])")
    Bsz, T, N, H = x.shape
    if H % 2:
        raise ValueError(f"jaxbwd.{op}: x's head dimension H must be even, got shape {tuple(x.shape)}")
    B.check_positive(op, "theta", theta)
    if not isinstance(interleaved, (bool, np.bool_)):
        raise TypeError(f"jaxbwd.{op}: interleaved must be a static bool, got {interleaved!r}")
    if positions is not None and (not _is_static_int(start_pos) or start_pos != 0):
        raise ValueError(f"jaxbwd.{op}: give positions or start_pos, not both (got positions and start_pos={start_pos!r})")
    if positions is None:
        if _is_static_int(start_pos):
            start = jnp.int32(start_pos)
        else:
            B.check_int(op, "start_pos", start_pos)
            if jnp.ndim(start_pos) != 0:
                raise ValueError(f"jaxbwd.{op}: start_pos must be a scalar, got shape {tuple(jnp.shape(start_pos))}")
            start = start_pos.astype(jnp.int32)
        pos = start + jnp.arange(T, dtype=jnp.int32)
    else:
        B.check_int(op, "positions", positions)
        if tuple(positions.shape) not in ((T,), (Bsz, T)):
            raise ValueError(
                f"jaxbwd.{op}: positions must have shape ({T},) or ({Bsz}, {T}) (x's [T] or [B, T]), "
                f"got {tuple(positions.shape)}"
            )
        pos = positions.astype(jnp.int32)
    pos = jnp.broadcast_to(pos, (Bsz, T))
    impl = B.impl(implementation, op, x)
    return S.partitioned("bTnH,bT->bTnH", lambda x, p: _rope(x, p, float(theta), bool(interleaved), impl), x, pos)
