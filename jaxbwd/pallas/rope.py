"""Backward kernel of rope: rotate dy by the negative angle.

The input is viewed as rows of one head, [B*T*N, H]; row r has position
``pos[r // N]``. Program i takes ``block_rows`` rows and the H/2 rotation pairs of each
(pair k joins columns (k, k + H/2) in the half-split Llama/NeoX convention, (2k, 2k + 1)
in the interleaved GPT-J one), computes the angle ``pos * theta**(-2k/H)`` in f32 in
registers (no cos/sin tables are read or saved; rescaled frequencies such as Llama 3.1's
are read as one [H/2] f32 vector, and positions may be float) and writes

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


def _rope_bwd_kernel(*refs, t: C.RowTiling, heads: int, head_dim: int, log_theta: float, interleaved: bool,
                     table: bool):
    dy_ref, pos_ref, dx_ref = refs[0], refs[1], refs[-1]
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
    pos = C.load(pos_ref, rows // heads, rmask, other=0, dtype=jnp.float32)
    if table:
        inv_freq = C.load(refs[2], k, k < t.n_cols, other=0.0)
    else:
        inv_freq = jnp.exp(k.astype(jnp.float32) * (-2.0 * log_theta / head_dim))
    ang = pos[:, None] * inv_freq[None, :]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    a = C.load_tile(dy_ref, rows, ca, mask)
    b = C.load_tile(dy_ref, rows, cb, mask)
    C.store_tile(dx_ref, rows, ca, a * cos + b * sin, mask)
    C.store_tile(dx_ref, rows, cb, b * cos - a * sin, mask)


def rope_bwd(dy, pos, *, theta: float, interleaved: bool, inv_freq=None, interpret: bool = False):
    """dx [B, T, N, H] in dy's dtype: dy rotated by minus the angle of each (position, pair).

    Args:
      dy: [B, T, N, H], H even. pos: [B, T] int32 or float32 positions.
      inv_freq: ``None`` (``theta**(-2k/H)``, computed in registers) or [H/2] float32
        frequencies (then ``theta`` is unused).
    """
    Bsz, T, N, H = dy.shape
    R = Bsz * T * N
    dy2 = dy.reshape(R, H)
    t = C.row_tiling(R, H // 2, max_tile=4096)
    kernel = functools.partial(
        _rope_bwd_kernel, t=t, heads=N, head_dim=H, log_theta=math.log(theta), interleaved=bool(interleaved),
        table=inv_freq is not None,
    )
    extra = () if inv_freq is None else (inv_freq.astype(jnp.float32),)
    dx = C.call(
        kernel, name="rope_bwd", grid=(t.num_row_blocks,),
        out_shape=jax.ShapeDtypeStruct((R, H), dy.dtype), interpret=interpret,
        num_warps=t.num_warps, flops=6 * R * H, transcendentals=R * H,
        bytes_accessed=2 * C.nbytes(dy) + C.nbytes(pos),
    )(dy2, pos.reshape(-1), *extra)
    return dx.reshape(dy.shape)
