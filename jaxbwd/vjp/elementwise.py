"""The elementwise op factory: a derivative formula in, a custom-derivative op out.

``Elementwise(name, forward, derivative, ...)`` declares a unary elementwise op
``y = f(x; params)`` from two formulas and gets:

* the forward in XLA, computed in float32 (float64 stays float64), output in x's dtype;
* one residual, x or y (``saves``): whichever the derivative needs; a derivative that the
  output determines (sigmoid, tanh, relu) saves y, which the next layer usually keeps
  anyway, so the residual is often free; one that only the sign of x determines
  (leaky_relu, whose output does not tell the branch for slopes <= 0) saves the branch as
  one int8 per element;
* the XLA backward ``dx = dy * f'(v)`` and the tangent ``dy = dx * f'(v)``, both in
  float32 from the same ``derivative``;
* a Pallas backward kernel named ``<name>_bwd``: ``E.map_tiles`` over 2-D tiles
  (int64-safe sizes, masked tails) computing the same ``dy * f'(v)``
  (``kernel_derivative`` where Triton lacks a primitive the XLA formula uses, e.g. erf).

Both implementations evaluate one formula, so the tests that hold them equal to autodiff of
the op's reference test the formula once and its two compilations.

Whether the kernel pays, said once for every op built here: the XLA backward is one loop
fusion that reads v and dy and writes dx, already the minimum traffic; the kernel moves the
same bytes. The op's gain over ``jax.grad`` of a plain forward is in residuals (one array,
the derivative recomputed, instead of autodiff's intermediates: silu, gelu; leaky_relu's
int8 branch is what autodiff of ``jnp.where`` keeps) and in a derivative stable at
saturation; a Pallas path exists so that one switch (``implementation``) covers every op,
and so that ``python -m jaxbwd compile`` can hold the compiled kernel to the same gates.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import jax.numpy as jnp

from jaxbwd import sharding as S
from jaxbwd.pallas import elementwise as E
from jaxbwd.vjp import _base as B
from jaxbwd.vjp._derivatives import custom_op


def _cf(x):
    """The compute dtype: float32, or float64 when the input is float64 (numerical checks)."""
    return x.astype(jnp.float64 if x.dtype == jnp.float64 else jnp.float32)


class Elementwise:
    """A unary elementwise op from its forward and derivative formulas (see the module docstring).

    Args:
      name: the op's public name (errors, the kernel ``<name>_bwd``).
      forward: ``forward(x, **params) -> y`` on float32 (or float64) arrays.
      derivative: ``derivative(v, **params) -> f'(x)`` where ``v`` is x (``saves="input"``),
        y (``saves="output"``) or the branch (``saves="branch"``: 1 where x >= 0, -1 where
        not, NaN included, so that ``v >= 0`` tells it as ``x >= 0`` does); jnp code that
        also traces inside a Pallas kernel.
      saves: ``"input"``, ``"output"`` or ``"branch"``: the residual (``"branch"``: an int8
        array, for a derivative that depends only on the sign of x, as autodiff of
        ``jnp.where(x >= 0, ...)`` keeps a one-byte mask).
      kernel_derivative: the derivative used inside the kernel, when it must differ in how
        it is computed (not in value) from ``derivative``.
      cost: ``cost(**params) -> (flops, transcendentals)`` per element of the backward, for
        the kernel's cost estimate (default (4, 0)).

    Calling ``op(x, impl, **params)`` runs the custom-derivative op; params must be hashable.
    It returns x's shape and dtype (the formulas run in float32, float64 for float64 x).

    Raises:
      ValueError: ``saves`` is not ``"input"``, ``"output"`` or ``"branch"``.
    """

    def __init__(self, name: str, forward: Callable, derivative: Callable, *, saves: str = "input",
                 kernel_derivative: Optional[Callable] = None, cost: Optional[Callable] = None):
        if saves not in ("input", "output", "branch"):
            raise ValueError(f"jaxbwd.Elementwise({name!r}): saves must be 'input', 'output' or 'branch', "
                             f"got {saves!r}")
        self.name, self.forward, self.derivative, self.saves = name, forward, derivative, saves
        self.kernel_derivative = kernel_derivative or derivative
        self.kernel = f"{name}_bwd"
        self.cost = cost or (lambda **_: (4, 0))
        op = custom_op(self._primal, nondiff_argnums=(1, 2), name=name)
        op.defvjp(self._fwd, self._bwd)
        op.deftangent(self._tangent)
        self._op = op

    def __call__(self, x, impl: B.Impl, **params):
        return self._op(x, tuple(sorted(params.items())), impl)

    def partitioned(self, x, impl: B.Impl, **params):
        """The op per shard of x when x is sharded (elementwise: every layout is local)."""
        return S.partitioned("...->...", lambda x: self(x, impl, **params), x)

    # The rules: params arrive as a sorted tuple of items (a hashable nondiff argument).
    def _primal(self, x, params, impl):
        return self.forward(_cf(x), **dict(params)).astype(x.dtype)

    def _fwd(self, x, params, impl):
        y = self._primal(x, params, impl)
        if self.saves == "branch":
            return y, jnp.where(x >= 0, 1, -1).astype(jnp.int8)
        return y, (x if self.saves == "input" else y)

    def _grad(self, v, params, dy):
        g = _cf(dy)
        v = v.astype(g.dtype) if self.saves == "branch" else _cf(v)
        return (g * self.derivative(v, **dict(params))).astype(dy.dtype)

    def _bwd(self, params, impl, v, dy):
        if impl.pallas:
            kd = functools.partial(self.kernel_derivative, **dict(params))
            flops, transcendentals = self.cost(**dict(params))
            (dx,) = E.map_tiles(self.kernel, lambda v, dy: (dy * kd(v),), (v, dy), (dy.dtype,),
                                flops=flops, transcendentals=transcendentals, interpret=impl.interpret)
            return (dx,)
        return (self._grad(v, params, dy),)

    def _tangent(self, params, impl, v, dx):
        return self._grad(v, params, dx)
