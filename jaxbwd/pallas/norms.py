"""Backward kernels of rms_norm and layer_norm.

One kernel computes dx and the weight/bias gradient partials. Its grid is persistent:
``G`` programs each walk row blocks ``pid, pid + G, ...``. Per row block it recomputes
x_hat from x and the saved f32 statistics (mean, rstd) instead of reading a saved
normalised x, then

    wdy = (w + offset) * dy
    dx  = rstd * (wdy - x_hat * mean(x_hat * wdy) - [layer_norm] mean(wdy))
    dw += sum_rows(dy * x_hat),   db += sum_rows(dy)

(the standard normalisation backward, e.g. Ba et al. 2016 for LayerNorm and Zhang &
Sennrich 2019 for RMSNorm). Each program writes its own row of an f32 [G, D] partial
buffer, summed afterwards by XLA: deterministic, no atomics. When a row fits in one
tile the partials stay in registers across the program's rows; otherwise each program
read-modify-writes its own partial row, which is private to it and so race-free.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxbwd.pallas import _common as C


def _norm_bwd_kernel(*refs, t: C.RowTiling, offset: float, centered: bool, n_iter: int, G: int):
    if centered:
        x_ref, w_ref, dy_ref, mean_ref, rstd_ref, dx_ref, dw_ref, db_ref = refs
    else:
        x_ref, w_ref, dy_ref, rstd_ref, dx_ref, dw_ref = refs
        mean_ref = db_ref = None
    pid = pl.program_id(0)
    single = t.num_col_blocks == 1
    inv_d = 1.0 / t.n_cols

    if not single:  # zero this program's partial rows before read-modify-write
        def zero_body(j, c):
            cols = j * t.block_cols + jnp.arange(t.block_cols)
            cmask = cols < t.n_cols
            z = jnp.zeros((t.block_cols,), jnp.float32)
            C.store(dw_ref, (pid, cols), z, cmask)
            if centered:
                C.store(db_ref, (pid, cols), z, cmask)
            return c

        jax.lax.fori_loop(0, t.num_col_blocks, zero_body, 0)

    def row_block(it, acc):
        rb = pid + it * G
        rows = rb * t.block_rows + jnp.arange(t.block_rows)
        rmask = rows < t.n_rows
        rstd = C.load(rstd_ref, rows, rmask)[:, None]
        mean = C.load(mean_ref, rows, rmask)[:, None] if centered else 0.0

        def load_chunk(j):
            _, cols, mask = C.tile_index(rb, j, t)
            x = C.load_tile(x_ref, rows, cols, mask)
            dy = C.load_tile(dy_ref, rows, cols, mask)
            w = C.load(w_ref, cols, cols < t.n_cols) + offset
            xhat = (x - mean) * rstd
            return cols, mask, xhat, dy, w[None, :] * dy

        def row_sums(tiles):
            _, _, xhat, _, wdy = tiles
            s = (jnp.sum(xhat * wdy, axis=1),)
            return s + (jnp.sum(wdy, axis=1),) if centered else s

        def write_chunk(j, tiles, sums):
            cols, mask, xhat, dy, wdy = tiles
            c1 = sums[0][:, None] * inv_d
            corr = xhat * c1 + (sums[1][:, None] * inv_d if centered else 0.0)
            C.store_tile(dx_ref, rows, cols, (wdy - corr) * rstd, mask)
            dw = jnp.sum(dy * xhat, axis=0)
            db = jnp.sum(dy, axis=0) if centered else None
            if single:
                return dw, db
            cmask = cols < t.n_cols
            C.store(dw_ref, (pid, cols), C.load(dw_ref, (pid, cols), cmask) + dw, cmask)
            if centered:
                C.store(db_ref, (pid, cols), C.load(db_ref, (pid, cols), cmask) + db, cmask)
            return None

        out = C.row_reduce_then_write(t, load_chunk, row_sums, write_chunk)
        if single:
            return (acc[0] + out[0], acc[1] + out[1] if centered else acc[1])
        return acc

    zeros = jnp.zeros((t.block_cols,), jnp.float32)
    acc = jax.lax.fori_loop(0, n_iter, row_block, (zeros, zeros))
    if single:
        cols = jnp.arange(t.block_cols)
        cmask = cols < t.n_cols
        C.store(dw_ref, (pid, cols), acc[0], cmask)
        if centered:
            C.store(db_ref, (pid, cols), acc[1], cmask)


def norm_bwd(x, w, dy, mean, rstd, *, offset: float = 0.0, interpret: bool = False):
    """dx, dweight (and dbias when ``mean`` is given) of rms_norm / layer_norm.

    Args:
      x, dy: [R, D], same dtype. w: [D]. mean (layer_norm only; ``None`` for rms_norm)
        and rstd: [R] float32, the statistics saved by the forward.
    Returns:
      dx [R, D] in x's dtype; dw [D] float32; db [D] float32 (layer_norm) or ``None``.
    """
    R, D = x.shape
    centered = mean is not None
    t = C.row_tiling(R, D)
    G = min(t.num_row_blocks, C.PERSISTENT_PROGRAMS)
    n_iter = C.cdiv(t.num_row_blocks, G)
    part = jax.ShapeDtypeStruct((G, D), jnp.float32)
    out_shape = [jax.ShapeDtypeStruct((R, D), x.dtype), part] + ([part] if centered else [])
    name = "layer_norm_bwd" if centered else "rms_norm_bwd"
    kernel = functools.partial(_norm_bwd_kernel, t=t, offset=float(offset), centered=centered, n_iter=n_iter, G=G)
    inputs = (x, w, dy) + ((mean,) if centered else ()) + (rstd,)
    outs = C.call(
        kernel, name=name, grid=(G,), out_shape=out_shape, interpret=interpret,
        num_warps=t.num_warps, flops=10 * R * D,
        bytes_accessed=C.nbytes(*inputs) + C.nbytes(x) + 4 * G * D * len(out_shape[1:]),
    )(*inputs)
    dx, dw = outs[0], outs[1].sum(axis=0)
    db = outs[2].sum(axis=0) if centered else None
    return dx, dw, db
