"""Backward kernels of group_norm (with optional fused SiLU).

x is viewed as [N, S, C] (spatial dims flattened). Both kernels run one program per
(sample n, spatial chunk k): ``rows_per_program`` pixel rows of all C channels, walked in
[block_s, C] tiles, so every load is a coalesced run of whole pixel rows. ``_tuning.split``
sizes K to one wave of the sums kernel's compiled occupancy when the batch allows (the dx
kernel, with more blocks per SM, fills part of its wave; N * G programs, the earlier layout,
is 32 at batch 1):

    group_norm_bwd_sums:  per (n, k, channel) f32 partials  sum_s(dz)  and  sum_s(dz * x_hat)
    (XLA, [N, K, C]):     dbias = sum(dz), dweight = sum(dz * x_hat) over n, k;
                          per (n, group)  c1 = mean(w * dz),  c2 = mean(w * dz * x_hat)
    group_norm_bwd:       dx = rstd * (w * dz - c1 - x_hat * c2)

where x_hat is recomputed from x and the saved f32 (mean, rstd), and, with the fused SiLU,
``dz = dy * sig(z) * (1 + z * (1 - sig(z)))`` with ``z = x_hat * w + b`` recomputed (the
sigmoid is never saved; ``exp`` as ``exp2``). Wu & He, "Group Normalization" (2018); the dx
formula is the layer-norm backward taken over the group's S * Cg elements, with
``sum(w * dz) = w * sum(dz)`` per channel so that two partials serve dweight, dbias and the
group sums. The partials are reduced by XLA in a fixed order: no atomics, bitwise
reproducible. x and dy are read twice (once per kernel): 5/3 of the minimum bytes, as a
two-pass reduction over a tensor larger than the L2 must be. The dx kernel walks each chunk
last tile first, so that its first reads are the sums kernel's last ones, the likeliest
still in L2: at (8, 64x64, 320) bf16, x and dy are 42 MB against an H200's 50 MB L2, so
much of the second read could come from L2; at (8, 256x256, 128), 268 MB, about a fifth
at most (estimates from the sizes, not measured).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxbwd.pallas import _common as C
from jaxbwd.pallas import _tuning


def _chunk(x_ref, dy_ref, w, b, mean, rstd, n, k, i, *, S, rows_per_program, block_s, cols, cmask, silu):
    """Tile i of program (n, k): its rows of [N*S, C], mask, x_hat and dz (f32)."""
    s = k * rows_per_program + i * block_s + jnp.arange(block_s, dtype=jnp.int32)
    mask = (s[:, None] < jnp.minimum((k + 1) * rows_per_program, S)) & cmask[None, :]
    rows = n * S + s
    x = C.load_tile(x_ref, rows, cols, mask)
    dy = C.load_tile(dy_ref, rows, cols, mask)
    xhat = jnp.where(mask, (x - mean) * rstd, 0.0)
    if silu:
        z = xhat * w + b
        sig = 1.0 / (1.0 + C.exp(-z))
        dy = dy * sig * (1.0 + z * (1.0 - sig))
    return rows, mask, xhat, dy


def _params(w_ref, b_ref, mean_ref, rstd_ref, n, cols, cmask, silu):
    w = C.load(w_ref, cols, cmask)[None, :]
    b = C.load(b_ref, cols, cmask)[None, :] if silu else None
    # The group's statistics, repeated per channel by the wrapper ([N, C] f32): a vector load.
    mean = C.load(mean_ref, (n, cols), cmask)[None, :]
    rstd = C.load(rstd_ref, (n, cols), cmask)[None, :]
    return w, b, mean, rstd


def _sums_kernel(x_ref, w_ref, b_ref, dy_ref, mean_ref, rstd_ref, sdz_ref, sdzx_ref, *, S, Cc, K, rows_per_program,
                 block_s, block_c, silu):
    n, k = pl.program_id(0), pl.program_id(1)
    cols = jnp.arange(block_c, dtype=jnp.int32)
    cmask = cols < Cc
    w, b, mean, rstd = _params(w_ref, b_ref, mean_ref, rstd_ref, n, cols, cmask, silu)
    chunk = functools.partial(_chunk, x_ref, dy_ref, w, b, mean, rstd, n, k, S=S, rows_per_program=rows_per_program,
                              block_s=block_s, cols=cols, cmask=cmask, silu=silu)

    def body(i, acc):
        _, _, xhat, dz = chunk(i)
        return acc[0] + jnp.sum(dz, axis=0), acc[1] + jnp.sum(dz * xhat, axis=0)

    zeros = jnp.zeros((block_c,), jnp.float32)
    sdz, sdzx = jax.lax.fori_loop(0, rows_per_program // block_s, body, (zeros, zeros))
    C.store(sdz_ref, (n * K + k, cols), sdz, cmask)
    C.store(sdzx_ref, (n * K + k, cols), sdzx, cmask)


def _dx_kernel(x_ref, w_ref, b_ref, dy_ref, mean_ref, rstd_ref, c1_ref, c2_ref, dx_ref, *, S, Cc, rows_per_program,
               block_s, block_c, silu):
    n, k = pl.program_id(0), pl.program_id(1)
    cols = jnp.arange(block_c, dtype=jnp.int32)
    cmask = cols < Cc
    w, b, mean, rstd = _params(w_ref, b_ref, mean_ref, rstd_ref, n, cols, cmask, silu)
    c1 = C.load(c1_ref, (n, cols), cmask)[None, :]
    c2 = C.load(c2_ref, (n, cols), cmask)[None, :]
    chunk = functools.partial(_chunk, x_ref, dy_ref, w, b, mean, rstd, n, k, S=S, rows_per_program=rows_per_program,
                              block_s=block_s, cols=cols, cmask=cmask, silu=silu)

    n_tiles = rows_per_program // block_s

    def body(i, carry):
        # Last tile first: the sums kernel's programs (one wave, all resident) read their
        # chunks' last tiles last, the likeliest still in L2.
        rows, mask, xhat, dz = chunk(n_tiles - 1 - i)
        C.store_tile(dx_ref, rows, cols, (w * dz - c1 - xhat * c2) * rstd, mask)
        return carry

    jax.lax.fori_loop(0, n_tiles, body, 0)


def _layout(N: int, S: int, Cc: int, dtype, silu: bool):
    """(block_c, block_s, rows_per_program, K, num_warps): [block_s, C] tiles of the tuning
    table's size, K spatial chunks per sample: ``_tuning.split`` fills one wave of the
    compiled occupancy with N * K programs."""
    cfg = _tuning.group_norm(dtype, silu)
    block_c = C.next_pow2(Cc)
    block_s = max(1, min(C.next_pow2(S), cfg.block_n // block_c))
    tiles = C.cdiv(S, block_s)
    K = _tuning.split(N, tiles, cfg)
    rows_per_program = C.cdiv(tiles, K) * block_s
    warps = max(1, min(cfg.num_warps, block_s * block_c // 512))
    return block_c, block_s, rows_per_program, C.cdiv(S, rows_per_program), warps


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
    C.check_index_range("group_norm", rows=N * S, cols=Cc)
    block_c, block_s, rows_per_program, K, warps = _layout(N, S, Cc, x.dtype, silu)
    # Per-channel copies of the [N, G] statistics (N*C*8 bytes): one vector load per program.
    mean_c = jnp.repeat(mean.astype(jnp.float32), Cg, axis=1)
    rstd_c = jnp.repeat(rstd.astype(jnp.float32), Cg, axis=1)
    x2, dy2 = x.reshape(N * S, Cc), dy.reshape(N * S, Cc)
    static = dict(S=S, Cc=Cc, rows_per_program=rows_per_program, block_s=block_s, block_c=block_c, silu=silu)
    part = jax.ShapeDtypeStruct((N * K, Cc), jnp.float32)
    sdz, sdzx = C.call(
        functools.partial(_sums_kernel, K=K, **static), name="group_norm_bwd_sums", grid=(N, K),
        out_shape=(part, part), interpret=interpret, num_warps=warps,
        flops=(20 if silu else 8) * N * S * Cc, transcendentals=(N * S * Cc) if silu else 0,
        bytes_accessed=C.nbytes(x2, dy2) + 8 * N * Cc * (K + 1),
    )(x2, w, b, dy2, mean_c, rstd_c)
    sdz, sdzx = sdz.reshape(N, K, Cc).sum(axis=1), sdzx.reshape(N, K, Cc).sum(axis=1)
    wf = w.astype(jnp.float32)
    inv_m = 1.0 / (S * Cg)
    c1 = ((wf * sdz).reshape(N, G, Cg).sum(-1) * inv_m)
    c2 = ((wf * sdzx).reshape(N, G, Cg).sum(-1) * inv_m)
    dx = C.call(
        functools.partial(_dx_kernel, **static), name="group_norm_bwd", grid=(N, K),
        out_shape=jax.ShapeDtypeStruct((N * S, Cc), x.dtype), interpret=interpret, num_warps=warps,
        flops=(24 if silu else 12) * N * S * Cc, transcendentals=(N * S * Cc) if silu else 0,
        bytes_accessed=C.nbytes(x2, dy2) + C.nbytes(x2) + 16 * N * Cc,
    )(x2, w, b, dy2, mean_c, rstd_c, jnp.repeat(c1, Cg, axis=1), jnp.repeat(c2, Cg, axis=1))
    return dx.reshape(x.shape), sdzx.sum(axis=0), sdz.sum(axis=0)
