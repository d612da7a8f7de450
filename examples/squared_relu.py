"""Writing your own op: a squared ReLU with a Pallas backward, its registry entry and its tests.

``squared_relu(x) = max(x, 0)**2`` (So et al., "Primer: Searching for Efficient Transformers
for Language Modeling", 2021). Its derivative is ``2 * max(x, 0)``, so the backward is one
elementwise pass ``dx = 2 * max(x, 0) * dy`` that needs only x: the forward saves x (an
alias of the caller's array), not the ``max(x, 0)`` that autodiff of ``relu(x)**2`` keeps.

The three steps every user op takes:

1. ``jaxbwd.define_op``: the forward, the XLA backward formula, and the Pallas backward (a
   plain ``pl.pallas_call`` over 2-D blocks, written here the way any Pallas kernel is);
2. ``squared_relu.spec(...)`` (``SPEC`` below): the registry entry (reference, example inputs, realistic
   shapes for the GPU lowering check, bad inputs, residual budget);
3. ``jaxbwd.testing.OpContract``: subclass it with ``spec = SPEC`` in a test file and pytest
   runs jaxbwd's contract on the op (see ``tests/test_define.py``).

The command line takes the spec by import path::

    python -m jaxbwd check --ops examples.squared_relu:SPEC
    python -m jaxbwd bench --ops examples.squared_relu:SPEC
    python -m jaxbwd compile --ops examples.squared_relu:SPEC --gpu h200

Run this file to check the op against autodiff of the reference on this machine
(the Pallas kernel in interpret mode when there is no GPU); it exits 1 if a row fails.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

import jaxbwd
from jaxbwd.registry import BadInput, Example

BLOCK_ROWS, BLOCK_COLS = 8, 256  # powers of two (Triton); 2048 elements a program


def _f32(x):
    """float32 for 16/32-bit inputs; float64 stays float64 (the contract's numerical check)."""
    return x.astype(jnp.float64 if x.dtype == jnp.float64 else jnp.float32)


def _forward(x):
    xf = _f32(x)
    return jnp.square(jnp.maximum(xf, 0.0)).astype(x.dtype)


def _backward(res, dy):
    (x,) = res
    return ((2.0 * jnp.maximum(_f32(x), 0.0) * _f32(dy)).astype(x.dtype),)


def _bwd_kernel(x_ref, dy_ref, dx_ref):
    # One [BLOCK_ROWS, BLOCK_COLS] block; Pallas masks the blocks that overhang the array.
    x = _f32(x_ref[...])
    dy = _f32(dy_ref[...])
    dx_ref[...] = (2.0 * jnp.maximum(x, 0.0) * dy).astype(dx_ref.dtype)


def _pallas_backward(res, dy, *, interpret):
    (x,) = res
    shape = x.shape
    cols = shape[-1] if x.ndim else 1
    x2, dy2 = x.reshape(-1, cols), dy.reshape(-1, cols)  # free: 2-D blocks, no flat index
    rows = x2.shape[0]
    block = pl.BlockSpec((BLOCK_ROWS, BLOCK_COLS), lambda i, j: (i, j))
    dx = pl.pallas_call(
        _bwd_kernel, name="squared_relu_bwd",
        grid=(pl.cdiv(rows, BLOCK_ROWS), pl.cdiv(cols, BLOCK_COLS)),
        in_specs=[block, block], out_specs=block,
        out_shape=jax.ShapeDtypeStruct(x2.shape, x.dtype), interpret=interpret,
        # Triton's parameters select the Triton backend, as jaxbwd's kernels do; without
        # them jax 0.10 lowers a GPU pallas_call through Mosaic GPU instead.
        compiler_params=pltriton.CompilerParams(num_warps=4),
    )(x2, dy2)
    return (dx.reshape(shape),)


def _check(x):
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"jaxbwd.squared_relu: x must have a floating dtype, got {x.dtype}")


squared_relu = jaxbwd.define_op(
    "squared_relu", forward=_forward, backward=_backward,
    pallas_backward=_pallas_backward, kernels=("squared_relu_bwd",),
    check=_check, sharding="...->...",
)
squared_relu.__doc__ = """Squared ReLU ``max(x, 0)**2``, elementwise (Primer, So et al. 2021).

Args:
  x: [...] float32, bfloat16 or float16 (float64 under ``jax_enable_x64``).
  implementation: ``None`` (Pallas on GPU, XLA elsewhere), ``"pallas"`` or ``"xla"``.

Returns:
  [...] in x's dtype, computed in float32 (float64 for float64 x, on both paths).

Residuals: x. Backward: ``dx = 2 max(x, 0) dy``, the Pallas kernel ``squared_relu_bwd``
or the same formula in XLA.

Raises:
  TypeError: x not a floating array.
"""


def reference(x):
    """The plain-jnp truth the contract differentiates with autodiff."""
    return (jax.nn.relu(_f32(x)) ** 2).astype(x.dtype)


def _normal(key, shape, dtype):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


SPEC = squared_relu.spec(
    reference=reference,
    backward="Pallas: dx = 2 max(x, 0) dy over 2-D blocks; saves x only",
    examples=[Example("x".join(map(str, s)), functools.partial(lambda k, dt, s: ((_normal(k, s, dt),), {}), s=s))
              for s in ((5, 123), (2, 3, 96), (1, 1, 1023))],
    # Realistic shapes, and an odd one whose edge blocks overhang (Pallas masks them).
    lowering=[Example(f"{r}x{c}-bf16", lambda k, d, r=r, c=c: ((jax.ShapeDtypeStruct((r, c), jnp.bfloat16),), {}))
              for r, c in ((8192, 4096), (4097, 1000))],
    bad_inputs=[BadInput("integer x", lambda: ((jnp.ones((4,), jnp.int32),), {}), TypeError,
                         r"x must have a floating dtype, got int32")],
    residual_budget=lambda x: x.size * x.dtype.itemsize,  # x only
)


if __name__ == "__main__":
    import argparse

    from jaxbwd import check

    argparse.ArgumentParser(description="Checks squared_relu's backward (XLA and Pallas; the kernel in "
                            "interpret mode without a GPU) against autodiff of its reference.").parse_args()
    with jaxbwd.config.use(interpret=jax.default_backend() != "gpu"):
        rows = [row for impl in ("xla", "pallas") for row in check.check_op(SPEC, impl, tol=1e-4)]
    for row in rows:
        print(f"{row.op} {row.implementation} {row.arg}: max abs err {row.max_abs:.2e}, scaled err "
              f"{row.max_rel:.2e} {'ok' if row.ok else 'FAIL'}{': ' + row.note if row.note else ''}")
    print("scaled err = max|jaxbwd - autodiff| / max|autodiff|, autodiff of the reference; ok below 1e-4")
    raise SystemExit(0 if all(row.ok for row in rows) else 1)
