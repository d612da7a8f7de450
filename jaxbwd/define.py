"""Writing your own op: ``define_op`` and ``define_elementwise``.

A user op gets what jaxbwd's own ops get: the same custom-derivative primitive
(``jaxbwd/vjp/_derivatives.py``: ``grad``/``vjp`` run your backward on your residuals,
``jvp``/``linearize``/``jacfwd`` run your tangent rule, ``vmap`` batches the rules, second
order on the kernel path differentiates your XLA formula), the ``implementation`` switch
(Pallas kernel on GPU, the formula elsewhere, interpret mode on CPU), per-shard execution
under a mesh when you give a sharding signature, a registry entry (:meth:`Op.spec`), the
generated test contract (:mod:`jaxbwd.testing`) and the command line
(``python -m jaxbwd check|bench|compile --ops your.module:SPEC``).

Why a new public name and not ``custom_op``: ``jaxbwd.vjp._derivatives.custom_op`` is the
internal mechanism, a ``jax.custom_vjp`` look-alike whose rules receive the resolved
implementation as an argument. ``define_op`` sits on top of it and takes care of what
every op repeats (choosing the implementation, binding static parameters, interpret mode,
the XLA twin for second order), so a user writes only formulas and kernels.

A complete worked example (a fused squared ReLU with a hand-written Pallas backward, its
registry entry and its generated tests) is ``examples/squared_relu.py``.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

import jax

from jaxbwd import sharding as S
from jaxbwd.vjp import _base as B
from jaxbwd.vjp._derivatives import custom_op
from jaxbwd.vjp.elementwise import Elementwise


class Op:
    """A user-defined op made by :func:`define_op`; call it as ``op(*arrays, implementation=None, **static)``."""

    def __init__(self, name: str, forward: Callable, backward: Callable, *, fwd: Optional[Callable],
                 pallas_backward: Optional[Callable], tangent: Optional[Callable], kernels: Sequence[str],
                 check: Optional[Callable], sharding: Optional[str]):
        self.name, self.forward, self.backward = name, forward, backward
        self._fwd_rule, self.pallas_backward, self.tangent = fwd, pallas_backward, tangent
        self.kernels = tuple(kernels) if pallas_backward is not None else ()
        self.check, self.sharding = check, sharding
        op = custom_op(self._primal, nondiff_argnums=(0, 1), name=name)
        op.defvjp(self._fwd, self._bwd)
        if tangent is not None or fwd is None:
            op.deftangent(self._tangent)
        self._op = op
        functools.update_wrapper(self, forward)
        self.__name__ = name

    def __call__(self, *arrays, implementation: Optional[str] = None, **static):
        for i, a in enumerate(arrays):
            if a is not None:
                B.check_array(self.name, f"argument {i}", a)
        if self.check is not None:
            self.check(*arrays, **static)
        impl = B.impl(implementation, self.name, *[a for a in arrays if a is not None], float64_kernels=True)
        params = tuple(sorted(static.items()))
        try:
            hash(params)
        except TypeError:
            raise TypeError(f"jaxbwd.{self.name}: static keyword arguments must be hashable, got "
                            f"{ {k: type(v).__name__ for k, v in static.items()} }") from None
        run = lambda *a: self._op(params, impl, *a)  # noqa: E731
        if self.sharding is None:
            return run(*arrays)
        return S.partitioned(self.sharding, run, *arrays)

    # Rules in _derivatives' convention: nondiff (params, impl) first.
    def _primal(self, params, impl, *arrays):
        return self.forward(*arrays, **dict(params))

    def _fwd(self, params, impl, *arrays):
        if self._fwd_rule is None:
            return self.forward(*arrays, **dict(params)), tuple(arrays)
        return self._fwd_rule(*arrays, **dict(params))

    def _bwd(self, params, impl, res, dy):
        if impl.pallas and self.pallas_backward is not None:
            cts = self.pallas_backward(res, dy, interpret=impl.interpret, **dict(params))
        else:
            cts = self.backward(res, dy, **dict(params))
        return tuple(cts)

    def _tangent(self, params, impl, res, *tangents):
        if self.tangent is not None:
            return self.tangent(res, tangents, **dict(params))
        # No fwd rule: the residuals are the inputs, so the JVP of the forward is exact.
        float_idx = [i for i, t in enumerate(tangents) if t is not None]

        def f(*xs):
            full = list(res)
            for i, x in zip(float_idx, xs):
                full[i] = x
            return self.forward(*full, **dict(params))

        return jax.jvp(f, tuple(res[i] for i in float_idx), tuple(tangents[i] for i in float_idx))[1]

    def spec(self, *, reference: Callable, examples: Sequence, diff_argnums: Sequence[int] = (0,),
             static_params: Sequence[str] = (), backward: str = "", lowering: Sequence = (),
             bad_inputs: Sequence = (), residual_budget: Optional[Callable] = None, family: str = "user",
             **more: Any):
        """This op's registry entry (:class:`jaxbwd.registry.OpSpec`), for :mod:`jaxbwd.testing`
        and ``python -m jaxbwd --ops module:ATTR``. ``examples``/``lowering``/``bad_inputs``
        are :class:`jaxbwd.registry.Example`/``BadInput``; ``more`` are other OpSpec fields."""
        from jaxbwd import registry

        return registry.OpSpec(
            name=self.name, family=family, fn=self, reference=reference, diff_argnums=tuple(diff_argnums),
            static_params=tuple(static_params), kernels=self.kernels,
            backward=backward or ("Pallas: " + ", ".join(self.kernels) if self.kernels else "XLA formula"),
            examples=tuple(examples), lowering=tuple(lowering), bad_inputs=tuple(bad_inputs),
            residual_budget=residual_budget, **more)


def define_op(name: str, *, forward: Callable, backward: Callable, fwd: Optional[Callable] = None,
              pallas_backward: Optional[Callable] = None, kernels: Sequence[str] = (),
              tangent: Optional[Callable] = None, check: Optional[Callable] = None,
              sharding: Optional[str] = None) -> Op:
    """Declares an op with a custom backward, as jaxbwd's own ops are declared.

    Args:
      name: the op's name (errors, the registry, the command line).
      forward: ``forward(*arrays, **static) -> out``: one array out, written in jnp (it is
        also what ``jvp`` differentiates when no ``tangent`` is given).
      backward: the XLA formula, ``backward(res, dy, **static) -> tuple`` of one cotangent per
        array argument (``None`` for integer arrays or ``None`` arguments).
      fwd: ``fwd(*arrays, **static) -> (out, res)``: what the forward saves. Default: the
        inputs (``res`` is the tuple of arrays).
      pallas_backward: ``pallas_backward(res, dy, *, interpret, **static) -> tuple``, the
        kernel path (``implementation="pallas"``, the default on GPU); pass ``interpret``
        to ``pl.pallas_call``, and Triton's ``compiler_params``
        (``jax.experimental.pallas.triton.CompilerParams``) to lower it through Triton on
        every supported jax (jax 0.10 otherwise picks Mosaic GPU, which the lowering check
        does not look for). It must compute what ``backward`` computes: the contract
        holds both to autodiff of the reference, and second derivatives on the kernel path
        differentiate ``backward``.
      kernels: the ``pallas_call`` names ``pallas_backward`` launches (tests check they ran
        and lowered).
      tangent: ``tangent(res, tangents, **static) -> out tangent``, linear in ``tangents``
        (one per array argument, ``None`` for integer ones). Default with no ``fwd``: the
        JVP of ``forward``; with a ``fwd`` and no ``tangent``, forward mode raises
        ``NotImplementedError`` naming the op.
      check: ``check(*arrays, **static)`` raising ValueError/TypeError on bad input.
      sharding: an optional signature for ``jaxbwd.sharding.partitioned`` (e.g.
        ``"...->..."`` for elementwise ops) so that sharded inputs run per shard.

    Returns:
      An :class:`Op`: ``op(*arrays, implementation=None, **static)``.

    Raises (when called):
      TypeError: a non-array argument; unhashable static arguments. ValueError: an unknown
      implementation. Whatever ``check`` raises.

    float64 arguments reach ``pallas_backward`` like any other (jaxbwd's own kernels compute
    in float32 and hand float64 to XLA; a user's kernel is its author's to choose).
    """
    if pallas_backward is not None and not kernels:
        raise ValueError(f"jaxbwd.define_op({name!r}): give kernels=(the pallas_call names) with pallas_backward")
    return Op(name, forward, backward, fwd=fwd, pallas_backward=pallas_backward, tangent=tangent,
              kernels=kernels, check=check, sharding=sharding)


def define_elementwise(name: str, forward: Callable, derivative: Callable, *, saves: str = "input",
                       kernel_derivative: Optional[Callable] = None) -> Callable:
    """A unary elementwise op from a derivative formula: XLA formula and Pallas kernel
    (``<name>_bwd``, 2-D tiles, int64-safe sizes) are generated, as for jaxbwd's activations.

    Args:
      name: the op's name; the kernel is ``<name>_bwd``.
      forward: ``forward(x, **params)`` in jnp, on float32 input.
      derivative: ``derivative(v, **params) -> f'(x)`` where ``v`` is x (``saves="input"``)
        or the output (``saves="output"``); float32 jnp code that also traces inside a
        Pallas kernel (``jnp.where``, arithmetic, ``exp``, ``tanh``...).
      saves: which array the forward keeps for the backward.
      kernel_derivative: the same derivative written for the kernel when ``derivative``
        uses something Triton cannot lower (e.g. ``lax.erf``).

    Returns:
      ``op(x, *, implementation=None, **params)`` with ``op.kernels = ("<name>_bwd",)``;
      raises TypeError for a non-floating x.
    """
    e = Elementwise(name, forward, derivative, saves=saves, kernel_derivative=kernel_derivative)

    def op(x, *, implementation: Optional[str] = None, **params):
        B.check_float(name, "x", x)
        return e.partitioned(x, B.impl(implementation, name, x), **params)

    op.__name__ = op.__qualname__ = name
    op.kernels = (e.kernel,)
    return op
