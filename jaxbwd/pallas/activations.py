"""Backward kernels of the activations, and the derivative math they share.

The derivative functions at the top are the single statement of each activation's
gradient; the kernels below and the XLA backward rules in ``jaxbwd/vjp/activations.py``
both call them, so the two implementations cannot drift apart. They take and return
float32 (float64 on the XLA path) and stay finite for inputs far past where activations
saturate (x = +-1e4 and beyond): the sigmoids are built from ``exp(-|z|)``, which cannot
overflow, and every factor that multiplies a large ``x`` (``1 - s``, ``s (1 - s)``,
``exp(-x**2 / 2)``) is exactly 0 by then.

Kernels:

- ``silu_bwd``, ``gelu_bwd``, ``relu_bwd``, ``leaky_relu_bwd``, ``sigmoid_bwd``,
  ``tanh_bwd``: generated from the derivative functions here by the elementwise factory
  (``jaxbwd/vjp/elementwise.py``, kernel in ``jaxbwd/pallas/elementwise.py``): one fused
  pass over [rows, cols] 2-D tiles that reads the residual and dy once and writes dx once.
- ``swiglu_bwd``: the same pass with two inputs and two outputs.
- ``glu_bwd``: the same over [rows, d] tiles of the fused ``[..., 2d]`` input; a program
  reads the gate and up halves of its rows and dy, and writes both halves of dx.
- ``softmax_bwd``: row-wise ``dx = y * (dy - delta)``, ``delta = sum(dy * y)`` over the
  last axis, through ``C.row_reduce_then_write``.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxbwd.pallas import _common as C
from jaxbwd.pallas import elementwise as E

ACTIVATIONS = ("silu", "gelu", "gelu_exact")

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_CUBIC = 0.044715
_INV_SQRT_2 = math.sqrt(0.5)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)

# Approximate flops and transcendentals per element of each backward, for cost estimates.
BWD_COST = {"silu": (8, 1), "gelu": (16, 1), "gelu_exact": (30, 2), "relu": (2, 0), "leaky_relu": (2, 0),
         "sigmoid": (3, 0), "tanh": (3, 0)}
_GATED_EXTRA_FLOPS = 6  # the product rule and the clamp masks


# ------------------------------------------------------------------ derivative math
def _sigmoid_pair(z):
    """``sigmoid(z)`` and ``1 - sigmoid(z)``, both to full relative precision, from one exp.

    ``1 - sigmoid(z)`` formed by subtraction loses every digit once sigmoid(z) rounds to
    1 (z > 17 in f32), and GELU's gradient multiplies exactly that difference by a large
    x. ``exp(-|z|)`` never overflows, so both values stay finite and exact at saturation.
    """
    e = jnp.exp(-jnp.abs(z))
    big = 1.0 / (1.0 + e)  # sigmoid(|z|), in [0.5, 1]
    small = e * big  # sigmoid(-|z|) = 1 - sigmoid(|z|)
    pos = z >= 0
    return jnp.where(pos, big, small), jnp.where(pos, small, big)


def silu_and_grad(x):
    """``silu(x) = x * s`` and ``silu'(x) = s * (1 + x * (1 - s))``, ``s = sigmoid(x)``."""
    s, one_minus_s = _sigmoid_pair(x)
    return x * s, s * (1.0 + x * one_minus_s)


