"""The instruments of ``jaxbwd.testing`` that find GPU-only bugs in interpret mode, shown
catching each bug on toy kernels launched through jaxbwd's launcher (``_common.call``)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from jaxbwd import testing
from jaxbwd.pallas import _common as C

ROWS, COLS, BLOCK = 10, 8, 4  # three row blocks, the last one partial
GRID = (-(-ROWS // BLOCK),)


def _launch(kernel, x, aliases=None):
    return C.call(kernel, name="toy", grid=GRID, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True,
                  input_output_aliases=aliases)(x)


def _rows():
    rows = pl.program_id(0) * BLOCK + jnp.arange(BLOCK, dtype=jnp.int32)
    return rows, jnp.arange(COLS, dtype=jnp.int32)


def _copy(x_ref, o_ref):  # each program its own rows, tails masked: nothing to report
    rows, cols = _rows()
    mask = (rows < ROWS)[:, None]
    C.store_tile(o_ref, rows, cols, 2.0 * C.load_tile(x_ref, rows, cols, mask), mask)


def _overlapping(x_ref, o_ref):  # each program also writes the next block's first row
    _copy(x_ref, o_ref)
    rows, cols = _rows()
    nxt = rows[0] + BLOCK
    C.store(o_ref, (nxt, cols), jnp.zeros((COLS,)), (nxt < ROWS) & (cols >= 0))


def _unwritten_tail(x_ref, o_ref):  # the partial block's rows are never written
    rows, cols = _rows()
    mask = (rows < ROWS - 2)[:, None]
    C.store_tile(o_ref, rows, cols, C.load_tile(x_ref, rows, cols, mask), mask)


def _reads_neighbour_in_place(x_ref, o_ref):  # in place: reads the next block, which that program rewrites
    rows, cols = _rows()
    mask = (rows < ROWS)[:, None]
    nxt = jnp.minimum(rows + BLOCK, ROWS - 1)
    C.store_tile(o_ref, rows, cols, C.load_tile(x_ref, rows, cols, mask) + C.load_tile(o_ref, nxt, cols, mask), mask)


def _unmasked_load(x_ref, o_ref):  # the partial block reads past the last row
    rows, cols = _rows()
    mask = (rows < ROWS)[:, None]
    C.store_tile(o_ref, rows, cols, C.load_tile(x_ref, rows, cols, None), mask)


def _unmasked_store(x_ref, o_ref):  # ... and writes past it
    rows, cols = _rows()
    mask = (rows < ROWS)[:, None]
    C.store_tile(o_ref, rows, cols, C.load_tile(x_ref, rows, cols, mask), None)


def _mask_off_by_one(x_ref, o_ref):  # a mask that lets one row too many through
    rows, cols = _rows()
    mask = (rows <= ROWS)[:, None]
    C.store_tile(o_ref, rows, cols, C.load_tile(x_ref, rows, cols, mask), (rows < ROWS)[:, None])


X = jnp.arange(ROWS * COLS, dtype=jnp.float32).reshape(ROWS, COLS) + 1.0


def _writes(kernel, aliases=None):
    with testing.record_program_writes() as reports:
        jax.block_until_ready(_launch(kernel, X, aliases))
    (r,) = reports
    assert (r.kernel, r.grid, r.size) == ("toy", GRID, ROWS * COLS)
    assert r.racy == any((r.multiply_written, r.unwritten, r.dependent))
    return r.multiply_written, r.unwritten, r.dependent


def test_program_writes_finds_each_race():
    assert _writes(_copy) == (0, 0, 0)
    assert _writes(_copy, {0: 0}) == (0, 0, 0)
    # rows 4 and 8, written by two programs each
    assert _writes(_overlapping) == (2 * COLS, 0, 0)
    assert _writes(_unwritten_tail) == (0, 2 * COLS, 0)
    # programs 0 and 1 read rows that programs 1 and 2 overwrite
    written, unwritten, dependent = _writes(_reads_neighbour_in_place, {0: 0})
    assert (written, unwritten) == (0, 0) and dependent > 0


def _out_of_bounds(kernel):
    kernels = set()
    with testing.record_out_of_bounds(kernels) as reports:
        out = jax.block_until_ready(_launch(kernel, X))
    assert kernels == {"toy"}
    return out, sorted((r.kind, r.program, r.lanes) for r in reports)


@pytest.mark.parametrize("kernel,want", [
    (_copy, []),
    (_unmasked_load, [("load", (2,), 2 * COLS)]),
    (_unmasked_store, [("store", (2,), 2 * COLS)]),
    (_mask_off_by_one, [("load", (2,), COLS)]),
], ids=lambda v: getattr(v, "__name__", ""))
def test_out_of_bounds_finds_unmasked_tails(kernel, want):
    out, found = _out_of_bounds(kernel)
    assert found == want
    if kernel is _copy:
        np.testing.assert_array_equal(out, 2.0 * X)
    # interpret mode itself gives no sign: the out-of-bounds lanes are clamped or dropped
    if kernel is _unmasked_store:
        np.testing.assert_array_equal(out, X)


def test_out_of_bounds_leaves_gpu_lowering_alone():
    # a launch lowered for a GPU inside the block is not instrumented (no host callback in a kernel)
    from jaxbwd import config

    with testing.record_out_of_bounds() as reports, config.use(interpret=False):
        text = C.lower_for_gpu(lambda x: C.call(_copy, name="toy", grid=GRID, interpret=False,
                                                out_shape=jax.ShapeDtypeStruct(X.shape, X.dtype))(x), X)
    assert "callback" not in text and reports == []


def _whole_row_past_the_end(x_ref, o_ref):  # a scalar row index loads the whole row: 8 elements
    _copy(x_ref, o_ref)
    C.load(x_ref, ROWS + 2, None)


def _negative_row(x_ref, o_ref):  # row -1: NumPy (interpret mode) wraps it to the last row
    rows, cols = _rows()
    mask = (rows < ROWS)[:, None]
    C.store_tile(o_ref, rows, cols, C.load_tile(x_ref, rows - 1, cols, mask), mask)


def _ellipsis(x_ref, o_ref):  # not checked, but runs
    _copy(x_ref, o_ref)
    C.load(x_ref, (..., 0), None)


@pytest.mark.parametrize("kernel,want", [
    (_whole_row_past_the_end, [("load", (0,), COLS), ("load", (1,), COLS), ("load", (2,), COLS)]),
    (_negative_row, [("load", (0,), COLS)]),
    (_ellipsis, []),
], ids=lambda v: getattr(v, "__name__", ""))
def test_out_of_bounds_counts_elements(kernel, want):
    assert _out_of_bounds(kernel)[1] == want
