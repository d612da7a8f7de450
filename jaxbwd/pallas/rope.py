"""Backward kernel of rope: rotate dy by the negative angle.

The input is viewed as one row per position, [B*T, N*H] (all heads of a position side by
side). Program i takes ``block_pos`` positions, computes the angles
``pos * inv_freq[k]`` of their H/2 rotation pairs and their cos/sin once in f32 registers
(``_common.sincos``: one range reduction for both, no libdevice call; no cos/sin tables
are read or saved; ``inv_freq`` is one [H/2] f32 vector, the forward's own, so Llama 3.1's
rescaled frequencies and float positions come for free), then walks the N heads reusing
them, and writes

    dx_a =  dy_a cos + dy_b sin
    dx_b = -dy_a sin + dy_b cos

the transpose of the forward rotation (RoFormer, Su et al. 2021). Pair k joins columns
(k, k + H/2) of a head in the half-split Llama/NeoX convention: two contiguous tiles. In the
interleaved GPT-J convention it joins (2k, 2k + 1): the head is loaded as one contiguous
[block_pos, H] tile and split into its even and odd columns in registers (and joined back
before the store), so loads and stores stay vectorised.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxbwd.pallas import _common as C

# Elements of one head's tile: with cos and sin of the same size live across the head loop,
# 2048 f32 values over 4 warps stay well inside the register file.
HEAD_TILE = 2048


def _rope_bwd_kernel(dy_ref, pos_ref, freq_ref, dx_ref, *, n_pos: int, heads: int, head_dim: int,
                     block_pos: int, block_half: int, interleaved: bool):
    p = pl.program_id(0) * block_pos + jnp.arange(block_pos, dtype=jnp.int32)
    k = jnp.arange(block_half, dtype=jnp.int32)  # pair index
    pmask = p < n_pos
    kmask = k < head_dim // 2
    mask = pmask[:, None] & kmask[None, :]
    pos = C.load(pos_ref, p, pmask, other=0, dtype=jnp.float32)
    ang = pos[:, None] * C.load(freq_ref, k, kmask)[None, :]
    sin, cos = C.sincos(ang)

    if interleaved:
        c = jnp.arange(2 * block_half, dtype=jnp.int32)
        full = pmask[:, None] & (c < head_dim)[None, :]

        def head(n, carry):
            cols = n * head_dim + c
            a, b = jnp.unstack(C.load_tile(dy_ref, p, cols, full).reshape(block_pos, block_half, 2), axis=-1)
            dx = jnp.stack([a * cos + b * sin, b * cos - a * sin], axis=-1).reshape(block_pos, 2 * block_half)
            C.store_tile(dx_ref, p, cols, dx, full)
            return carry
    else:
        def head(n, carry):
            ca = n * head_dim + k
            cb = ca + head_dim // 2
            a = C.load_tile(dy_ref, p, ca, mask)
            b = C.load_tile(dy_ref, p, cb, mask)
            C.store_tile(dx_ref, p, ca, a * cos + b * sin, mask)
            C.store_tile(dx_ref, p, cb, b * cos - a * sin, mask)
            return carry

    jax.lax.fori_loop(0, heads, head, 0)


def rope_bwd(dy, pos, inv_freq, *, interleaved: bool, interpret: bool = False):
    """dx [B, T, N, H] in dy's dtype: dy rotated by minus the angle of each (position, pair).

    Args:
      dy: [B, T, N, H], H even. pos: [B, T] int32 or float32 positions.
      inv_freq: [H/2] float32 rotary frequencies (the forward's).
    """
    Bsz, T, N, H = dy.shape
    P = Bsz * T
    block_half = C.next_pow2(H // 2)
    block_pos = max(1, min(HEAD_TILE // (2 * block_half), C.next_pow2(P)))
    # Enough programs to fill the GPU twice over when positions are few.
    while block_pos > 1 and C.cdiv(P, block_pos) < 2 * C.num_sms():
        block_pos //= 2
    kernel = functools.partial(_rope_bwd_kernel, n_pos=P, heads=N, head_dim=H, block_pos=block_pos,
                               block_half=block_half, interleaved=bool(interleaved))
    dx = C.call(
        kernel, name="rope_bwd", grid=(C.cdiv(P, block_pos),),
        out_shape=jax.ShapeDtypeStruct((P, N * H), dy.dtype), interpret=interpret,
        num_warps=max(1, min(4, block_pos * block_half // 256)), flops=6 * P * N * H, transcendentals=P * H,
        bytes_accessed=2 * C.nbytes(dy) + C.nbytes(pos, inv_freq),
    )(dy.reshape(P, N * H), pos.reshape(-1), inv_freq.astype(jnp.float32))
    return dx.reshape(dy.shape)