def gelu_and_grad(x, *, approximate: bool, erfc: Callable = C.erfc):
    """GELU and its derivative.

    Tanh form (``approximate``): ``(1 + tanh(u)) / 2 = sigmoid(2u)``, so with
    ``u = c * (x + k x**3)`` and ``s = sigmoid(2u)``: ``gelu = x * s`` and
    ``gelu' = s + 2 x s (1 - s) * c * (1 + 3k x**2)``. The sigmoid form avoids the
    cancellation in ``1 + tanh(u)`` for u << 0 (jax.nn.gelu's own gradient loses about
    1e-6 absolute there); ``x * s(1 - s)`` is formed first so it is exactly 0, not 0 * inf,
    for large ``|x|``.

    Exact form: ``gelu = x * Phi(x)``, ``gelu' = Phi(x) + x * phi(x)``, with
    ``Phi(x) = erfc(-x / sqrt(2)) / 2`` (as ``jax.nn.gelu``): ``(1 + erf) / 2`` would cancel to
    0 for x << 0, losing ``Phi``'s share of ``gelu'`` (3% at x = -6). ``erfc`` is a parameter
    because Triton has no erfc that Pallas lowers: kernels use ``C.erfc``, the XLA rule passes
    ``jax.lax.erfc``.
    """
    if approximate:
        u = _SQRT_2_OVER_PI * (x + _GELU_CUBIC * (x * x * x))
        s, one_minus_s = _sigmoid_pair(2.0 * u)
        du = _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_CUBIC * (x * x))
        return x * s, s + 2.0 * (x * (s * one_minus_s)) * du
    cdf = 0.5 * erfc(-x * _INV_SQRT_2)
    return x * cdf, cdf + x * (_INV_SQRT_2PI * C.exp(-0.5 * (x * x)))


def relu_grad(y):
    """``relu'`` from the output ``y = max(x, 0)``: 1 where y > 0, else 0 (0 at x = 0, as
    ``jax.nn.relu``)."""
    return jnp.where(y > 0, 1.0, 0.0).astype(y.dtype)


def leaky_relu_grad(x, *, negative_slope: float):
    """``leaky_relu'``: 1 where x >= 0 (``jax.nn.leaky_relu`` takes the identity branch
    at 0), else ``negative_slope``. ``x`` is the input or the saved branch (+1/-1, the op's
    residual), which ``x >= 0`` reads alike."""
    return jnp.where(x >= 0, 1.0, negative_slope).astype(x.dtype)


def sigmoid_grad(y):
    """``sigmoid' = y (1 - y)`` from the output ``y = sigmoid(x)``."""
    return y * (1.0 - y)


def tanh_grad(y):
    """``tanh' = 1 - y**2`` from the output ``y = tanh(x)``."""
    return 1.0 - y * y


def activation_and_grad(activation: str, x, *, erfc: Callable = C.erfc):
    """``act(x)`` and ``act'(x)`` for ``activation`` in ``ACTIVATIONS``."""
    if activation == "silu":
        return silu_and_grad(x)
    return gelu_and_grad(x, approximate=activation == "gelu", erfc=erfc)


def gated_grads(gate, up, dy, *, activation: str, limit: Optional[float], erfc: Callable = C.erfc):
    """dgate and dup of ``act(g) * u`` with ``g = min(gate, limit)``, ``u = clip(up, -limit, limit)``.

    The clamp is gpt-oss's. Its gradient is 0 where a value was clamped and 1 at and
    inside the bounds (torch's ``clamp`` convention, which gpt-oss trains with).
    """
    g, u = gate, up
    if limit is not None:
        g, u = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
    a, da = activation_and_grad(activation, g, erfc=erfc)
    dgate, dup = dy * u * da, dy * a
    if limit is not None:
        dgate = jnp.where(gate <= limit, dgate, 0.0)
        dup = jnp.where(jnp.abs(up) <= limit, dup, 0.0)
    return dgate, dup


# ------------------------------------------------------------- elementwise kernels
# silu_bwd, gelu_bwd, relu_bwd, leaky_relu_bwd, sigmoid_bwd and tanh_bwd are generated from
# the derivative functions above by ``jaxbwd.vjp.elementwise`` (one ``E.map_tiles`` pass).
def swiglu_bwd(gate, up, dy, *, limit: Optional[float], interpret: bool = False):
    """dgate, dup of ``silu(gate) * up`` (clamped when ``limit``). All same shape; grads in
    the dtypes of gate and up."""
    grads = functools.partial(gated_grads, activation="silu", limit=limit)
    return E.map_tiles(
        "swiglu_bwd", grads, (gate, up, dy), (gate.dtype, up.dtype),
        flops=BWD_COST["silu"][0] + _GATED_EXTRA_FLOPS, transcendentals=BWD_COST["silu"][1],
        interpret=interpret,
    )


