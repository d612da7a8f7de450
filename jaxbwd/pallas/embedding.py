"""Deterministic scatter-add backward of ``embed``: segment sums over sorted token ids.

The caller sorts the flat ids (a stable XLA argsort, invalid and padding ids sent past the
end as the sentinel V) and finds each vocabulary row's segment ``[start[v], end[v])`` of
the sorted order. Program (v, j) of the grid (V, column blocks) then sums the ``dy`` rows
of its segment, ``block_tokens`` tokens at a time, in f32 registers, and writes row v of
dtable once (zeros for rows no token hit). Every table row is written by exactly one
program in a fixed order: no atomics, bitwise reproducible, and any number of duplicates
(all tokens hitting one row) is summed exactly as far as f32 allows.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxbwd.pallas import _common as C

BLOCK_TOKENS = 8
MAX_BLOCK_COLS = 1024


def _embed_bwd_kernel(order_ref, start_ref, end_ref, dy_ref, dt_ref, *, n_cols: int, block_cols: int, block_tokens: int):
    v, j = pl.program_id(0), pl.program_id(1)
    cols = j * block_cols + jnp.arange(block_cols)
    cmask = cols < n_cols
    one = jnp.arange(1)
    start = jnp.sum(C.load(start_ref, v + one, one >= 0, other=0, dtype=jnp.int32))
    end = jnp.sum(C.load(end_ref, v + one, one >= 0, other=0, dtype=jnp.int32))
    n_chunks = (end - start + (block_tokens - 1)) // block_tokens

    def body(c, acc):
        idx = start + c * block_tokens + jnp.arange(block_tokens)
        tmask = idx < end
        tok = C.load(order_ref, idx, tmask, other=0, dtype=jnp.int32)
        tile = C.load(dy_ref, (tok[:, None], cols[None, :]), tmask[:, None] & cmask[None, :])
        return acc + jnp.sum(tile, axis=0)

    acc = jax.lax.fori_loop(0, n_chunks, body, jnp.zeros((block_cols,), jnp.float32))
    C.store(dt_ref, (v, cols), acc, cmask)


def embed_bwd(order, start, end, dy, *, num_rows: int, dtype, interpret: bool = False):
    """dtable [V, D] in ``dtype`` (f32 accumulation) from sorted segments of ``dy`` [N, D].

    Args:
      order: [N] int32, token indices sorted by id (stable); tokens to drop sit past every
        segment. start, end: [V] int32, row v's segment ``order[start[v]:end[v]]``.
      dy: [N, D] cotangent rows. num_rows: V.
    """
    N, D = dy.shape
    V = int(num_rows)
    block_cols = min(C.next_pow2(D), MAX_BLOCK_COLS)
    grid = (V, C.cdiv(D, block_cols))
    kernel = functools.partial(_embed_bwd_kernel, n_cols=D, block_cols=block_cols, block_tokens=BLOCK_TOKENS)
    return C.call(
        kernel, name="embed_bwd", grid=grid,
        out_shape=jax.ShapeDtypeStruct((V, D), dtype), interpret=interpret,
        num_warps=max(1, min(8, BLOCK_TOKENS * block_cols // 1024)), flops=N * D,
        bytes_accessed=C.nbytes(dy, order, start, end) + V * D * jnp.dtype(dtype).itemsize,
    )(order, start, end, dy)
