"""The elementwise backward kernel that every elementwise op's Pallas path is generated from.

``map_tiles(name, fn, inputs, out_dtypes)`` runs ``fn`` (a jnp function of f32 tiles) over
same-shaped inputs in one fused pass: each input is read once, each output written once.
The arrays are viewed as [rows, cols] (``C.as_2d``, a free reshape) and cut into 2-D
power-of-two tiles with masked tails, so that no per-dimension index passes int32 on arrays
of 2**31 elements and more (``C.check_index_range``). Activations (silu, gelu, relu, ...)
build their ``*_bwd`` kernels from it through ``jaxbwd.vjp.elementwise``, swiglu with two
inputs and two outputs.

Why a kernel (or not) for an elementwise backward: XLA fuses ``dy * f'(x)`` into one loop
that reads x and dy and writes dx, the minimum traffic. A Pallas kernel moves the same
bytes; what it adds is that the derivative is the library's own formula (stable at
saturation) and runs where XLA's fusion would have been split by the custom derivative.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxbwd.pallas import _common as C

# Elementwise kernels are bandwidth-bound: 2048 elements over 4 warps is 16 per thread,
# two 16-byte vector loads per bf16 operand, and about 8K programs at [8192, 4096].
ELEMENTWISE_BLOCK = 2048
ELEMENTWISE_WARPS = 4
# At most 1024 columns per tile, so that common widths (4096, 5120, 14336) are a whole
# number of column blocks and the masked tail is small for the rest.
MAX_BLOCK_COLS = 1024


def tiling(R: int, Cc: int) -> C.RowTiling:
    """[block_rows, block_cols] tiles of ELEMENTWISE_BLOCK elements, at most MAX_BLOCK_COLS wide."""
    block_cols = min(C.next_pow2(Cc), MAX_BLOCK_COLS)
    block_rows = max(1, min(C.next_pow2(R), ELEMENTWISE_BLOCK // block_cols))
    warps = min(ELEMENTWISE_WARPS, max(1, block_rows * block_cols // 256))
    return C.RowTiling(R, Cc, block_rows=block_rows, block_cols=block_cols, num_warps=warps)


def _kernel(*refs, fn: Callable, n_in: int, t: C.RowTiling):
    in_refs, out_refs = refs[:n_in], refs[n_in:]
    rows, cols, mask = C.tile_index(pl.program_id(0), pl.program_id(1), t)
    outs = fn(*(C.load_tile(r, rows, cols, mask) for r in in_refs))
    for r, v in zip(out_refs, outs):
        C.store_tile(r, rows, cols, v, mask)


def map_tiles(name: str, fn: Callable, inputs: Sequence[jax.Array], out_dtypes: Sequence, *,
              flops: int, transcendentals: int, interpret: bool) -> tuple[jax.Array, ...]:
    """One fused pass: ``fn(*inputs)`` elementwise, as a Pallas kernel called ``name``.

    Args:
      name: the ``pallas_call`` name (``<op>_bwd``); errors name ``<op>``.
      fn: ``fn(*tiles) -> tuple of tiles``, on float32 [block_rows, block_cols] tiles (inputs
        of any float dtype are loaded as float32); outputs are cast to ``out_dtypes``.
      inputs: arrays of one shape (any rank, scalars included).
      out_dtypes: one dtype per output; each output has the inputs' shape.
      flops, transcendentals: per element, for the cost estimate.
      interpret: run through Pallas's interpreter (CPU).

    Returns:
      The outputs, a tuple. Empty inputs skip the launch.

    Raises:
      ValueError: a dimension of the [rows, cols] view exceeds int32 (``C.as_2d``).
    """
    shape = inputs[0].shape
    n = math.prod(shape)
    if n == 0:
        return tuple(jnp.zeros(shape, d) for d in out_dtypes)
    R, Cc = C.as_2d(name.removesuffix("_bwd"), shape)
    views = [a.reshape(R, Cc) for a in inputs]
    t = tiling(R, Cc)
    out_shape = [jax.ShapeDtypeStruct((R, Cc), d) for d in out_dtypes]
    # Row blocks on grid axis 0: it is the only axis that may exceed 65535 programs.
    outs = C.call(
        functools.partial(_kernel, fn=fn, n_in=len(views), t=t),
        name=name, grid=(t.num_row_blocks, t.num_col_blocks), out_shape=out_shape, interpret=interpret,
        num_warps=t.num_warps, flops=flops * n, transcendentals=transcendentals * n,
        bytes_accessed=C.nbytes(*views) + sum(n * jnp.dtype(d).itemsize for d in out_dtypes),
    )(*views)
    return tuple(o.reshape(shape) for o in outs)