# ---------------------------------------------------------------------- glu kernel
def _glu_bwd_kernel(x_ref, dy_ref, dx_ref, *, t: C.RowTiling, activation: str, limit: Optional[float]):
    # x and dx are [R, 2d]: the up half of tile (i, j) sits d columns to the right.
    rows, cols, mask = C.tile_index(pl.program_id(0), pl.program_id(1), t)
    gate = C.load_tile(x_ref, rows, cols, mask)
    up = C.load_tile(x_ref, rows, cols + t.n_cols, mask)
    dy = C.load_tile(dy_ref, rows, cols, mask)
    dgate, dup = gated_grads(gate, up, dy, activation=activation, limit=limit)
    C.store_tile(dx_ref, rows, cols, dgate, mask)
    C.store_tile(dx_ref, rows, cols + t.n_cols, dup, mask)


def glu_bwd(x, dy, *, activation: str, limit: Optional[float], interpret: bool = False):
    """dx of ``act(x[:, :d]) * x[:, d:]`` (clamped when ``limit``).

    Args:
      x: [R, 2d]. dy: [R, d], x's dtype.
    Returns:
      dx [R, 2d] in x's dtype: dgate in the first d columns, dup in the last d.
    """
    R, d = dy.shape
    if R * d == 0:
        return jnp.zeros(x.shape, x.dtype)
    C.check_index_range("glu", rows=R, cols=2 * d)
    t = E.tiling(R, d)
    flops, trans = BWD_COST[activation]
    # Row blocks on grid axis 0: it is the only axis that may exceed 65535 programs.
    return C.call(
        functools.partial(_glu_bwd_kernel, t=t, activation=activation, limit=limit),
        name="glu_bwd", grid=(t.num_row_blocks, t.num_col_blocks),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interpret,
        num_warps=t.num_warps, flops=(flops + _GATED_EXTRA_FLOPS) * R * d,
        transcendentals=trans * R * d, bytes_accessed=2 * C.nbytes(x) + C.nbytes(dy),
    )(x, dy)


# ------------------------------------------------------------------ softmax kernel
def _softmax_bwd_kernel(y_ref, dy_ref, dx_ref, *, t: C.RowTiling):
    rb = pl.program_id(0)

    def load_chunk(j):
        rows, cols, mask = C.tile_index(rb, j, t)
        # Masked lanes load y = dy = 0, so they add nothing to delta.
        return rows, cols, mask, C.load_tile(y_ref, rows, cols, mask), C.load_tile(dy_ref, rows, cols, mask)

    def row_sums(tiles):
        *_, y, dy = tiles
        return (jnp.sum(y * dy, axis=1),)

    def write_chunk(j, tiles, sums):
        rows, cols, mask, y, dy = tiles
        C.store_tile(dx_ref, rows, cols, y * (dy - sums[0][:, None]), mask)

    C.row_reduce_then_write(t, load_chunk, row_sums, write_chunk)


def softmax_bwd(y, dy, *, interpret: bool = False):
    """dx of softmax over the last axis from the saved output.

    ``dx = y * (dy - delta)``, ``delta = sum(dy * y)`` per row (the softmax Jacobian
    ``diag(y) - y y^T`` applied to dy). A row of zeros in y (a fully -inf input row)
    gives dx = 0.

    Args:
      y, dy: [R, D], same dtype.
    Returns:
      dx [R, D] in y's dtype.
    """
    R, D = y.shape
    C.check_index_range("softmax", rows=R, cols=D)
    if R * D == 0:
        return jnp.zeros(y.shape, y.dtype)
    t = C.row_tiling(R, D)
    return C.call(
        functools.partial(_softmax_bwd_kernel, t=t),
        name="softmax_bwd", grid=(t.num_row_blocks,),
        out_shape=jax.ShapeDtypeStruct((R, D), y.dtype), interpret=interpret,
        num_warps=t.num_warps, flops=4 * R * D,
        # Rows longer than one tile are read twice (the second read mostly from L2).
        bytes_accessed=C.nbytes(y, dy) * (1 if t.num_col_blocks == 1 else 2) + C.nbytes(y),
    )(y, dy)
