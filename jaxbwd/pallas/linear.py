"""Column-sum kernel: the bias gradient of ``bias_add`` (dbias = sum over rows of dy).

Grid (column blocks, row splits): program (j, g) sums row blocks g, g + G, ... of column
block j in f32 registers and writes one row of an f32 [G, D] partial buffer; XLA adds
the G rows. Fixed order, no atomics: bitwise reproducible.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxbwd.pallas import _common as C
from jaxbwd.pallas import _tuning


def _column_sum_kernel(dy_ref, out_ref, *, t: C.RowTiling, n_iter: int, G: int):
    j, g = pl.program_id(0), pl.program_id(1)

    def body(it, acc):
        _, cols, mask = C.tile_index(g + it * G, j, t)
        rows = (g + it * G) * t.block_rows + jnp.arange(t.block_rows)
        return acc + jnp.sum(C.load_tile(dy_ref, rows, cols, mask), axis=0)

    acc = jax.lax.fori_loop(0, n_iter, body, jnp.zeros((t.block_cols,), jnp.float32))
    cols = j * t.block_cols + jnp.arange(t.block_cols)
    C.store(out_ref, (g, cols), acc, cols < t.n_cols)


def column_sum_f32(dy, *, interpret: bool = False):
    """Sum of ``dy`` [R, D] over its rows with f32 accumulation; returns [D] float32.

    Tiles (``_tuning`` ``bias_add_dbias``): narrow column blocks, tall row blocks, so each
    program streams a thin vertical strip; the row splits G per column block come from the
    compiled occupancy (``_tuning.split``: one wave at most)."""
    R, D = dy.shape
    cfg = _tuning.column_sum(dy.dtype)
    t = C.RowTiling(R, D, block_rows=min(cfg.block_m, C.next_pow2(R)), block_cols=min(cfg.block_n, C.next_pow2(D)),
                    num_warps=cfg.num_warps)
    n_col = t.num_col_blocks
    G = _tuning.split(n_col, t.num_row_blocks, cfg)
    n_iter = C.cdiv(t.num_row_blocks, G)
    part = C.call(
        functools.partial(_column_sum_kernel, t=t, n_iter=n_iter, G=G),
        name="bias_add_dbias", grid=(n_col, G),
        out_shape=jax.ShapeDtypeStruct((G, D), jnp.float32), interpret=interpret,
        num_warps=t.num_warps, num_stages=cfg.num_stages, flops=R * D, bytes_accessed=C.nbytes(dy) + 4 * G * D,
    )(dy)
    return part.sum(axis=0)
