"""Backward kernel of group_norm (with optional fused SiLU).

Grid: one program per (sample n, group g). The program's data is the [S, Cg] slab of
x viewed as [N*S, C] (rows n*S .. n*S+S-1, columns g*Cg .. g*Cg+Cg-1), walked in chunks
of ``block_s`` spatial rows so that any image size fits (64x64x512 is 4096 rows of a
16-column group). Two passes over the chunks (the second mostly hits L2):

    pass 1:  sum(w*dz) and sum(w*dz * x_hat) over the slab (f32 scalars)
    pass 2:  dx = rstd * (w*dz - mean(w*dz) - x_hat * mean(w*dz * x_hat))
             dweight partial += sum_s(dz * x_hat),  dbias partial += sum_s(dz)

where x_hat is recomputed from x and the saved f32 (mean, rstd) and, with the fused SiLU,
``dz = dy * sig(z) * (1 + z * (1 - sig(z)))`` with ``z = x_hat * w + b`` recomputed (the
sigmoid is never saved). Wu & He, "Group Normalization" (2018); the dx formula is the
layer-norm backward taken over the group's S*Cg elements.

Each program writes its columns of row n of f32 [N, C] partial buffers for dweight and
dbias; XLA sums them over n afterwards: fixed order, no atomics, bitwise reproducible.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxbwd.pallas import _common as C

# Elements per chunk tile: 4096 f32 values keep x, dy and the recomputed terms in registers.
GROUP_TILE = 4096


def _group_norm_bwd_kernel(x_ref, w_ref, b_ref, dy_ref, mean_ref, rstd_ref, dx_ref, dw_ref, db_ref, *,
                           S: int, Cg: int, G: int, block_s: int, block_c: int, silu: bool):
    pid = pl.program_id(0)
    # (G == 1 spelled out: Triton's lowering rejects an integer remainder by the literal 1.)
    n, g = (pid, 0) if G == 1 else (pid // G, pid % G)
    cj = jnp.arange(block_c)
    cmask = cj < Cg
    cols = g * Cg + cj
    w = C.load(w_ref, cols, cmask)[None, :]
    b = C.load(b_ref, cols, cmask)[None, :] if silu else None
    # The group's statistics, repeated per column by the wrapper ([N, C] f32): a vector load.
    mean = C.load(mean_ref, (n, cols), cmask)[None, :]
    rstd = C.load(rstd_ref, (n, cols), cmask)[None, :]
    n_chunks = C.cdiv(S, block_s)
    inv_m = 1.0 / (S * Cg)

    def load_chunk(k):
        s = k * block_s + jnp.arange(block_s)
        mask = (s[:, None] < S) & cmask[None, :]
        rows = n * S + s
        x = C.load_tile(x_ref, rows, cols, mask)
        dy = C.load_tile(dy_ref, rows, cols, mask)
        xhat = jnp.where(mask, (x - mean) * rstd, 0.0)
        if silu:
            z = xhat * w + b
            sig = C.sigmoid(z)
            dy = dy * sig * (1.0 + z * (1.0 - sig))
        return rows, mask, xhat, dy

    def sums_body(k, acc):
        _, _, xhat, dz = load_chunk(k)
        wdz = w * dz
        return acc[0] + jnp.sum(wdz, axis=0), acc[1] + jnp.sum(wdz * xhat, axis=0)

    zeros = jnp.zeros((block_c,), jnp.float32)
    s1, s2 = jax.lax.fori_loop(0, n_chunks, sums_body, (zeros, zeros))
    c1 = jnp.sum(s1) * inv_m
    c2 = jnp.sum(s2) * inv_m

    def write_body(k, acc):
        rows, mask, xhat, dz = load_chunk(k)
        dx = (w * dz - c1 - xhat * c2) * rstd
        C.store_tile(dx_ref, rows, cols, dx, mask)
        return acc[0] + jnp.sum(dz * xhat, axis=0), acc[1] + jnp.sum(dz, axis=0)

    dw, db = jax.lax.fori_loop(0, n_chunks, write_body, (zeros, zeros))
    C.store(dw_ref, (n, cols), dw, cmask)
    C.store(db_ref, (n, cols), db, cmask)


def group_norm_bwd(x, w, b, dy, mean, rstd, *, num_groups: int, silu: bool, interpret: bool = False):
    """dx, dweight and dbias of group_norm.

    Args:
      x, dy: [N, S, C] (spatial dims flattened), same dtype. w, b: [C].
      mean, rstd: [N, G] float32, the statistics saved by the forward.
      num_groups: G, with C % G == 0. silu: the forward applied SiLU after the affine.
    Returns:
      dx [N, S, C] in x's dtype; dweight [C] and dbias [C] float32.
    """
    N, S, Cc = x.shape
    G = num_groups
    Cg = Cc // G
    block_c = C.next_pow2(Cg)
    block_s = max(1, min(C.next_pow2(S), GROUP_TILE // block_c))
    # Per-column copies of the [N, G] statistics (N*C*8 bytes): one vector load per program.
    mean_c = jnp.repeat(mean.astype(jnp.float32), Cg, axis=1)
    rstd_c = jnp.repeat(rstd.astype(jnp.float32), Cg, axis=1)
    x2, dy2 = x.reshape(N * S, Cc), dy.reshape(N * S, Cc)
    part = jax.ShapeDtypeStruct((N, Cc), jnp.float32)
    kernel = functools.partial(
        _group_norm_bwd_kernel, S=S, Cg=Cg, G=G, block_s=block_s, block_c=block_c, silu=silu
    )
    tile = block_s * block_c
    dx, dw, db = C.call(
        kernel, name="group_norm_bwd", grid=(N * G,),
        out_shape=[jax.ShapeDtypeStruct((N * S, Cc), x.dtype), part, part], interpret=interpret,
        num_warps=max(1, min(8, tile // 512)), flops=(24 if silu else 14) * N * S * Cc,
        transcendentals=(2 * N * S * Cc) if silu else 0,
        bytes_accessed=2 * C.nbytes(x2, dy2) + C.nbytes(x2) + 8 * N * Cc * 2,
    )(x2, w, b, dy2, mean_c, rstd_c)
    return dx.reshape(x.shape), dw.sum(axis=0), db.sum(axis=0)
