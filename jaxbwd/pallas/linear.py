"""Column-sum kernel: the bias gradient of ``bias_add`` (dbias = sum over rows of dy), and of
fused elementwise-then-bias backwards (``bias_dropout_add``).

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


def _column_sum_kernel(*refs, t: C.RowTiling, n_iter: int, G: int, transform):
    # refs: (*extra, dy, out) or, with a transform, (*extra, dy, dx, out).
    n_extra = len(refs) - (2 if transform is None else 3)
    extra, dy_ref, out_ref = refs[:n_extra], refs[n_extra], refs[-1]
    j, g = pl.program_id(0), pl.program_id(1)

    def body(it, acc):
        _, cols, mask = C.tile_index(g + it * G, j, t)
        rows = (g + it * G) * t.block_rows + jnp.arange(t.block_rows, dtype=jnp.int32)
        tile = C.load_tile(dy_ref, rows, cols, mask)
        if transform is not None:  # out-of-bounds lanes stay 0 in the sum, whatever transform(0) is
            tile = jnp.where(mask, transform(*extra, rows, cols, tile), 0.0)
            C.store_tile(refs[-2], rows, cols, tile, mask)
        return acc + jnp.sum(tile, axis=0)

    acc = jax.lax.fori_loop(0, n_iter, body, jnp.zeros((t.block_cols,), jnp.float32))
    cols = j * t.block_cols + jnp.arange(t.block_cols, dtype=jnp.int32)
    C.store(out_ref, (g, cols), acc, cols < t.n_cols)


def column_sum_f32(dy, *, transform=None, extra=(), name: str = "bias_add_dbias", flops_per_element: int = 1,
                   interpret: bool = False):
    """Sum of ``dy`` [R, D] over its rows with f32 accumulation; returns [D] float32.

    With ``transform(*extra_refs, rows, cols, tile) -> tile`` (f32 tile of dy, int32 row and
    column indices), the sum is of the transformed tiles, which are also written out in dy's
    dtype: returns ``(dx [R, D], sum [D] float32)`` from one read of dy (a fused elementwise
    backward and its bias gradient). ``extra``: small arrays passed to the kernel first.

    Tiles (``_tuning`` entry ``name``): narrow column blocks, tall row blocks, so each
    program streams a thin vertical strip; the row splits G per column block come from the
    compiled occupancy (``_tuning.split``: one wave at most)."""
    R, D = dy.shape
    C.check_index_range(name.removesuffix("_bwd").removesuffix("_dbias"), rows=R, cols=D)
    cfg = _tuning.column_sum(dy.dtype, name)
    t = C.RowTiling(R, D, block_rows=min(cfg.block_m, C.next_pow2(R)), block_cols=min(cfg.block_n, C.next_pow2(D)),
                    num_warps=cfg.num_warps)
    n_col = t.num_col_blocks
    G = _tuning.split(n_col, t.num_row_blocks, cfg)
    n_iter = C.cdiv(t.num_row_blocks, G)
    part_shape = jax.ShapeDtypeStruct((G, D), jnp.float32)
    out_shape = part_shape if transform is None else (jax.ShapeDtypeStruct((R, D), dy.dtype), part_shape)
    out = C.call(
        functools.partial(_column_sum_kernel, t=t, n_iter=n_iter, G=G, transform=transform),
        name=name, grid=(n_col, G), out_shape=out_shape, interpret=interpret,
        num_warps=t.num_warps, num_stages=cfg.num_stages, flops=flops_per_element * R * D,
        bytes_accessed=C.nbytes(dy) * (1 if transform is None else 2) + 4 * G * D + sum(C.nbytes(e) for e in extra),
    )(*extra, dy)
    if transform is None:
        return out.sum(axis=0)
    dx, part = out
    return dx, part.sum(axis=0)
