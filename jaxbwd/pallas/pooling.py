"""Backward kernel of max_pool2d in gather form: each dx element is written once, no atomics.

The forward saves, per output element, the row-major offset ``k = di * kw + dj`` of the
window element it selected (the first maximum; int8 for windows up to 127 elements). Input
position ``q`` (padded coordinates) lies in the windows ``o`` with ``o * s <= q < o * s + k``
in each dimension: at most ``ceil(kh / sh) * ceil(kw / sw)`` of them, a static count. One
program handles one input row ``(n, h)`` and a block of its ``W * C`` columns; for each
candidate window it gathers ``sel`` and ``dy`` and adds ``dy`` where ``sel`` names this
position, in a fixed order, in f32. x is not read at all: the backward reads dy and the
offsets (1 byte each) and writes dx.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxbwd.pallas import _common as C

# Columns of the [N * H, W * C] view per program.
MAX_BLOCK_COLS = 1024


def _kernel(sel_ref, dy_ref, dx_ref, *, H, W, Cc, Ho, Wo, window, strides, pad_lo, block_cols):
    r = pl.program_id(0)
    n, h = C.idiv(r, H), C.imod(r, H)
    cols = pl.program_id(1) * block_cols + jnp.arange(block_cols, dtype=jnp.int32)
    cmask = cols < W * Cc
    w, c = C.idiv(cols, Cc), C.imod(cols, Cc)
    qh, qw = h + pad_lo[0], w + pad_lo[1]
    acc = jnp.zeros((block_cols,), jnp.float32)
    for a in range(-(-window[0] // strides[0])):
        oi = C.idiv(qh, strides[0]) - a
        di = qh - oi * strides[0]
        row_ok = (oi >= 0) & (oi < Ho) & (di < window[0])
        row = n * Ho + jnp.clip(oi, 0, Ho - 1)
        for b in range(-(-window[1] // strides[1])):
            oj = C.idiv(qw, strides[1]) - b
            dj = qw - oj * strides[1]
            m = cmask & row_ok & (oj >= 0) & (oj < Wo) & (dj < window[1])
            ocol = jnp.clip(oj, 0, Wo - 1) * Cc + c
            sel = C.load(sel_ref, (row, ocol), m, other=-1, dtype=jnp.int32)
            g = C.load(dy_ref, (row, ocol), m)
            acc = acc + jnp.where(m & (sel == di * window[1] + dj), g, 0.0)
    C.store(dx_ref, (r, cols), acc, cmask)


def max_pool2d_bwd(sel, dy, *, in_hw, window, strides, pad_lo, interpret: bool = False):
    """dx [N, H, W, C] of max pooling from the selected offsets ``sel`` and ``dy`` [N, Ho, Wo, C]."""
    N, Ho, Wo, Cc = dy.shape
    H, W = in_hw
    C.check_index_range("max_pool2d", rows=N * max(H, Ho), cols=W * Cc)
    block_cols = min(C.next_pow2(W * Cc), MAX_BLOCK_COLS)
    n_cand = math.ceil(window[0] / strides[0]) * math.ceil(window[1] / strides[1])
    dx = C.call(
        functools.partial(_kernel, H=H, W=W, Cc=Cc, Ho=Ho, Wo=Wo, window=window, strides=strides,
                          pad_lo=pad_lo, block_cols=block_cols),
        name="max_pool2d_bwd", grid=(N * H, C.cdiv(W * Cc, block_cols)),
        out_shape=jax.ShapeDtypeStruct((N * H, W * Cc), dy.dtype), interpret=interpret,
        num_warps=max(1, min(4, block_cols // 256)), flops=3 * n_cand * N * H * W * Cc,
        bytes_accessed=C.nbytes(sel, dy) + N * H * W * Cc * jnp.dtype(dy.dtype).itemsize,
    )(sel.reshape(N * Ho, Wo * Cc), dy.reshape(N * Ho, Wo * Cc))
    return dx.reshape(N, H, W, Cc)
