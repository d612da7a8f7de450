"""Deterministic scatter-add backward of ``embed``: chunked segment sums over sorted token ids.

The caller sorts the flat ids (a stable XLA argsort, invalid and padding ids sent past the
end as the sentinel V) and cuts the sorted order into *items*: runs of at most ``CHUNK``
tokens with one id, each id's run starting a new item (:func:`plan`). Only ids that occur
get programs, and the table-sized gradient is zero-filled outside the kernels (XLA's
memset) and written in place (an input/output alias):

- ``embed_bwd`` (grid: sorted positions x column blocks; a position that starts no item
  stores nothing) sums its item's ``dy`` rows,
  ``BLOCK_TOKENS`` tokens per step, in f32 registers. An id with a single item (most ids)
  writes its table row directly; the items of a hot id (more than ``CHUNK`` tokens) write
  f32 partial rows instead, so that a hot id is summed by many programs at once.
- ``embed_bwd_hot`` (grid: ``CHUNK``-windows of the sorted order x column blocks; at most one
  hot run starts in a window) adds the run's partial rows in item order and writes its
  table row.

Every row is written by exactly one program and every sum runs in a fixed order: no
atomics, bitwise reproducible, and any number of duplicates is summed exactly as far as f32
allows. Programs without an item (or a hot run) run no loop iteration and store nothing.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxbwd.pallas import _common as C

BLOCK_TOKENS = 16
CHUNK = 64
MAX_BLOCK_COLS = 512


def plan(keys, num_rows: int):
    """The work lists of :func:`embed_bwd` from flat int32 keys ([N], id or the sentinel V).

    Everything is elementwise over the N sorted positions, plus a stable argsort and two
    binary searches (no prefix sums, whose XLA GPU compile is slow at these sizes). Position
    ``p`` of the sorted order starts an item if its id is valid and ``p`` is a multiple of
    ``CHUNK`` tokens into the id's run. A hot id (run longer than ``CHUNK``) has one item
    start in each ``CHUNK``-window it covers, and at most two hot item starts share a window
    (a run's first start after another run's start), so ``2 * (p // CHUNK) + (p starts its
    run)`` numbers the partial rows without collisions, and at most one hot run starts in
    each window.

    Returns int32 arrays: ``order`` [N] (token indices sorted by key, stable); per position
    ``end`` (the item's end in ``order``; ``p`` itself where no item starts), ``row`` (the id)
    and ``slot`` (the partial row, -1 for an id with a single item); per window
    (``cdiv(N, CHUNK)``) ``hot_start`` (the position of the hot run starting in it, -1 for
    none), ``hot_row`` and ``hot_count`` (its number of items).
    """
    N, V = keys.shape[0], int(num_rows)
    order = jnp.argsort(keys, stable=True).astype(jnp.int32)
    sk = keys[order]
    pos = jnp.arange(N, dtype=jnp.int32)
    seg_start = jnp.searchsorted(sk, sk, side="left").astype(jnp.int32)
    seg_end = jnp.searchsorted(sk, sk, side="right").astype(jnp.int32)
    first = (sk < V) & ((pos - seg_start) % CHUNK == 0)
    hot = first & (seg_end - seg_start > CHUNK)
    head = pos == seg_start
    W = C.cdiv(N, CHUNK)
    window = pos // CHUNK
    hot_start = jnp.full((W,), -1, jnp.int32).at[window].max(jnp.where(hot & head, pos, -1))
    hs = jnp.maximum(hot_start, 0)
    return dict(
        order=order,
        end=jnp.where(first, jnp.minimum(pos + CHUNK, seg_end), pos),
        row=sk,
        slot=jnp.where(hot, 2 * window + head.astype(jnp.int32), -1),
        hot_start=hot_start,
        hot_row=sk[hs],
        hot_count=jnp.where(hot_start >= 0, (seg_end[hs] - hs + CHUNK - 1) // CHUNK, 0).astype(jnp.int32),
    )


def _scalar(ref, i):
    one = jnp.arange(1, dtype=jnp.int32)
    return jnp.sum(C.load(ref, i + one, one >= 0, other=0, dtype=jnp.int32), dtype=jnp.int32)


def _items_kernel(order_ref, end_ref, row_ref, slot_ref, dy_ref, _dt_in, _part_in, dt_ref, part_ref, *, n_cols: int,
                  block_cols: int):
    i, j = pl.program_id(0), pl.program_id(1)
    cols = j * block_cols + jnp.arange(block_cols, dtype=jnp.int32)
    cmask = cols < n_cols
    start, end = i, _scalar(end_ref, i)
    row, slot = _scalar(row_ref, i), _scalar(slot_ref, i)

    def body(c, acc):
        idx = start + c * BLOCK_TOKENS + jnp.arange(BLOCK_TOKENS, dtype=jnp.int32)
        tmask = idx < end
        tok = C.load(order_ref, idx, tmask, other=0, dtype=jnp.int32)
        return acc + jnp.sum(C.load(dy_ref, (tok[:, None], cols[None, :]), tmask[:, None] & cmask[None, :]), axis=0)

    n_steps = (end - start + (BLOCK_TOKENS - 1)) // BLOCK_TOKENS
    acc = jax.lax.fori_loop(0, n_steps, body, jnp.zeros((block_cols,), jnp.float32))
    live = end > start
    C.store(dt_ref, (row, cols), acc, cmask & live & (slot < 0))
    C.store(part_ref, (jnp.maximum(slot, 0), cols), acc, cmask & live & (slot >= 0))


def _hot_kernel(start_ref, row_ref, count_ref, part_ref, _, dt_ref, *, n_cols: int, block_cols: int):
    h, j = pl.program_id(0), pl.program_id(1)
    cols = j * block_cols + jnp.arange(block_cols, dtype=jnp.int32)
    cmask = cols < n_cols
    start, row, count = _scalar(start_ref, h), _scalar(row_ref, h), _scalar(count_ref, h)

    window = C.idiv(jnp.maximum(start, 0), CHUNK)

    def body(c, acc):
        # Item c of the run starts in window ``window + c``; only the first starts the run (+1).
        slot = 2 * (window + c) + jnp.maximum(1 - c, 0)
        return acc + C.load(part_ref, (slot, cols), cmask)

    acc = jax.lax.fori_loop(0, count, body, jnp.zeros((block_cols,), jnp.float32))
    C.store(dt_ref, (row, cols), acc, cmask & (count > 0))


def embed_bwd(work, dy, *, num_rows: int, dtype, interpret: bool = False):
    """dtable [V, D] in ``dtype`` (f32 accumulation) from ``dy`` [N, D] and :func:`plan`'s ``work``.

    Rows no token hit are zero (zero-filled by XLA, then written in place by the kernels).
    """
    N, D = dy.shape
    V = int(num_rows)
    C.check_index_range("embed", tokens=N, num_embeddings=V, features=D)
    W = C.cdiv(N, CHUNK)
    block_cols = min(C.next_pow2(D), MAX_BLOCK_COLS)
    n_col_blocks = C.cdiv(D, block_cols)
    warps = max(1, min(8, BLOCK_TOKENS * block_cols // 1024))
    itemsize = jnp.dtype(dtype).itemsize
    zeros = jnp.zeros((V, D), dtype)
    # Partial rows of hot ids; the slots no hot item uses are never read, but are zeroed (a
    # 2 * N / CHUNK * D * 4-byte memset) so that no output holds uninitialised memory, which
    # jax.debug_nans would flag (and interpret mode fills with NaN).
    part0 = jnp.zeros((2 * W, D), jnp.float32)
    items = [work[k] for k in ("order", "end", "row", "slot")]
    dt, part = C.call(
        functools.partial(_items_kernel, n_cols=D, block_cols=block_cols), name="embed_bwd",
        grid=(N, n_col_blocks), out_shape=(jax.ShapeDtypeStruct((V, D), dtype),
                                           jax.ShapeDtypeStruct((2 * W, D), jnp.float32)),
        interpret=interpret, num_warps=warps, flops=N * D,
        bytes_accessed=C.nbytes(dy, *items) + min(N, V) * D * itemsize, input_output_aliases={5: 0, 6: 1},
    )(*items, dy, zeros, part0)
    hot = [work[k] for k in ("hot_start", "hot_row", "hot_count")]
    return C.call(
        functools.partial(_hot_kernel, n_cols=D, block_cols=block_cols), name="embed_bwd_hot",
        grid=(W, n_col_blocks), out_shape=jax.ShapeDtypeStruct((V, D), dtype), interpret=interpret,
        num_warps=max(1, min(8, block_cols // 256)), flops=N * D // CHUNK,
        bytes_accessed=C.nbytes(*hot) + 2 * W * D * 4 + min(V, W) * D * itemsize,
        input_output_aliases={4: 0},
    )(*hot, part, dt)
