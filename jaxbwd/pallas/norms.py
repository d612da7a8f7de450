"""Backward kernels of rms_norm and layer_norm.

One kernel computes dx and the weight/bias gradient partials. Per row it recomputes
x_hat from x and the saved f32 statistics (mean, rstd) instead of reading a saved
normalised x, then

    wdy = (w + offset) * dy
    dx  = rstd * (wdy - x_hat * mean(x_hat * wdy) - [layer_norm] mean(wdy))
    dw += sum_rows(dy * x_hat),   db += sum_rows(dy)

(the standard normalisation backward, e.g. Ba et al. 2016 for LayerNorm and Zhang &
Sennrich 2019 for RMSNorm).

Grid (column chunks, G). A row of up to ``block_n`` columns (the tuning table's, 8192) is one
chunk: program (0, g) holds it in registers, one read of x and dy, one write of dx. Wider
rows are cut into chunks, one program per chunk and row set; each program still needs the
full-row sums, so it first reads every chunk of its rows for them (its neighbours in the
grid read the same rows at the same time, so those reads mostly hit L2), then its own
chunk once more for dx, which it writes for that chunk only. Holding the own chunk across
the sums instead (one read fewer) spilled 40-56 B on sm_80 at 5120 columns. Program (j, g) walks rows g, g + G, ... (a persistent grid, G
from the compiled occupancy: ``_tuning.split``), keeps its dw/db partials and its chunk of
the weight in registers for all its rows, and writes them once to row g of an f32 [G, D]
buffer that XLA sums: deterministic, no atomics, no read-modify-write through memory.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxbwd.pallas import _common as C
from jaxbwd.pallas import _tuning


def _norm_bwd_kernel(*refs, t: C.RowTiling, offset: float, centered: bool, n_iter: int, G: int):
    if centered:
        x_ref, w_ref, dy_ref, mean_ref, rstd_ref, dx_ref, dw_ref, db_ref = refs
    else:
        x_ref, w_ref, dy_ref, rstd_ref, dx_ref, dw_ref = refs
        mean_ref = db_ref = None
    j, g = pl.program_id(0), pl.program_id(1)
    n_chunks = t.num_col_blocks
    inv_d = 1.0 / t.n_cols
    cols = j * t.block_cols + jnp.arange(t.block_cols, dtype=jnp.int32)
    cmask = cols < t.n_cols
    # The weight chunk is the same for every row: held in registers when the row is one chunk
    # (with several chunks the registers go to the other chunks' sums; w then comes from L1).
    w_chunk = lambda: (C.load(w_ref, cols, cmask) + offset)[None, :]  # noqa: E731
    w_hoisted = w_chunk() if n_chunks == 1 else None

    def chunk_sums(rows, rmask, mean, rstd, jj):
        """Row sums of x_hat * wdy (and wdy) over another column chunk ``jj`` of the rows."""
        c = jj * t.block_cols + jnp.arange(t.block_cols, dtype=jnp.int32)
        m = rmask[:, None] & (c < t.n_cols)[None, :]
        xh = (C.load_tile(x_ref, rows, c, m) - mean) * rstd
        wdy = (C.load(w_ref, c, c < t.n_cols) + offset)[None, :] * C.load_tile(dy_ref, rows, c, m)
        s = (jnp.sum(xh * wdy, axis=1),)
        return s + (jnp.sum(wdy, axis=1),) if centered else s

    def row_block(it, acc):
        rows = (g + it * G) * t.block_rows + jnp.arange(t.block_rows, dtype=jnp.int32)
        rmask = rows < t.n_rows
        mask = rmask[:, None] & cmask[None, :]
        rstd = C.load(rstd_ref, rows, rmask)[:, None]
        mean = C.load(mean_ref, rows, rmask)[:, None] if centered else 0.0
        if n_chunks > 1:
            # Every chunk's sums first (module docstring), starting with the program's own.
            def every(k, s):
                jj = C.imod(j + k, n_chunks)
                return tuple(a + b for a, b in zip(s, chunk_sums(rows, rmask, mean, rstd, jj)))

            z = jnp.zeros((t.block_rows,), jnp.float32)
            sums = jax.lax.fori_loop(0, n_chunks, every, (z, z) if centered else (z,))
        dy = C.load_tile(dy_ref, rows, cols, mask)
        xhat = (C.load_tile(x_ref, rows, cols, mask) - mean) * rstd
        wdy = (w_hoisted if n_chunks == 1 else w_chunk()) * dy
        if n_chunks == 1:
            sums = (jnp.sum(xhat * wdy, axis=1),) + ((jnp.sum(wdy, axis=1),) if centered else ())
        corr = xhat * (sums[0][:, None] * inv_d) + (sums[1][:, None] * inv_d if centered else 0.0)
        C.store_tile(dx_ref, rows, cols, (wdy - corr) * rstd, mask)
        dw = acc[0] + jnp.sum(dy * xhat, axis=0)
        return (dw, acc[1] + jnp.sum(dy, axis=0)) if centered else (dw, acc[1])

    zeros = jnp.zeros((t.block_cols,), jnp.float32)
    dw, db = jax.lax.fori_loop(0, n_iter, row_block, (zeros, zeros))
    C.store(dw_ref, (g, cols), dw, cmask)
    if centered:
        C.store(db_ref, (g, cols), db, cmask)


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
    C.check_index_range("layer_norm" if centered else "rms_norm", rows=R, cols=D)
    t, cfg = _tuning.norm_bwd(R, D, centered)
    n_chunks = t.num_col_blocks
    G = _tuning.split(n_chunks, t.num_row_blocks, cfg)
    n_iter = C.cdiv(t.num_row_blocks, G)
    part = jax.ShapeDtypeStruct((G, D), jnp.float32)
    out_shape = [jax.ShapeDtypeStruct((R, D), x.dtype), part] + ([part] if centered else [])
    name = "layer_norm_bwd" if centered else "rms_norm_bwd"
    kernel = functools.partial(_norm_bwd_kernel, t=t, offset=float(offset), centered=centered, n_iter=n_iter, G=G)
    inputs = (x, w, dy) + ((mean,) if centered else ()) + (rstd,)
    outs = C.call(
        kernel, name=name, grid=(n_chunks, G), out_shape=out_shape, interpret=interpret,
        num_warps=t.num_warps, num_stages=cfg.num_stages, flops=(8 + 4 * n_chunks) * R * D,
        # inputs, dx, and with chunks each chunk's x and dy read n_chunks more times (L2).
        bytes_accessed=C.nbytes(*inputs) + C.nbytes(x) + C.nbytes(x, dy) * (n_chunks if n_chunks > 1 else 0)
        + 4 * G * D * len(out_shape[1:]),
    )(*inputs)
    dx, dw = outs[0], outs[1].sum(axis=0)
    db = outs[2].sum(axis=0) if centered else None
    return dx, dw, db
