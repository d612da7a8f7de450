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
import inspect
from collections.abc import Iterable
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxbwd import sharding as S
from jaxbwd.vjp import _base as B
from jaxbwd.vjp._derivatives import custom_op
from jaxbwd.vjp.elementwise import Elementwise


class Op:
    """A user-defined op made by :func:`define_op`; call it as ``op(*arrays, implementation=None, **static)``.

    The call returns one array of the shape and dtype ``forward`` gives; the errors it raises
    are those listed under "Raises (when called)" in :func:`define_op`. :meth:`spec` builds
    its registry entry (ValueError as documented there).
    """

    def __init__(self, name: str, forward: Callable, backward: Callable, *, fwd: Optional[Callable],
                 pallas_backward: Optional[Callable], tangent: Optional[Callable], kernels: Sequence[str],
                 check: Optional[Callable], sharding: Optional[str]):
        self.name, self.forward, self.backward = name, forward, backward
        self._fwd_rule, self.pallas_backward, self.tangent = fwd, pallas_backward, tangent
        self.kernels = tuple(kernels) if pallas_backward is not None else ()
        self.check, self.sharding = check, sharding
        self._signature = _signature(forward)
        # The other rules' signatures, checked per call against the static parameters given.
        rules = (("fwd", fwd, None), ("backward", backward, 2), ("pallas_backward", pallas_backward, 2),
                 ("tangent", tangent, 2))
        self._rule_sigs = [(rule, sig, n) for rule, f, n in rules
                           if f is not None and (sig := _signature(f)) is not None]
        self._sharding_inputs = None if sharding is None else _check_sharding(name, sharding, self._signature)
        # nondiff: (params, impl, avals); avals are the arguments' (shape, dtype, weak_type) as the rules
        # see them (per shard, per vmapped example), to hold the backward's cotangents to.
        op = custom_op(self._primal, nondiff_argnums=(0, 1, 2), name=name, allow_rank_promotion=False)
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
        _check_signature(self.name, self._signature, arrays, static)
        for rule, sig, n in self._rule_sigs:  # (res, dy) / (res, tangents), or the arrays for fwd
            extra = {"interpret": False} if rule == "pallas_backward" else {}
            _check_signature(self.name, sig, arrays if n is None else (None,) * n, {**static, **extra}, rule)
        if self.check is not None:
            self.check(*arrays, **static)
        present = [a for a in arrays if a is not None]
        if self.pallas_backward is None:  # no kernel to run: the name is checked, XLA runs
            B.impl(implementation, self.name)
            implementation = "xla"
        impl = B.impl(implementation, self.name, *present, float64_kernels=True)
        params = _check_hashable(self.name, static)
        run = lambda *a: self._op(params, impl, _avals(a), *a)  # noqa: E731
        if self.sharding is None:
            if impl.pallas and all(a is not None for a in arrays):
                return S.whole(run, *arrays)  # a kernel cannot take sharded operands: run whole
            return run(*arrays)
        if len(arrays) != self._sharding_inputs:
            raise TypeError(f"jaxbwd.{self.name}: its sharding signature {self.sharding!r} lays out "
                            f"{self._sharding_inputs} array argument(s), the call passed {len(arrays)} "
                            "(pass None for an absent optional array)")
        return S.partitioned(self.sharding, run, *arrays)

    # Rules in _derivatives' convention: nondiff (params, impl, avals) first. A user's rule
    # that returns the wrong structure fails here, by the op's name, not deep inside JAX.
    def _primal(self, params, impl, avals, *arrays):
        return _one_array(self.name, "forward", self.forward(*arrays, **dict(params)))

    def _fwd(self, params, impl, avals, *arrays):
        if self._fwd_rule is None:
            return self._primal(params, impl, avals, *arrays), tuple(arrays)
        got = self._fwd_rule(*arrays, **dict(params))
        if not (isinstance(got, tuple) and len(got) == 2):
            raise TypeError(f"jaxbwd.{self.name}: fwd must return a pair (out, res), got "
                            f"{_describe(got)}")
        out = _one_array(self.name, "fwd's out", got[0])
        want = self._out_aval(params, arrays)  # the arrays themselves: weak types count
        if (tuple(out.shape), jnp.dtype(out.dtype)) != want:
            # the op's value would change when it is differentiated
            raise TypeError(f"jaxbwd.{self.name}: fwd's out is {_aval_text(out.shape, out.dtype)}, forward's "
                            f"is {_aval_text(*want)}; they must agree")
        _check_residuals(self.name, got[1])
        return out, got[1]

    def _bwd(self, params, impl, avals, res, dy):
        if impl.pallas and self.pallas_backward is not None:
            rule, cts = "pallas_backward", self.pallas_backward(res, dy, interpret=impl.interpret, **dict(params))
        else:
            rule, cts = "backward", self.backward(res, dy, **dict(params))
        return _cotangents(self.name, rule, cts, avals)

    def _out_aval(self, params, args) -> tuple:
        """(shape, dtype) of ``forward``'s result for ``args`` (arrays or ShapeDtypeStructs;
        traced, not run)."""
        out = jax.eval_shape(lambda *a: self.forward(*a, **dict(params)), *args)
        return tuple(out.shape), jnp.dtype(out.dtype)

    def _tangent(self, params, impl, avals, res, *tangents):
        if self.tangent is not None:
            t = self.tangent(res, tangents, **dict(params))
            specs = [None if a is None else jax.ShapeDtypeStruct(a[0], a[1], weak_type=a[2]) for a in avals]
            shape, dtype = self._out_aval(params, specs)
            if not isinstance(t, (jax.Array, np.ndarray)) or tuple(t.shape) != shape:
                got = _aval_text(t.shape, t.dtype) if isinstance(t, (jax.Array, np.ndarray)) else _describe(t)
                raise TypeError(f"jaxbwd.{self.name}: tangent must return one array of the output's shape, "
                                f"{_aval_text(shape, dtype)}, got {got}")
            if not jnp.issubdtype(t.dtype, jnp.inexact):
                raise TypeError(f"jaxbwd.{self.name}: tangent returned {_aval_text(t.shape, t.dtype)}, "
                                f"expected a floating array (the output is {dtype.name})")
            return t.astype(dtype)
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
        are :class:`jaxbwd.registry.Example`/``BadInput``; ``more`` are other OpSpec fields.

        Raises: ValueError for no ``examples`` (every check and benchmark starts from the
        first), or for an op with ``kernels`` and no ``lowering`` shapes (what ``compile``
        and the contract's lowering check compile)."""
        from jaxbwd import registry

        if not examples:
            raise ValueError(f"{self.name}.spec: examples must hold at least one Example (the checks, the "
                             "contract and bench start from the first), got none")
        if self.kernels and not lowering:
            raise ValueError(f"{self.name}.spec: an op with kernels {self.kernels} needs lowering= shapes "
                             "(Examples of ShapeDtypeStructs) to lower and compile them at, got none")

        more.setdefault("forward_mode", self.tangent is not None or self._fwd_rule is None)
        return registry.OpSpec(
            name=self.name, family=family, fn=self, reference=reference, diff_argnums=tuple(diff_argnums),
            static_params=tuple(static_params), kernels=self.kernels,
            backward=backward or ("Pallas: " + ", ".join(self.kernels) if self.kernels else "XLA formula"),
            examples=tuple(examples), lowering=tuple(lowering), bad_inputs=tuple(bad_inputs),
            residual_budget=residual_budget, **more)


def _signature(f: Callable) -> Optional[inspect.Signature]:
    try:
        return inspect.signature(f)
    except (TypeError, ValueError):  # a builtin without one: nothing to check calls against
        return None


def _check_signature(name: str, sig: Optional[inspect.Signature], args: Sequence, static: dict,
                     rule: str = "forward") -> None:
    """A call that the op's ``rule`` cannot take fails by the op's name, before any tracing."""
    if sig is None:
        return
    try:
        sig.bind(*args, **static)
    except TypeError as e:
        label = name if rule == "forward" else rule
        raise TypeError(f"jaxbwd.{name}: {e}; the op's {rule} is {label}{sig}") from None


def _check_sharding(name: str, sharding: Any, sig: Optional[inspect.Signature]) -> int:
    """The number of array arguments ``sharding`` lays out, checked against the forward."""
    where = f"jaxbwd.define_op({name!r})"
    n_in, n_out = S.check_signature(sharding, where)
    if n_out != 1:
        raise ValueError(f"{where}: sharding {sharding!r} has {n_out} outputs; an op returns one array")
    if sig is not None:  # only an upper bound: static parameters may also be positional ones
        params = sig.parameters.values()
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if not any(p.kind == p.VAR_POSITIONAL for p in params) and n_in > len(positional):
            raise ValueError(f"{where}: sharding {sharding!r} lays out {n_in} array argument(s), forward "
                             f"{name}{sig} takes at most {len(positional)} positionally")
    return n_in


def _check_hashable(name: str, static: dict) -> tuple:
    """The static keyword arguments as the rules' hashable nondiff argument. An array there
    (traced under jit, or a jax.Array, which does not hash) belongs among the arrays."""
    params = tuple(sorted(static.items()))
    try:
        hash(params)
    except TypeError:
        raise TypeError(f"jaxbwd.{name}: static keyword arguments must be hashable (Python numbers, "
                        f"strings, tuples), got {dict((k, type(v).__name__) for k, v in static.items())}") from None
    return params


def _check_name(maker: str, name: Any) -> None:
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"jaxbwd.{maker}: name must be a Python identifier (it names the op in errors, "
                         f"its kernels and the registry), got {name!r}")
    from jaxbwd import registry

    if name in registry.REGISTRY and registry.REGISTRY[name].family != "user":
        raise ValueError(f"jaxbwd.{maker}({name!r}): {name!r} is one of jaxbwd's own ops; choose another name")


