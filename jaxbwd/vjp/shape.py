"""reshape and row_slice: metadata and slicing ops with explicit XLA backward and tangent rules."""
from __future__ import annotations

import functools
import math

import jax
from jax import export
import jax.numpy as jnp
import numpy as np

from jaxbwd.vjp import _base as B
from jaxbwd.vjp._derivatives import custom_op


@functools.partial(custom_op, nondiff_argnums=(1,))
def _reshape(x, shape):
    return x.reshape(shape)


_reshape.defvjp(
    lambda x, shape: (x.reshape(shape), jnp.zeros(x.shape + (0,), x.dtype)),
    lambda shape, proto, dy: (dy.reshape(proto.shape[:-1]),),
)
_reshape.deftangent(lambda shape, _, dx: dx.reshape(shape))  # linear


def reshape(x, shape, *, implementation=None):
    """Reshape ``x`` to ``shape`` (one entry may be -1); the backward reshapes dy back.

    Args:
      x: [...] floating array. shape: tuple of ints (or ``jax.export`` symbolic dims) with
        the same element count.
      implementation: accepted for uniformity; both are metadata-only in XLA.

    Returns:
      x viewed as ``shape``, same dtype. Residuals: none (a zero-size shape carrier).

    Raises:
      TypeError: non-floating x; shape not a sequence of ints.
      ValueError: element counts differ, or more than one -1.
      Also the errors common to every op (``help(jaxbwd)``).

    Source: a reshape's adjoint is the inverse reshape.
    """
    op = "reshape"
    B.check_float(op, "x", x)
    dims = shape if isinstance(shape, (tuple, list)) else (shape,)
    # Symbolic dims (jax.export shape polymorphism) as jnp.reshape takes them.
    if not all(B.is_static_int(s) or export.is_symbolic_dim(s) for s in dims):
        raise TypeError(f"jaxbwd.reshape: shape must be a tuple of ints, got {shape!r}")
    shape = tuple(int(s) if B.is_static_int(s) else s for s in dims)
    n_neg = sum(s == -1 for s in shape)
    known = math.prod(s for s in shape if s != -1)
    if n_neg > 1 or any(s < -1 for s in shape):
        raise ValueError(f"jaxbwd.reshape: shape may hold at most one -1 and no other negative, got {shape}")
    if n_neg == 1:
        if known == 0 or x.size % known:
            raise ValueError(f"jaxbwd.reshape: cannot reshape {tuple(x.shape)} to {shape}")
        shape = tuple(x.size // known if s == -1 else s for s in shape)
    if math.prod(shape) != x.size:
        raise ValueError(
            f"jaxbwd.reshape: shape must hold {x.size} elements (x is {tuple(x.shape)}), got {shape}"
        )
    B.impl(implementation, op)
    return _reshape(x, shape)


@functools.partial(custom_op, nondiff_argnums=(2,))
def _row_slice(x, start, size):
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=0)


def _row_slice_fwd(x, start, size):
    return _row_slice.fun(x, start, size), (start, jnp.zeros(x.shape + (0,), x.dtype))


def _row_slice_bwd(size, res, dy):
    start, proto = res
    dx = jax.lax.dynamic_update_slice_in_dim(jnp.zeros(proto.shape[:-1], dy.dtype), dy, start, axis=0)
    return dx, None


_row_slice.defvjp(_row_slice_fwd, _row_slice_bwd)
_row_slice.deftangent(lambda size, res, dx, _: _row_slice.fun(dx, res[0], size))  # linear in x


def row_slice(x, start, size, *, implementation=None):
    """Rows ``[start, start + size)`` of ``x`` [R, C] -> [size, C]; ``start`` may be traced.

    A Python or NumPy int ``start`` is checked. A jax array ``start`` (traced or not)
    behaves as in ``lax.dynamic_slice``, the same eagerly and under ``jit``: a negative value
    counts from the end and the window is then clamped to ``[0, R - size]`` so it stays in
    bounds (in start's own dtype first: a 64-bit start does not wrap); the backward scatters
    dy into zeros at the same clamped rows.

    Args:
      x: [R, C] floating. start: Python int or int scalar array. size: static int, 0 <= size <= R.
      implementation: accepted for uniformity; the backward is XLA's dynamic_update_slice.

    Returns:
      [size, C] in x's dtype. Residuals: start (a scalar).

    Raises:
      TypeError: non-floating x, non-integer start, size not an int.
      ValueError: x not rank 2, size out of [0, R], a Python or NumPy int start out of [0, R - size],
        a symbolic R (``jax.export``).
      Also the errors common to every op (``help(jaxbwd)``).

    Source: a slice's adjoint is the zero-padded scatter of the cotangent.
    """
    op = "row_slice"
    B.check_float(op, "x", x)
    B.check_ndim(op, "x", x, ndim=2, what="([R, C])")
    B.require_static(op, "x's row count", x.shape[:1], "size and start are checked against it")
    size = B.static_int(op, "size", size)
    R = x.shape[0]
    if not 0 <= size <= R:
        raise ValueError(f"jaxbwd.row_slice: size must be in [0, {R}] (x has {R} rows), got {size}")
    if not (isinstance(start, (int, np.integer)) or hasattr(start, "dtype")) or isinstance(start, (bool, np.bool_)) \
            or not jnp.issubdtype(jnp.result_type(start), jnp.integer):
        raise TypeError(f"jaxbwd.row_slice: start must be a Python int or an integer scalar array, got {start!r}")
    if jnp.ndim(start) != 0:
        raise ValueError(f"jaxbwd.row_slice: start must be a scalar, got shape {tuple(jnp.shape(start))}")
    # A Python or NumPy int is checked; a jax array start clamps, so eager and jit calls agree.
    if B.is_static_int(start):
        if not 0 <= int(start) <= R - size:
            raise ValueError(f"jaxbwd.row_slice: start must be in [0, {R - size}] for size={size}, got {int(start)}")
    # Clipped to [-R, R - size] in start's own dtype before the narrowing to int32 (an int64
    # or uint32 start past int32 would wrap to some other row); then, as lax.dynamic_slice,
    # a negative start counts from the end and the window is clamped into bounds.
    start = jnp.asarray(start)
    info = jnp.iinfo(start.dtype)
    start = jnp.clip(start, max(-R, int(info.min)), min(R - size, int(info.max))).astype(jnp.int32)
    start = jnp.clip(jnp.where(start < 0, start + R, start), 0, R - size)
    B.impl(implementation, op)
    return _row_slice(x, start, size)
