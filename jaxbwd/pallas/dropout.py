"""Dropout's mask as a counter-based hash, and the backward kernels that regenerate it.

The mask of element (row, col) of x's [rows, cols] view (``C.as_2d``) is a pure function
of the key and the two indices::

    h = mix(mix(mix(row ^ k1) ^ k0) ^ col) + k1;  h = mix(h)
    keep = (h >> 8) < round((1 - rate) * 2**24)

with ``mix`` the "lowbias32" integer finaliser (xor-shift-multiply, two multiplies; C.
Wellons, hash-prospector, 2018) on uint32 and ``(k0, k1)`` the key's two uint32 words. The
same jnp code runs in XLA (the forward and the XLA backward) and inside the Pallas kernel,
so both implementations drop exactly the same elements, and the backward needs only the
key (8 bytes) instead of a mask of x's size. Rows and columns are separate counters, so
the mask is defined for arrays of any size (no flat index, no wrap at 2**32). It is a
hash for dropout, not a cryptographic generator: the keep probability is quantised to
2**-24 and masks differ from ``jax.random.bernoulli``'s for the same key.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxbwd.pallas import _common as C
from jaxbwd.pallas import elementwise as E
from jaxbwd.pallas import linear as L

_M1, _M2 = 0x7FEB352D, 0x846CA68B


def _mix(h):
    """lowbias32 on uint32: xor-shift, multiply, xor-shift, multiply, xor-shift."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(_M1)
    h = h ^ (h >> 15)
    h = h * jnp.uint32(_M2)
    return h ^ (h >> 16)


def keep_threshold(rate: float) -> int:
    """The 24-bit threshold below which an element is kept: round((1 - rate) * 2**24)."""
    return int(round((1.0 - rate) * (1 << 24)))


def keep_mask(k0, k1, rows, cols, threshold: int):
    """Boolean keep mask for int32 ``rows`` [R, 1] and ``cols`` [1, C] (broadcasting) and
    uint32 key words ``k0``, ``k1``."""
    r, c = rows.astype(jnp.uint32), cols.astype(jnp.uint32)
    h = _mix(_mix(_mix(r ^ k1) ^ k0) ^ c) + k1
    h = _mix(h)
    # 24 bits as int32: a signed compare, which every backend lowers the same way.
    return (h >> 8).astype(jnp.int32) < threshold


def _bwd_kernel(key_ref, dy_ref, dx_ref, *, t: C.RowTiling, threshold: int, scale: float):
    rows, cols, mask = C.tile_index(pl.program_id(0), pl.program_id(1), t)
    k0, k1 = key_ref[0], key_ref[1]
    keep = keep_mask(k0, k1, rows[:, None], cols[None, :], threshold)
    dy = C.load_tile(dy_ref, rows, cols, mask)
    C.store_tile(dx_ref, rows, cols, jnp.where(keep, dy * scale, 0.0), mask)


def dropout_bwd(key, dy, *, rate: float, interpret: bool = False):
    """dx of dropout: ``dy / (1 - rate)`` where the regenerated mask keeps, else 0.

    Args:
      key: uint32 [2], the key's words. dy: [...] floating, any shape.
      rate: static, in (0, 1).
    Returns:
      dx in dy's shape and dtype.
    """
    shape = dy.shape
    R, Cc = C.as_2d("dropout", shape)
    t = E.tiling(R, Cc)
    n = R * Cc
    dx = C.call(
        functools.partial(_bwd_kernel, t=t, threshold=keep_threshold(rate), scale=1.0 / (1.0 - rate)),
        name="dropout_bwd", grid=(t.num_row_blocks, t.num_col_blocks),
        out_shape=jax.ShapeDtypeStruct((R, Cc), dy.dtype), interpret=interpret, num_warps=t.num_warps,
        flops=16 * n, bytes_accessed=2 * C.nbytes(dy) + 8,
    )(key, dy.reshape(R, Cc))
    return dx.reshape(shape)


def bias_dropout_bwd(key, dy, *, rate: float, interpret: bool = False):
    """dx and dbias of ``residual + dropout(x + bias)`` from one read of dy.

    Args:
      key: uint32 [2], the key's words. dy: [R, D] floating (D the bias axis).
      rate: static, in (0, 1).
    Returns:
      ``(dx, dbias)``: dx [R, D] in dy's dtype (``dy / (1 - rate)`` where the mask of the
      [R, D] view keeps, else 0) and dbias [D] float32 (the column sums of dx, f32
      accumulation, fixed order: the column-sum kernel of ``pallas/linear.py``).
    """
    threshold, scale = keep_threshold(rate), 1.0 / (1.0 - rate)

    def transform(key_ref, rows, cols, tile):
        keep = keep_mask(key_ref[0], key_ref[1], rows[:, None], cols[None, :], threshold)
        return jnp.where(keep, tile * scale, 0.0)

    return L.column_sum_f32(dy, transform=transform, extra=(key,), name="bias_dropout_add_bwd",
                            flops_per_element=17, interpret=interpret)