def _describe(v: Any) -> str:
    if isinstance(v, (tuple, list)):
        return f"a {type(v).__name__} of {len(v)}"
    return type(v).__name__


def _avals(arrays: Sequence) -> tuple:
    """(shape, dtype, weak_type) per argument: weak types decide the dtype of ``forward``'s
    result (bfloat16 x divided by a Python float stays bfloat16)."""
    return tuple(None if a is None else (tuple(a.shape), jnp.dtype(a.dtype), _weak(a)) for a in arrays)


def _weak(a) -> bool:
    return bool(getattr(jax.typeof(a), "weak_type", False))


def _aval_text(shape, dtype) -> str:
    return f"{jnp.dtype(dtype).name}{list(shape)}"


def _check_residuals(name: str, res: Any) -> None:
    """fwd's residuals: a pytree of arrays (and Python numbers), what JAX can save."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(res)[0]:
        if not isinstance(leaf, (jax.Array, np.ndarray, np.generic, bool, int, float, complex)):
            raise TypeError(f"jaxbwd.{name}: fwd's res must be a pytree of arrays, got a leaf of type "
                            f"{type(leaf).__name__} at res{jax.tree_util.keystr(path)}")


def _one_array(name: str, what: str, out: Any):
    if not isinstance(out, (jax.Array, np.ndarray)):
        raise TypeError(f"jaxbwd.{name}: {what} must return one array, got {_describe(out)}")
    return out


def _cotangents(name: str, rule: str, cts: Any, avals: tuple) -> tuple:
    """The backward's cotangents held to the arguments: one per argument, each of its
    argument's shape (a mismatch raises) and cast to its argument's dtype (so that
    ``jax.grad`` of a float32 argument is float32 whatever the rule computed in); None for
    integer and ``None`` arguments."""
    if not isinstance(cts, (tuple, list)) or len(cts) != len(avals):
        # Unchecked, a missing cotangent would leave that argument's gradient at zero.
        raise TypeError(f"jaxbwd.{name}: {rule} returned {_describe(cts)}, expected a tuple of "
                        f"{len(avals)} cotangent(s) (one per array argument, None for integer ones)")
    out = []
    for i, (ct, aval) in enumerate(zip(cts, avals)):
        if ct is None or aval is None or not jnp.issubdtype(aval[1], jnp.inexact):
            out.append(None)
            continue
        shape, dtype = aval[:2]
        if not isinstance(ct, (jax.Array, np.ndarray, np.generic, bool, int, float)):
            raise TypeError(f"jaxbwd.{name}: {rule}'s cotangent for argument {i} must be an array or None, "
                            f"got {_describe(ct)}")
        if not isinstance(ct, (bool, int, float)) and not jnp.issubdtype(jnp.result_type(ct), jnp.inexact):
            raise TypeError(f"jaxbwd.{name}: {rule}'s cotangent for argument {i} is {jnp.result_type(ct).name}, "
                            f"expected a floating dtype (the argument is {dtype.name})")
        if tuple(jnp.shape(ct)) != shape:
            raise ValueError(f"jaxbwd.{name}: {rule}'s cotangent for argument {i} has shape "
                             f"{tuple(jnp.shape(ct))}, expected {shape} (the argument's shape)")
        out.append(jnp.asarray(ct).astype(dtype))
    return tuple(out)


def _check_elementwise(name: str, rule: str, out: Any, shape: tuple) -> None:
    """A define_elementwise formula's result (traced): one floating array of x's shape (the
    derivative may also be a scalar or broadcast to it), else the op would change shape."""
    if not isinstance(out, jax.ShapeDtypeStruct):
        raise TypeError(f"jaxbwd.{name}: {rule} must return one array, got {_describe(out)}")
    if not jnp.issubdtype(out.dtype, jnp.inexact):
        raise TypeError(f"jaxbwd.{name}: {rule} returned {_aval_text(out.shape, out.dtype)}, expected a "
                        "floating array")
    try:
        fits = rule != "forward" and jnp.broadcast_shapes(tuple(out.shape), shape) == shape
    except ValueError:
        fits = False
    if tuple(out.shape) != shape and not fits:
        raise ValueError(f"jaxbwd.{name}: {rule} returned shape {tuple(out.shape)} for x of shape {shape}; an "
                         f"elementwise {rule} keeps x's shape" + (" (or broadcasts to it)" if rule != "forward" else ""))


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
        JVP of ``forward``; with a ``fwd`` and no ``tangent``, computing a forward-mode
        tangent (``jax.jvp``, applying ``jax.linearize``'s function, ``jax.jacfwd``) raises
        ``NotImplementedError`` naming the op; reverse mode, also through ``jax.checkpoint``
        and ``lax.scan``, runs the backward.
      check: ``check(*arrays, **static)`` raising ValueError/TypeError on bad input.
      sharding: an optional layout signature for ``jaxbwd.sharding.partitioned`` (e.g.
        ``"...->..."`` for elementwise ops, one input term per array argument, one output)
        so that sharded inputs run per shard. Calls then pass every array argument it lays
        out, positionally (None for an absent optional one). Without one, under explicit mesh
        axes the Pallas path gathers its operands and runs whole (``jaxbwd.sharding.whole``)
        and the XLA path runs the formula as JAX partitions it.

    Returns:
      An :class:`Op`: ``op(*arrays, implementation=None, **static)``.

    Raises:
      ValueError: ``name`` is not an identifier or is one of jaxbwd's own ops; a
        ``pallas_backward`` without ``kernels``; a ``sharding`` that is not a signature, has
        more than one output, or lays out a number of arguments ``forward`` cannot take.
        TypeError: a rule that is not callable; ``kernels`` not a sequence of str.

    Raises (when called, each naming the op):
      TypeError: a non-array argument; arguments the forward's signature does not take (or,
      with ``sharding``, another number of arrays than the signature lays out); static
      arguments that ``fwd``, ``backward``, ``pallas_backward`` (with ``interpret``) or
      ``tangent`` does not take, or a rule that cannot take its positional arguments; unhashable
      static arguments; a rule returning the wrong form: a forward not returning one array,
      a ``fwd`` not returning ``(out, res)`` with ``out`` of forward's shape and dtype and
      ``res`` a pytree of arrays, a backward not returning one array (or None) of a float
      dtype per argument, a tangent not returning one float array of the output's shape.
      ValueError: an unknown implementation; a cotangent whose shape is not its argument's.
      Cotangents and tangents of another float dtype are cast to their argument's / the
      output's. Whatever ``check`` raises.

    float64 arguments reach ``pallas_backward`` like any other (jaxbwd's own kernels compute
    in float32 and hand float64 to XLA; a user's kernel is its author's to choose).

    Source: the VJP/JVP rule pair of JAX's custom derivatives (``jax.custom_vjp``'s
    fwd/bwd, ``jax.custom_jvp``'s tangent), as jaxbwd's own ops declare theirs.
    """
    _check_name("define_op", name)
    where = f"jaxbwd.define_op({name!r})"
    for arg, f in (("forward", forward), ("backward", backward)):
        if not callable(f):
            raise TypeError(f"{where}: {arg} must be callable, got {type(f).__name__}")
    for arg, f in (("fwd", fwd), ("pallas_backward", pallas_backward), ("tangent", tangent), ("check", check)):
        if f is not None and not callable(f):
            raise TypeError(f"{where}: {arg} must be callable or None, got {type(f).__name__}")
    if isinstance(kernels, str) or not isinstance(kernels, Iterable):
        raise TypeError(f"{where}: kernels must be a sequence of pallas_call names (str), got {kernels!r}")
    kernels = tuple(kernels)  # once: a generator would be used up by the check below
    if not all(isinstance(k, str) for k in kernels):
        raise TypeError(f"{where}: kernels must be a sequence of pallas_call names (str), got {kernels!r}")
    if pallas_backward is not None and not kernels:
        raise ValueError(f"{where}: give kernels=(the pallas_call names) with pallas_backward")
    return Op(name, forward, backward, fwd=fwd, pallas_backward=pallas_backward, tangent=tangent,
              kernels=kernels, check=check, sharding=sharding)


