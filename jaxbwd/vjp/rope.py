"""rope: rotary position embedding whose backward rotates dy by the negative angle.

Forward (XLA): angles ``pos * inv_freq`` with ``inv_freq = theta**(-2i/H)`` (optionally
rescaled as Llama 3.1) in float32 (float64 for float64 x), the rotation applied in f32 and
cast back. Saved for the backward: the positions [B, T] only (int32; float32, or float64
for float64 x, when fractional, interpolated or past int32); the op is linear in x, so
neither x nor cos/sin tables are kept. Backward: the Pallas ``rope_bwd`` kernel (angles
and their cos/sin recomputed in f32 in registers once per position and pair, reused across
the heads) or the same rotation in XLA.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax.numpy as jnp
import numpy as np

from jaxbwd.pallas import rope as kernels
from jaxbwd.vjp import _base as B
from jaxbwd.vjp._derivatives import custom_op
from jaxbwd import sharding as S


_I32 = np.iinfo(np.int32)


def _fits_int32(dtype) -> bool:
    """An integer dtype every value of which int32 holds (int8-int32, uint8, uint16)."""
    if not jnp.issubdtype(dtype, jnp.integer):
        return False
    info = jnp.iinfo(dtype)
    return _I32.min <= int(info.min) and int(info.max) <= _I32.max


@dataclasses.dataclass(frozen=True)
class _Freqs:
    """The rotary frequencies (static): base ``theta`` and optional Llama 3.1 rescaling
    ``(factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)``."""

    theta: float
    llama3: Optional[tuple] = None

    def inv_freq(self, H, dtype):
        inv = jnp.exp(jnp.arange(H // 2, dtype=dtype) * (-2.0 * math.log(self.theta) / H))
        if self.llama3 is None:
            return inv
        # Llama 3.1: wavelengths longer than original_len / low_freq_factor are divided by
        # factor, shorter than original_len / high_freq_factor kept, and those between
        # interpolated linearly in original_len / wavelength.
        factor, low, high, original_len = self.llama3
        wavelen = 2 * math.pi / inv
        smooth = jnp.clip((original_len / wavelen - low) / (high - low), 0.0, 1.0)
        return (1 - smooth) * inv / factor + smooth * inv


def _rotate(x, pos, freqs, interleaved, sign):
    """x [B, T, N, H] rotated by ``sign`` times the angle of each (position, pair)."""
    H = x.shape[-1]
    acc = B.acc_dtype(x)
    xf = x.astype(acc)
    inv_freq = freqs.inv_freq(H, acc)
    ang = pos.astype(acc)[:, :, None, None] * inv_freq
    cos, sin = jnp.cos(ang), sign * jnp.sin(ang)
    if interleaved:
        a, b = xf[..., 0::2], xf[..., 1::2]
        y = jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(x.shape)
    else:
        a, b = xf[..., : H // 2], xf[..., H // 2:]
        y = jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    return y.astype(x.dtype)


@functools.partial(custom_op, nondiff_argnums=(2, 3, 4))
def _rope(x, pos, freqs, interleaved, impl):
    return _rotate(x, pos, freqs, interleaved, 1.0)


def _rope_fwd(x, pos, freqs, interleaved, impl):
    return _rotate(x, pos, freqs, interleaved, 1.0), pos


def _rope_bwd(freqs, interleaved, impl, pos, dy):
    if impl.pallas:
        dx = kernels.rope_bwd(dy, pos, freqs.inv_freq(dy.shape[-1], jnp.float32), interleaved=interleaved,
                              interpret=impl.interpret)
    else:
        dx = _rotate(dy, pos, freqs, interleaved, -1.0)
    return dx, None


_rope.defvjp(_rope_fwd, _rope_bwd)
_rope.deftangent(lambda freqs, interleaved, impl, pos, dx, _: _rotate(dx, pos, freqs, interleaved, 1.0))  # linear


_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _check_frequency_scaling(op, scaling):
    if scaling is None:
        return None
    if not isinstance(scaling, dict) or scaling.get("rope_type", "llama3") != "llama3":
        raise ValueError(f"jaxbwd.{op}: frequency_scaling must be None or a dict with rope_type 'llama3' and keys "
                         f"{_LLAMA3_KEYS}, got {scaling!r}")
    unknown = set(scaling) - set(_LLAMA3_KEYS) - {"rope_type"}
    if unknown or any(key not in scaling for key in _LLAMA3_KEYS):
        raise ValueError(f"jaxbwd.{op}: frequency_scaling needs exactly the keys {_LLAMA3_KEYS} (and optionally "
                         f"rope_type='llama3'), got {sorted(scaling)}")
    vals = tuple(B.check_static_number(op, f"frequency_scaling[{key!r}]", scaling[key]) for key in _LLAMA3_KEYS)
    for key, v in zip(_LLAMA3_KEYS, vals):
        B.check_positive(op, f"frequency_scaling[{key!r}]", v)
    if not vals[2] > vals[1]:
        raise ValueError(f"jaxbwd.{op}: frequency_scaling needs high_freq_factor > low_freq_factor, "
                         f"got {vals[2]} and {vals[1]}")
    return vals


def rope(x, *, positions=None, start_pos=0, theta=10000.0, interleaved=False, scale_factor=1.0,
         frequency_scaling=None, implementation=None):
    """Rotary position embedding of queries or keys ``x`` [B, T, N, H].

    Pair i of head dimension H at position p is rotated by ``(p / scale_factor) * f_i`` with
    ``f_i = theta**(-2i/H)`` (rescaled by ``frequency_scaling``). Half-split (Llama/NeoX,
    default) pairs x[..., i] with x[..., i + H/2]; ``interleaved=True`` (GPT-J) pairs
    x[..., 2i] with x[..., 2i + 1]. Any number of heads N (q heads or GQA's fewer kv heads)
    works the same.

    Args:
      x: [B, T, N, H] float32, bfloat16 or float16 (float64 on the XLA path); H even.
      positions: ``None``, or [T] (shared) or [B, T] (per sequence, e.g. packing); integer,
        or floating for fractional positions (computed in float32, float64 for float64 x;
        they get no gradient).
      start_pos: used when ``positions`` is None: positions are ``start_pos + arange(T)``.
        A Python int or an int scalar array (may be traced, e.g. a KV-cache offset).
      theta: positive static float, the rotary base.
      interleaved: static bool, GPT-J pairing instead of half-split.
      scale_factor: positive static float; positions are divided by it (linear position
        interpolation, Chen et al. 2023; Gemma 3's global layers use 8). 1.0: none.
      frequency_scaling: ``None`` or Llama 3.1's rescaling, a dict with the keys
        ``factor``, ``low_freq_factor``, ``high_freq_factor`` and
        ``original_max_position_embeddings`` (as in Llama 3.1's ``rope_scaling``; an
        optional ``rope_type`` must be ``"llama3"``): frequencies with wavelength above
        ``original / low_freq_factor`` are divided by ``factor``, those below
        ``original / high_freq_factor`` kept, those between interpolated.
      implementation: ``None`` (Pallas on GPU, XLA elsewhere), ``"pallas"`` or ``"xla"``.

    Returns:
      [B, T, N, H] in x's dtype; angles and rotation computed in float32 (float64 for
      float64 x). The Pallas backward evaluates cos and sin itself (``pallas._common.sincos``,
      no libdevice call): within 9.5e-8 of float64 for angles below 2**36 radians (69
      billion positions at ``f_0 = 1``); NaN gradients from there.

    Residuals: the positions [B, T], int32 (float32, float64 for float64 x, when fractional,
    scale_factor != 1, of a dtype int32 cannot hold: int64, uint32, uint64, or from a static
    start_pos past int32);
    no x, no cos/sin tables. Rescaled frequencies are recomputed in the backward and read
    by the kernel as one [H/2] vector.

    Raises:
      TypeError: x not floating; positions neither integer nor floating; start_pos not
        integer; theta, scale_factor, interleaved or a frequency_scaling value not static.
      ValueError: x not of rank 4, H odd, positions not [T] or [B, T], start_pos not a
        scalar, theta or scale_factor <= 0 or not finite, malformed frequency_scaling, unknown
        implementation.
      Also the errors common to every op (``help(jaxbwd)``).

    Source: Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding"
    (2021); Chen et al., "Extending Context Window of Large Language Models via Positional
    Interpolation" (2023); Meta, Llama 3.1 (2024) for the frequency rescaling. The backward
    is the transpose rotation: dy rotated by the negative angle.
    """
    op = "rope"
    B.check_float(op, "x", x)
    B.check_ndim(op, "x", x, ndim=4, what="([B, T, N, H])")
    B.check_nonempty_axis(op, "x", x, 3, "head dim H")
    Bsz, T, N, H = x.shape
    if H % 2:
        raise ValueError(f"jaxbwd.{op}: x's head dimension H must be even, got shape {tuple(x.shape)}")
    B.check_positive(op, "theta", theta)
    scale_factor = B.check_static_number(op, "scale_factor", scale_factor)
    B.check_positive(op, "scale_factor", scale_factor)
    llama3 = _check_frequency_scaling(op, frequency_scaling)
    if not isinstance(interleaved, (bool, np.bool_)):
        raise TypeError(f"jaxbwd.{op}: interleaved must be a static bool, got {interleaved!r}")
    if positions is not None and (not B.is_static_int(start_pos) or start_pos != 0):
        raise ValueError(f"jaxbwd.{op}: give positions or start_pos, not both (got positions and start_pos={start_pos!r})")
    # Positions reach the kernels as int32, or as float32 where int32 cannot hold them (a
    # 64-bit or uint32 dtype, a static start past int32): the angle is float32(position) *
    # inv_freq either way, so only the wrap of a narrowing cast is avoided. (A traced int32
    # start near 2**31 wraps in its own int32 sum, as jnp's start + arange(T) would.)
    # float64 x (the XLA path) keeps float64 positions and angles.
    fdt = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
    if positions is None:
        if B.is_static_int(start_pos):
            if _I32.min <= int(start_pos) and int(start_pos) + T - 1 <= _I32.max:
                pos = jnp.int32(start_pos) + jnp.arange(T, dtype=jnp.int32)
            else:  # float64 holds every start below 2**53 exactly; one rounding to float32
                pos = jnp.asarray((np.arange(T, dtype=np.float64) + float(start_pos)).astype(fdt))
        else:
            if not hasattr(start_pos, "dtype") or isinstance(start_pos, (bool, np.bool_)):
                raise TypeError(f"jaxbwd.{op}: start_pos must be a Python int or an integer scalar array, "
                                f"got {start_pos!r}")
            B.check_int(op, "start_pos", start_pos)
            if jnp.ndim(start_pos) != 0:
                raise ValueError(f"jaxbwd.{op}: start_pos must be a scalar, got shape {tuple(jnp.shape(start_pos))}")
            # in int32 (narrower starts widened first), or in a wider start's own dtype
            dt = jnp.int32 if _fits_int32(start_pos.dtype) else start_pos.dtype
            pos = start_pos.astype(dt) + jnp.arange(T, dtype=dt)
            pos = pos if dt == jnp.int32 else pos.astype(fdt)
    else:
        B.check_array(op, "positions", positions)
        if not (jnp.issubdtype(positions.dtype, jnp.integer) or jnp.issubdtype(positions.dtype, jnp.floating)):
            raise TypeError(f"jaxbwd.{op}: positions must have an integer or floating dtype, got {positions.dtype}")
        if tuple(positions.shape) not in ((T,), (Bsz, T)):
            raise ValueError(
                f"jaxbwd.{op}: positions must have shape ({T},) or ({Bsz}, {T}) (x's [T] or [B, T]), "
                f"got {tuple(positions.shape)}"
            )
        pos = positions.astype(jnp.int32 if _fits_int32(positions.dtype) else fdt)
    if scale_factor != 1.0:
        pos = pos.astype(fdt) / np.array(scale_factor, fdt)
    pos = jnp.broadcast_to(pos, (Bsz, T))
    impl = B.impl(implementation, op, x)
    freqs = _Freqs(float(theta), llama3)
    return S.partitioned("bTnH,bT->bTnH", lambda x, p: _rope(x, p, freqs, bool(interleaved), impl), x, pos)
