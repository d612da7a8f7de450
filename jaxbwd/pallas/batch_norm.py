"""Backward kernels of batch_norm (statistics over every row of x viewed as [R, C]).

dx needs two per-channel sums over all R rows (and, data-parallel, over every device)
before any element of it can be written, so the backward is two passes, as in cuDNN's
and apex's batch-norm backward:

1. ``batch_norm_bwd_reduce``: grid (column blocks, G row splits); program (j, g) walks
   row blocks g, g + G, ... of its columns, recomputes ``x_hat = (x - mean) * rstd`` from
   the saved f32 statistics and accumulates ``sum(dy)`` and ``sum(dy * x_hat)`` in f32
   registers, then writes one row of two f32 [G, C] partial buffers (XLA adds the G rows:
   fixed order, no atomics). These sums are dbias and dweight.
2. ``batch_norm_bwd_dx``: one elementwise pass over [R, C] tiles,
   ``dx = weight * rstd * (dy - sum(dy)/N - x_hat * sum(dy x_hat)/N)``.

Traffic: x and dy read twice, dx written once; the second read comes from DRAM for large
activations (x does not fit in L2), except for what the first pass read last: pass 2 starts
from the last row blocks, which pass 1 ended on (an estimate, not measured). Source: Ioffe &
Szegedy, "Batch Normalization" (2015), section 3 (the backward of the normalisation).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxbwd.pallas import _common as C
from jaxbwd.pallas import _tuning
from jaxbwd.pallas import elementwise as E


def _reduce_kernel(x_ref, dy_ref, mean_ref, rstd_ref, sdy_ref, sdyx_ref, *, t: C.RowTiling, n_iter: int, G: int):
    j, g = pl.program_id(0), pl.program_id(1)
    cols = j * t.block_cols + jnp.arange(t.block_cols, dtype=jnp.int32)
    cmask = cols < t.n_cols
    mean = C.load(mean_ref, cols, cmask)[None, :]
    rstd = C.load(rstd_ref, cols, cmask)[None, :]

    def body(it, acc):
        rows, _, mask = C.tile_index(g + it * G, j, t)
        x = C.load_tile(x_ref, rows, cols, mask)
        dy = C.load_tile(dy_ref, rows, cols, mask)
        xhat = jnp.where(mask, (x - mean) * rstd, 0.0)
        return acc[0] + jnp.sum(dy, axis=0), acc[1] + jnp.sum(dy * xhat, axis=0)

    zero = jnp.zeros((t.block_cols,), jnp.float32)
    sdy, sdyx = jax.lax.fori_loop(0, n_iter, body, (zero, zero))
    C.store(sdy_ref, (g, cols), sdy, cmask)
    C.store(sdyx_ref, (g, cols), sdyx, cmask)


def reduce_sums(x, dy, mean, rstd, *, interpret: bool = False):
    """Per-channel ``sum(dy)`` and ``sum(dy * x_hat)`` over the rows, f32 [C] each.

    Args: x, dy [R, C] (same dtype); mean, rstd [C] float32.
    """
    R, Cc = x.shape
    C.check_index_range("batch_norm", rows=R, cols=Cc)
    # Narrow column blocks, tall row blocks: each program streams a thin vertical strip. The
    # row splits G fill one wave of the table's occupancy (``_tuning.split``; the table says
    # where a shape compiles to fewer blocks); the f32 partials stay small (G x C x 8 bytes).
    cfg = _tuning.column_sum(x.dtype, "batch_norm_bwd_reduce")
    t = C.RowTiling(R, Cc, block_rows=min(cfg.block_m, C.next_pow2(R)), block_cols=min(C.next_pow2(Cc), cfg.block_n),
                    num_warps=cfg.num_warps)
    G = _tuning.split(t.num_col_blocks, t.num_row_blocks, cfg)
    n_iter = C.cdiv(t.num_row_blocks, G)
    part = jax.ShapeDtypeStruct((G, Cc), jnp.float32)
    sdy, sdyx = C.call(
        functools.partial(_reduce_kernel, t=t, n_iter=n_iter, G=G),
        name="batch_norm_bwd_reduce", grid=(t.num_col_blocks, G), out_shape=[part, part],
        interpret=interpret, num_warps=t.num_warps, num_stages=cfg.num_stages, flops=5 * R * Cc,
        bytes_accessed=C.nbytes(x, dy) + 8 * Cc + 8 * G * Cc,
    )(x, dy, mean, rstd)
    return sdy.sum(axis=0), sdyx.sum(axis=0)


def _dx_kernel(x_ref, dy_ref, mean_ref, rstd_ref, wr_ref, c1_ref, c2_ref, dx_ref, *, t: C.RowTiling):
    # Last row block first: the reduce kernel's programs (one wave) end on the last row
    # blocks, the likeliest still in L2.
    rows, cols, mask = C.tile_index(t.num_row_blocks - 1 - pl.program_id(0), pl.program_id(1), t)
    cmask = cols < t.n_cols
    vec = lambda r: C.load(r, cols, cmask)[None, :]  # noqa: E731
    x = C.load_tile(x_ref, rows, cols, mask)
    dy = C.load_tile(dy_ref, rows, cols, mask)
    xhat = (x - vec(mean_ref)) * vec(rstd_ref)
    dx = vec(wr_ref) * dy - vec(c1_ref) - xhat * vec(c2_ref)
    C.store_tile(dx_ref, rows, cols, dx, mask)


def dx(x, dy, mean, rstd, w_rstd, c1, c2, *, interpret: bool = False):
    """``dx = w_rstd * dy - c1 - x_hat * c2`` over x, dy [R, C]; vectors [C] f32.
    Returns dx [R, C] in x's dtype."""
    R, Cc = x.shape
    t = E.tiling(R, Cc)
    return C.call(
        functools.partial(_dx_kernel, t=t), name="batch_norm_bwd_dx",
        grid=(t.num_row_blocks, t.num_col_blocks), out_shape=jax.ShapeDtypeStruct((R, Cc), x.dtype),
        interpret=interpret, num_warps=t.num_warps, flops=6 * R * Cc,
        bytes_accessed=2 * C.nbytes(x) + C.nbytes(dy) + 20 * Cc,
    )(x, dy, mean, rstd, w_rstd, c1, c2)
