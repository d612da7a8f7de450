"""Backward kernel of rope: rotate dy by the negative angle.

The input is viewed as rows of one head, [B*T*N, H]; row r has position
``pos[r // N]``. Program i takes ``block_rows`` rows and the H/2 rotation pairs of each
(pair k joins columns (k, k + H/2) in the half-split Llama/NeoX convention, (2k, 2k + 1)
in the interleaved GPT-J one), computes the angle ``pos * theta**(-2k/H)`` in f32 in
registers (no cos/sin tables are read or saved) and writes

    dx_a =  dy_a cos + dy_b sin
    dx_b = -dy_a sin + dy_b cos

the transpose of the forward rotation (RoFormer, Su et al. 2021).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxbwd.pallas import _common as C


def _rope_bwd_kernel(dy_ref, pos_ref, dx_ref, *, t: C.RowTiling, heads: int, head_dim: int, log_theta: float, interleaved: bool):
    rb = pl.program_id(0)
    rows = rb * t.block_rows + jnp.arange(t.block_rows)
    k = jnp.arange(t.block_cols)  # pair index
    rmask = rows < t.n_rows
    mask = rmask[:, None] & (k < t.n_cols)[None, :]
    half = head_dim // 2
    if interleaved:
        ca, cb = 2 * k, 2 * k + 1
    else:
        ca, cb = k, k + half
    pos = C.load(pos_ref, rows // heads, rmask, other=0, dtype=jnp.int32).astype(jnp.float32)
    inv_freq = jnp.exp(k.astype(jnp.float32) * (-2.0 * log_theta / head_dim))
    ang = pos[:, None] * inv_freq[None, :]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    a = C.load_tile(dy_ref, rows, ca, mask)
    b = C.load_tile(dy_ref, rows, cb, mask)
    C.store_tile(dx_ref, rows, ca, a * cos + b * sin, mask)
    C.store_tile(dx_ref, rows, cb, b * cos - a * sin, mask)


def rope_bwd(dy, pos, *, theta: float, interleaved: bool, interpret: bool = False):
    """dx [B, T, N, H] in dy's dtype: dy rotated by minus the angle of each (position, pair).

    Args:
      dy: [B, T, N, H], H even. pos: [B, T] int32 positions.
    """
    Bsz, T, N, H = dy.shape
    R = Bsz * T * N
    dy2 = dy.reshape(R, H)
    t = C.row_tiling(R, H // 2, max_tile=4096)
    kernel = functools.partial(
        _rope_bwd_kernel, t=t, heads=N, head_dim=H, log_theta=math.log(theta), interleaved=bool(interleaved)
    )
    dx = C.call(
        kernel, name="rope_bwd", grid=(t.num_row_blocks,),
        out_shape=jax.ShapeDtypeStruct((R, H), dy.dtype), interpret=interpret,
        num_warps=t.num_warps, flops=6 * R * H, transcendentals=R * H,
        bytes_accessed=2 * C.nbytes(dy) + C.nbytes(pos),
    )(dy2, pos.reshape(-1))
    return dx.reshape(dy.shape)