def define_elementwise(name: str, forward: Callable, derivative: Callable, *, saves: str = "input",
                       kernel_derivative: Optional[Callable] = None) -> Callable:
    """A unary elementwise op from a derivative formula: XLA formula and Pallas kernel
    (``<name>_bwd``, 2-D tiles, int64-safe sizes) are generated, as for jaxbwd's activations.

    Args:
      name: the op's name; the kernel is ``<name>_bwd``.
      forward: ``forward(x, **params)`` in jnp, on float32 input.
      derivative: ``derivative(v, **params) -> f'(x)`` where ``v`` is x (``saves="input"``),
        the output (``saves="output"``) or the branch (``saves="branch"``: 1 where x >= 0,
        -1 elsewhere, NaN included, so ``v >= 0`` reads as ``x >= 0``); float32 jnp code
        that also traces inside a Pallas kernel (``jnp.where``, arithmetic, ``exp``,
        ``tanh``...).
      saves: what the forward keeps for the backward: x, the output, or the branch as one
        int8 per element (for piecewise-linear maps split at 0, as leaky_relu).
      kernel_derivative: the same derivative written for the kernel when ``derivative``
        uses something Triton cannot lower (e.g. ``lax.erf``).

    Returns:
      ``op(x, *, implementation=None, **params)`` with ``op.kernels = ("<name>_bwd",)``;
      it raises TypeError naming the op for a non-floating x, params that ``forward``,
      ``derivative`` or ``kernel_derivative`` does not take, unhashable params, or a
      ``forward``/``derivative`` not returning one floating array, and ValueError for such a
      result of another shape than x's (a derivative may also be a scalar or broadcast to x).

    Raises:
      ValueError: ``name`` is not an identifier or is one of jaxbwd's own ops; ``saves`` is
        not "input", "output" or "branch". TypeError: a formula that is not callable.

    Source: the chain rule for a unary map, ``dx = dy * f'(x)`` (or ``f'`` written in terms
    of the saved output ``y = f(x)``), one elementwise pass in the backward.
    """
    _check_name("define_elementwise", name)
    for arg, f in (("forward", forward), ("derivative", derivative), ("kernel_derivative", kernel_derivative)):
        if not callable(f) and not (arg == "kernel_derivative" and f is None):
            raise TypeError(f"jaxbwd.define_elementwise({name!r}): {arg} must be callable, got {type(f).__name__}")
    e = Elementwise(name, forward, derivative, saves=saves, kernel_derivative=kernel_derivative)
    rules = (("forward", forward), ("derivative", derivative), ("kernel_derivative", kernel_derivative))
    sigs = [(rule, _signature(f)) for rule, f in rules if f is not None]

    def op(x, *, implementation: Optional[str] = None, **params):
        B.check_float(name, "x", x)
        for rule, sig in sigs:  # every formula is called with the params
            _check_signature(name, sig, (x,), params, rule)
        _check_hashable(name, params)
        # forward and derivative traced on what they are given (kernel_derivative may use
        # what traces only inside a kernel)
        spec = jax.ShapeDtypeStruct(jnp.shape(x), jnp.float32)
        for rule, f in rules[:2]:
            _check_elementwise(name, rule, jax.eval_shape(functools.partial(f, **params), spec), spec.shape)
        return e.partitioned(x, B.impl(implementation, name, x), **params)

    op.__name__ = op.__qualname__ = name
    op.kernels = (e.kernel,)
    return op
