"""The custom-derivative wiring of every op: one primitive carrying a VJP, a JVP, a
transpose and a batching rule.

Why this mechanism. An op must keep its reverse rule exactly (what its fwd rule saves,
its Pallas backward kernels) and also run under ``jax.jvp``, ``jax.linearize``,
``jax.jacfwd`` and second order. JAX's stock tools each give half of that:

* ``jax.custom_vjp`` has no forward mode at all ("can't apply forward-mode autodiff
  (jvp) to a custom_vjp function"), and its linear part has no transpose rule either.
* ``jax.custom_jvp`` derives reverse mode by transposing the JVP, so the backward would be
  XLA's transpose of a formula: the Pallas backward kernels and the chosen residuals
  would be lost.
* ``custom_jvp`` around ``jax.custom_derivatives.linear_call`` (tangent map forward, the
  backward kernel as its transpose) gives jvp and grad, but ``linear_call`` has no
  batching rule (no ``jacfwd``, no ``vmap`` of a ``jvp``) and no derivative of its own
  (no Hessian-vector products).
* JAX's "hijax" primitives (``jax.experimental.hijax.HiPrim``, JAX >= 0.12; see JAX's
  ``docs/hijax_custom_derivatives.md``) let one primitive define ``vjp_fwd``/``vjp_bwd``
  (the op's fwd and bwd rules, unchanged), ``jvp``, ``transpose`` and ``batch``. That is
  what is used here.

Three primitives per op application:

* ``_Op`` (the op). ``grad``/``vjp`` call its fwd rule (the residuals the op declares) and
  its bwd rule (the Pallas kernels or the XLA formula). ``jvp``/``linearize`` run the fwd
  rule as ``_Fwd`` and apply ``_Tangent`` to the residuals and input tangents.
* ``_Fwd`` (the fwd rule, ``(out, res)``): its VJP is the bwd rule while only ``out`` gets a
  cotangent, so ``grad`` of a JVP's primal output (MeanFlow, consistency models) runs the
  backward kernels; with cotangents on ``res`` too (second order) it is the fwd formula's.
* ``_Tangent`` (the op's linearisation at the saved residuals): evaluated forward it is the
  op's tangent formula; transposed it is the op's bwd rule, so reverse mode taken through
  a JVP (``lax.scan``/``cond``/``remat`` linearise their bodies that way, and ``grad`` with
  respect to a ``jvp``'s input tangent) still runs the backward kernels on the same
  residuals. Its JVP is itself along the input tangents (so that transposes the same way)
  plus the JVP of the tangent formula along the residuals.

All three batch by vmapping their rules (``vmap`` of ``grad``, ``jacfwd``, per-example
gradients), with unbatched residuals (a shared weight) left unbatched.

Second order on the kernel path: a rule that runs Pallas kernels (``Impl.pallas``) is
wrapped in a ``jax.custom_jvp`` whose JVP is the JVP of the same rule with the XLA
implementation (the op's XLA formula, which the tests hold equal to the kernels), so
``grad(grad)``, ``hessian`` and gradient penalties differentiate the backward kernels
through their formulas, as ``*_double_grad`` ops do. First-order derivatives still run
the kernels.

On JAX < 0.12 the hijax API is absent: ops are plain ``jax.custom_vjp`` (reverse mode,
including the kernel path's second order, unchanged, and forward over reverse:
``jax.hessian`` and ``jax.jvp`` of ``jax.grad`` differentiate the rules themselves) and
``jax.jvp``/``jax.jacfwd`` of an op raise a ``NotImplementedError`` naming it, also inside
``jit``. Where JAX differentiates a whole transform around the op (``jax.jvp`` of a jitted,
checkpointed or scanned function) and for ``jax.linearize``, which traces as reverse mode
does, the error is JAX's own TypeError for ``custom_vjp`` functions, when the staged jvp
is compiled or the linear function applied.

Each op file declares rules with the ``jax.custom_vjp`` spelling plus one tangent rule,
and never sees which mechanism runs them::

    @functools.partial(custom_op, nondiff_argnums=(1,))
    def _silu(x, impl): ...
    _silu.defvjp(_silu_fwd, _silu_bwd)          # fwd(x, impl) -> (y, res); bwd(impl, res, dy)
    _silu.deftangent(_silu_tangent)             # tangent(impl, res, dx) -> dy, linear in dx

Conventions the rules follow: the resolved :class:`jaxbwd.vjp._base.Impl` is a nondiff
argument, directly or as the ``impl`` field of a frozen dataclass; the bwd rule returns
one cotangent per differentiable argument (``None`` for integer arrays); the tangent rule
receives ``None`` for integer arguments' tangents and zeros for symbolic-zero tangents.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Callable, Optional, Sequence

import jax
import jax.extend.core
import jax.numpy as jnp

from jaxbwd import sharding as S
from jaxbwd.vjp import _base as B

try:  # JAX >= 0.12: the primitive API this module is built on (pinned here only).
    from jax.experimental import hijax as _hijax
    from jax._src.interpreters import batching as _batching

    _HAVE_HIJAX = all(hasattr(_hijax, n) for n in ("HiPrim", "vmap_rule", "linearize_from_jvp",
                                                    "vjp_from_jvp", "GradAccum", "Zero", "unmap_avals"))
    _HAVE_HIJAX = _HAVE_HIJAX and tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 12)
except ImportError:  # pragma: no cover - old JAX
    _hijax = _batching = None
    _HAVE_HIJAX = False

FORWARD_MODE = _HAVE_HIJAX
"""Whether forward-mode derivatives (jvp, linearize, jacfwd, hessian) are available."""

_FORWARD_MODE_WHAT = "forward-mode differentiation (jax.jvp, jax.linearize, jax.jacfwd)"
_FORWARD_MODE_ERRORS = ("can't apply forward-mode autodiff", "forward-mode differentiation")


def _jvp_of_op(dyn) -> bool:
    """Whether an op without a tangent rule (``jax.custom_vjp`` on jax < 0.12) is about to be
    pushed forward: the innermost trace, the one that processes the call, is a ``jax.jvp``
    trace owning an argument. With JAX's direct linearization (its default) reverse mode and
    ``jax.linearize`` trace with LinearizeTraces, so that means jvp or jacfwd of the op.
    Forward over reverse (``jax.hessian``, a mixed partial such as d/dw of grad_x) meets a
    reverse trace first, which runs the fwd rule as plain, differentiable code."""
    if not getattr(jax.config, "jax_use_direct_linearize", False):
        return False  # reverse mode also runs through JVPTrace: leave it to JAX
    from jax._src import core  # jax 0.10/0.11 only: this path never runs on jax >= 0.12
    from jax.interpreters import ad

    trace = core.trace_ctx.trace
    return isinstance(trace, ad.JVPTrace) and any(isinstance(a, ad.JVPTracer) and a._trace is trace for a in dyn)


# ----------------------------------------------------------------- the XLA twin of a rule
def _impl_of(value) -> Optional[B.Impl]:
    """The :class:`Impl` a nondiff argument is or carries as its ``impl`` field, else None."""
    if isinstance(value, B.Impl):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        impl = getattr(value, "impl", None)
        return impl if isinstance(impl, B.Impl) else None
    return None


def _xla_twin(value):
    """``value`` with every :class:`Impl` switched to the XLA implementation (else None)."""
    impl = _impl_of(value)
    if impl is None or not impl.pallas:
        return None
    xla = dataclasses.replace(impl, kind="xla")
    return xla if value is impl else dataclasses.replace(value, impl=xla)


def _interpreted_under_vma(name: str, what: str, rule: Callable) -> Callable:
    """``rule``, or, where it runs a Pallas kernel, an error by the op's name: JAX's Pallas
    interpreter builds index arrays that do not vary over the manual axes of a vma-checked
    shard_map, and the checker rejects them deep inside (a GPU lowers the same kernels)."""
    def checked(*args):
        if "pallas_call" not in str(jax.make_jaxpr(rule)(*args)):
            return rule(*args)
        raise NotImplementedError(
            f"jaxbwd.{name}: the Pallas {what} cannot run in interpret mode inside a "
            "jax.shard_map with check_vma=True (JAX's Pallas interpreter does not track varying "
            "manual axes); use check_vma=False, implementation='xla', or a GPU, where the kernels lower"
        )

    return checked


def _ranks_allowed(rule: Callable) -> Callable:
    """``rule`` traced under JAX's default rank promotion, whatever the caller's
    ``jax_numpy_rank_promotion`` ("raise" or "warn" is a check on the caller's own code, as
    jax.nn's and flax's functions ignore it; the rules broadcast per-row and per-channel
    vectors against their tiles as numpy does). Every trace of the rule, its XLA twin's JVP
    included, runs through this."""
    @functools.wraps(rule)
    def traced(*args):
        with jax.numpy_rank_promotion("allow"):
            return rule(*args)

    return traced


def _differentiable(rule: Callable, nondiff: tuple, *, forwards_inputs: bool = False) -> Callable:
    """``rule(*nondiff, ...)`` whose own derivative, on the Pallas path, is the XLA rule's.

    A ``pallas_call`` has no JVP rule, so a kernel inside a fwd/bwd rule that a second
    derivative reaches would fail; the kernels compute the same function as the XLA
    formula, so the formula's JVP is the kernel's.

    ``forwards_inputs`` (the fwd rule, whose residuals are often its own inputs): outputs
    that are inputs passed through are returned as those inputs, outside the
    ``custom_jvp``. Through it they would be new values, which ``lax.scan``'s partial
    evaluation cannot tell from computed ones: it would stack a copy of a weight, or of a
    scanned input, per iteration as residuals, where the XLA path forwards them.
    """
    twins = [_xla_twin(v) for v in nondiff]
    if all(t is None for t in twins):
        return functools.partial(rule, *nondiff)
    xla_nondiff = tuple(v if t is None else t for v, t in zip(nondiff, twins))

    @jax.custom_jvp
    def kernel(*args):
        return rule(*nondiff, *args)

    @kernel.defjvp
    def _(primals, tangents):
        return jax.jvp(functools.partial(rule, *xla_nondiff), primals, tangents)

    if not forwards_inputs:
        return kernel

    def fwd(*args):
        # On concrete arguments (eager, as the XLA path runs the rule) there is no scan or
        # remat to see the residuals: the rule runs on the values.
        if not any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves(args)):
            return kernel(*args)
        return _forwarding_inputs(rule, nondiff, xla_nondiff, *args)

    return fwd


def _passed_through(closed) -> tuple:
    """Per output of a closed jaxpr: the index of the input it passes through, or None where
    the jaxpr computes it."""
    position = {id(v): i for i, v in enumerate(closed.jaxpr.invars)}
    return tuple(position.get(id(v)) for v in closed.jaxpr.outvars)


def _forwarding_inputs(rule: Callable, nondiff: tuple, xla_nondiff: tuple, *args):
    """``rule(*nondiff, *args)`` as :func:`_differentiable`'s ``custom_jvp``, except that
    outputs which are inputs passed through are those inputs. The rule is traced once; the
    ``custom_jvp`` evaluates that trace's computed outputs (its JVP, as in
    :func:`_differentiable`, is the XLA rule's)."""
    flat_args, in_tree = jax.tree.flatten(args)
    closed, out_shape = jax.make_jaxpr(lambda *a: rule(*nondiff, *a), return_shape=True)(*args)
    source = _passed_through(closed)
    computed = [j for j, i in enumerate(source) if i is None]
    run = jax.extend.core.jaxpr_as_fun(closed)

    @jax.custom_jvp
    def kernel(*flat):
        outs = run(*flat)
        return [outs[j] for j in computed]

    @kernel.defjvp
    def _(primals, tangents):
        xla = lambda *a: jax.tree.leaves(rule(*xla_nondiff, *a))  # noqa: E731
        unflat = lambda flat: jax.tree.unflatten(in_tree, flat)  # noqa: E731
        outs, outs_dot = jax.jvp(xla, tuple(unflat(primals)), tuple(unflat(tangents)))
        return [outs[j] for j in computed], [outs_dot[j] for j in computed]

    it = iter(kernel(*flat_args) if computed else ())
    return jax.tree.unflatten(jax.tree.structure(out_shape),
                              [next(it) if i is None else flat_args[i] for i in source])


# ----------------------------------------------------------------------- the rules object
@dataclasses.dataclass(frozen=True, eq=False)
class _Rules:
    """One application's rules, taking the dynamic arguments only (nondiff ones bound).

    primal(*args) -> out; fwd(*args) -> (out, res); bwd(res, ct) -> cts (one per arg,
    None for integer args); tangent(res, tangents) -> out tangent. Under vmap a primitive
    is rebuilt with the rules vmapped (``_batched_rules``).
    """

    name: str
    primal: Callable
    fwd: Callable
    bwd: Callable
    tangent: Optional[Callable]


class _StaticDims:
    """Residual batch dimensions, carried through the residual pytree as static data.

    Equal by value: under nested vmaps an inner level's ``_StaticDims`` sits in the outer
    level's dims, and JAX checks pytree structures built at different times for equality."""

    def __init__(self, dims):
        self.dims = dims

    def _key(self):
        leaves, tree = jax.tree_util.tree_flatten(self.dims, is_leaf=lambda d: d is None)
        return tree, tuple(leaves)

    def __eq__(self, other):
        return isinstance(other, _StaticDims) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())


jax.tree_util.register_pytree_node(_StaticDims, lambda s: ((), s.dims), lambda dims, _: _StaticDims(dims))


def _leaf_dims(tree, dims) -> list:
    """One batch dimension per array leaf of ``tree`` from ``dims``, a prefix of it (an int or
    None stands for its whole subtree). ``dims`` may have tuples where ``tree`` has other
    nodes: jax >= 0.12.1 infers out_axes as such tuple trees (a ``_StaticDims`` becomes
    ``()``), jax 0.12.0 with ``tree``'s own node types; both are matched child by child."""
    out = []

    def is_leaf(td):
        return (td.num_nodes, td.num_leaves) == (1, 1)

    def walk(td, d):
        if d is None or is_leaf(jax.tree_util.tree_structure(d)):  # one dim for the subtree
            out.extend([d] * td.num_leaves)
            return
        children = jax.tree_util.tree_flatten(d, is_leaf=lambda c: c is not d)[0]
        if is_leaf(td) or len(children) != len(td.children()):
            raise AssertionError(f"batch dims {dims!r} are not a prefix of {full}")
        for c, dc in zip(td.children(), children):
            walk(c, dc)

    full = jax.tree_util.tree_structure(tree)
    walk(full, dims)
    return out


def _is_float(aval) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.floating) or jnp.issubdtype(aval.dtype, jnp.complexfloating)


def _unsupported(op: str, what: str):
    raise NotImplementedError(
        f"jaxbwd.{op}: {what} is not supported by this op's custom derivative"
    )


if _HAVE_HIJAX:
    _Zero = _hijax.Zero
    _GradAccum = _hijax.GradAccum

    def _inst(x):
        if isinstance(x, _Zero):
            return jnp.zeros(x.aval.shape, x.aval.dtype)
        return x

    def _is_zero(x):
        return isinstance(x, _Zero)

    def _all_zero(tree) -> bool:
        return all(_is_zero(x) for x in jax.tree_util.tree_leaves(tree, is_leaf=_is_zero))

    def _inst_tree(tree):
        return jax.tree_util.tree_map(_inst, tree, is_leaf=_is_zero)

    def _accum(accums, cts, avals):
        """Adds each float argument's cotangent to its accumulator, typed as the argument."""
        for acc, ct, aval in zip(accums, cts, avals):
            if isinstance(acc, _GradAccum) and ct is not None and _is_float(aval):
                acc.accum(S.typed_like(ct, aval))

    class _RulesPrim(_hijax.HiPrim):
        """A primitive applying one op's rules (``_Rules``) to the op's dynamic arguments."""

        # Linearised with no input tangent (an op applied to constants inside jax.linearize):
        # the primal alone, with a zero tangent, as JAX's own primitives.
        skip_linearization_on_zero_tangents = True

        def __init__(self, rules: _Rules, in_avals, out_aval):
            self.in_avals = tuple(in_avals)
            self.out_aval = out_aval
            self.params = dict(rules=rules)
            super().__init__()

    def _batched_rules(rules: _Rules, axis_data, dims: tuple) -> _Rules:
        """The rules of the op vmapped over ``dims`` (outputs batched at 0)."""
        vr = _hijax.vmap_rule
        primal = vr(axis_data, rules.primal, dims, 0)
        infer = _batching.infer

        def fwd(*args):
            (out, res), (_, res_dims) = vr(axis_data, rules.fwd, dims, (0, infer))(*args)
            return out, (res, _StaticDims(res_dims))

        def bwd(res, ct):
            res, rd = res
            return _batched_bwd(rules, axis_data, dims, res, rd.dims, ct)

        def tangent(res, tangents):
            res, rd = res
            return vr(axis_data, rules.tangent, (rd.dims, dims), 0)(res, tangents)

        return _Rules(rules.name, primal, fwd, bwd, tangent if rules.tangent is not None else None)

    def _batched_bwd(rules, axis_data, dims, res, res_dims, ct):
        """vmap of the bwd rule; cotangents of unbatched arguments are summed over the batch."""
        # Which cotangents are None, from the vmapped rule: a rule with collectives over the
        # vmapped axis name (batch_norm's axis_name) needs that name bound to be traced.
        probe = jax.eval_shape(_hijax.vmap_rule(axis_data, rules.bwd, (res_dims, 0), 0), res, ct)
        out_axes = tuple(None if p is None else (_batching.sum_axis if d is None else d)
                         for p, d in zip(probe, dims))
        return _hijax.vmap_rule(axis_data, rules.bwd, (res_dims, 0), out_axes, sum_match=True)(res, ct)

    class _Tangent(_RulesPrim):
        """The op's linear map at fixed residuals: forward the tangent rule, transpose the bwd rule."""

        def __init__(self, rules: _Rules, res_avals, t_avals, out_aval):
            super().__init__(rules, (res_avals, t_avals), out_aval)

        def expand(self, res, tangents):
            # Without a tangent rule the map exists only transposed (reverse mode through
            # checkpoint or scan linearises the op); evaluating it forward is forward mode.
            if self.rules.tangent is None:
                _unsupported(self.rules.name, _FORWARD_MODE_WHAT)
            return self.rules.tangent(res, tangents)

        def transpose(self, out_ct, res, tangents):
            if any(isinstance(x, _GradAccum) for x in jax.tree_util.tree_leaves(res)):
                _unsupported(self.rules.name, "transposing the tangent map with respect to its residuals")
            _accum(tangents, self.rules.bwd(res, _inst(out_ct)), self.in_avals[1])

        def jvp(self, primals, tangents):
            # Linear in ts: along dts the JVP is this map again (so reverse mode taken through
            # it, e.g. grad with respect to a jvp's input tangent, transposes it into the bwd
            # rule's kernels); along dres it is the JVP of the tangent formula (second order).
            res, ts = primals
            dres, dts = tangents
            out = self(res, ts)
            parts = []
            if not _all_zero(dts):
                dts = _inst_tree(dts)
                parts.append(_Tangent(self.rules, *_avals_of(res, dts), self.out_aval)(res, dts))
            if not _all_zero(dres):
                if self.rules.tangent is None:
                    _unsupported(self.rules.name, _FORWARD_MODE_WHAT)
                parts.append(jax.jvp(lambda r: self.rules.tangent(r, ts), (res,), (_inst_tree(dres),))[1])
            if not parts:
                return out, _Zero(self.out_aval.to_tangent_aval())
            return out, functools.reduce(jnp.add, parts)

        lin, linearized = _hijax.linearize_from_jvp
        vjp_fwd, vjp_bwd_retval = _hijax.vjp_from_jvp

        def batch(self, axis_data, args, dims):
            res, ts = args
            if not jax.tree_util.tree_leaves(dims):  # nothing batched (jacfwd of jacfwd's inner vmap)
                return self(res, ts), None
            res_dims, t_dims = dims
            rules = self.rules
            vr = _hijax.vmap_rule
            tangent = None if rules.tangent is None else vr(axis_data, rules.tangent, (res_dims, t_dims), 0)

            def bwd(res, ct):
                return _batched_bwd(rules, axis_data, t_dims, res, res_dims, ct)

            new_rules = _Rules(rules.name, rules.primal, rules.fwd, bwd, tangent)
            out = _Tangent(new_rules, *_avals_of(res, ts), _aval_like(self.out_aval, axis_data))
            return out(res, ts), 0

    def _aval_like(aval, axis_data):
        return _hijax.unmap_avals(axis_data, aval, 0)

    def _avals_of(*trees):
        return tuple(jax.tree_util.tree_map(jax.typeof, t) for t in trees)

    class _Fwd(_RulesPrim):
        """The op's fwd rule as one primitive, returning ``(out, res)``: the primal side of
        the op's jvp and linearisation. Reverse mode taken through a JVP's primal output
        (the loss of MeanFlow / consistency-model training, ``u`` of ``u, du = jax.jvp(...)``)
        then runs the op's bwd rule (the kernels, on the residuals) rather than autodiff of
        the fwd rule's formula (for attention, T x S arrays). Where the residuals get a
        cotangent too (the JVP's tangent output differentiated: second order), the VJP is the
        fwd rule's own, through its formula, on the saved inputs.

        The primitive returns only the leaves of ``(out, res)`` that the rule computes;
        :func:`_fwd` puts the op's inputs that it passes through as residuals (x, a weight)
        back around it. As outputs of the equation they would be new values to
        ``jax.checkpoint`` and ``lax.scan``: a policy saving the op's residuals (the dot
        policies in ``jaxbwd.checkpoint_policies``) would save, and a scan over layers stack,
        a copy of every layer's weight.
        """

        def __init__(self, rules: _Rules, in_avals, computed_avals, source: tuple, full_tree):
            super().__init__(rules, in_avals, list(computed_avals))
            self.source, self.full_tree = source, full_tree  # source[j]: input leaf of output leaf j, or None

        def _computed(self, full) -> list:
            leaves = jax.tree_util.tree_leaves(full, is_leaf=_is_zero)
            return [x for x, s in zip(leaves, self.source) if s is None]

        def _full(self, computed, args, fill=None):
            """``(out, res)`` from the computed leaves and the arguments (``fill(j)`` in place
            of the passed-through leaf ``j``, when given: zero cotangents)."""
            flat_args, it = jax.tree_util.tree_leaves(args), iter(computed)
            return jax.tree_util.tree_unflatten(self.full_tree, [
                next(it) if s is None else (flat_args[s] if fill is None else fill(s))
                for s in self.source])

        def expand(self, *args):
            return self._computed(self.rules.fwd(*args))

        def vjp_fwd(self, nzs_in, *args):
            computed = self._computed(self.rules.fwd(*args))
            return computed, (computed, args)

        def vjp_bwd(self, saved, outgrad, *arg_accums):
            computed, args = saved
            res = self._full(computed, args)[1]
            flat_args = jax.tree_util.tree_leaves(args)
            # A passed-through leaf's cotangent reaches its input outside this equation.
            ct_out, ct_res = self._full(list(outgrad), args,
                                        fill=lambda s: _Zero(jax.typeof(flat_args[s]).to_tangent_aval()))
            if _all_zero(ct_res):
                cts = self.rules.bwd(res, _inst(ct_out))
            else:
                _, vjp = jax.vjp(self.rules.fwd, *args)
                cts = vjp((_inst(ct_out), _inst_tree(ct_res)))
            _accum(arg_accums, cts, self.in_avals)

        def jvp(self, primals, tangents):
            full, full_dot = jax.jvp(self.rules.fwd, primals, tuple(_inst_tree(tangents)))
            return self._computed(full), self._computed(full_dot)

        lin, linearized = _hijax.linearize_from_jvp

        def batch(self, axis_data, args, dims):
            if all(d is None for d in dims):
                return self(*args), [None] * len(self.out_aval)
            rules = _batched_rules(self.rules, axis_data, tuple(dims))
            out, (res, res_dims) = _fwd(rules, args)
            # one dim per array leaf of (out, res) (a None in res, an absent argument, has none)
            full_dims = _leaf_dims((out, res), (0, res_dims.dims))
            return self._computed((out, res)), [d for d, s in zip(full_dims, self.source) if s is None]

    def _fwd(rules: _Rules, args):
        """``rules.fwd(*args)`` bound as a :class:`_Fwd`, with the inputs it passes through as
        residuals put back around the equation."""
        jaxpr, shapes = jax.make_jaxpr(rules.fwd, return_shape=True)(*args)
        source = _passed_through(jaxpr)
        computed_avals = [a for a, s in zip(jaxpr.out_avals, source) if s is None]
        in_avals = [None if a is None else jax.typeof(a) for a in args]
        prim = _Fwd(rules, in_avals, computed_avals, source, jax.tree_util.tree_structure(shapes))
        return prim._full(prim(*args) if computed_avals else [], args)

    class _Op(_RulesPrim):
        """One op application: grad through its fwd/bwd rules, jvp through ``_Tangent``."""

        def expand(self, *args):
            return self.rules.primal(*args)

        def vjp_fwd(self, nzs_in, *args):
            return self.rules.fwd(*args)

        def vjp_bwd(self, res, outgrad, *arg_accums):
            _accum(arg_accums, self.rules.bwd(res, _inst(outgrad)), self.in_avals)

        def _tangent_in(self, tangents):
            return tuple(
                None if a is None or not _is_float(a) else _inst(t)
                for a, t in zip(self.in_avals, tangents)
            )

        def _apply_tangent(self, res, tangents):
            ts = self._tangent_in(tangents)
            t_out_aval = self.out_aval.to_tangent_aval()
            prim = _Tangent(self.rules, *_avals_of(res, ts), t_out_aval)
            return prim(res, ts)

        def jvp(self, primals, tangents):
            out, res = _fwd(self.rules, primals)
            return out, self._apply_tangent(res, tangents)

        def lin(self, nzs_in, *primals):
            return _fwd(self.rules, primals)

        def linearized(self, res, *tangents):
            return self._apply_tangent(res, tangents)

        def batch(self, axis_data, args, dims):
            if all(d is None for d in dims):
                return self(*args), None
            rules = _batched_rules(self.rules, axis_data, tuple(dims))
            in_avals = [None if a is None else jax.typeof(a) for a in args]
            out_aval = _aval_like(self.out_aval, axis_data)
            return _Op(rules, in_avals, out_aval)(*args), 0


# Every op name a custom_op carries (jaxbwd's ops at import, user ops when defined): the
# names op_of_equation can return, which jaxbwd.checkpoint_policies.save_ops accepts.
OP_NAMES: set[str] = set()
_CALLS: contextvars.ContextVar[Optional[list]] = contextvars.ContextVar("jaxbwd_op_calls", default=None)


@contextlib.contextmanager
def recording_calls():
    """Yields a list that collects, in call order, the names of the ops applied (traced)
    inside the block, on every jax version: where code wrapping an op needs its name."""
    names: list = []
    token = _CALLS.set(names)
    try:
        yield names
    finally:
        _CALLS.reset(token)


def op_of_equation(params: dict) -> Optional[str]:
    """The name of the op whose primal (or fwd rule) an equation applies, given the params a
    ``jax.checkpoint`` policy receives with it; None for any other equation, and on
    jax < 0.12, where the ops are ``jax.custom_vjp`` functions whose fwd rules remat traces
    into their own equations."""
    if not _HAVE_HIJAX:
        return None
    p = params.get("_prim")
    return p.rules.name if isinstance(p, (_Op, _Fwd)) else None


# ------------------------------------------------------------------------- the decorator
class custom_op:
    """A drop-in for ``jax.custom_vjp`` that also carries a tangent (JVP) rule.

    ``defvjp(fwd, bwd)`` as for ``jax.custom_vjp``; ``deftangent(tangent)`` with
    ``tangent(*nondiff_args, res, *tangents) -> out_tangent``, linear in the tangents,
    computed from the fwd rule's residuals only (so a JVP that is transposed, e.g. inside
    ``lax.scan``, saves what the VJP saves).

    A call returns what ``fun`` returns (one array: its shape and dtype).

    Raises:
      NotImplementedError: naming the op, for forward-mode differentiation (``jax.jvp``,
        ``jax.linearize``, ``jax.jacfwd``) of an op without a tangent rule, or of any op on
        jax < 0.12 (no hijax primitive); for a rule that runs a Pallas kernel in interpret
        mode inside a ``jax.shard_map`` with ``check_vma=True``.
    """

    def __init__(self, fun: Callable, nondiff_argnums: Sequence[int] = (), name: Optional[str] = None,
                 allow_rank_promotion: bool = True):
        self.fun = fun
        # jaxbwd's own rules trace under JAX's default rank promotion (_ranks_allowed); a
        # user's rules (define_op) keep the caller's setting, which checks their code.
        self._ranks = _ranks_allowed if allow_rank_promotion else (lambda rule: rule)
        self.nondiff_argnums = tuple(sorted(nondiff_argnums))
        self.name = name or fun.__name__.lstrip("_")  # the public op's name, for errors
        OP_NAMES.add(self.name)
        self.fwd = self.bwd = self.tangent = None
        functools.update_wrapper(self, fun)

    def defvjp(self, fwd: Callable, bwd: Callable) -> None:
        self.fwd, self.bwd = fwd, bwd

    def deftangent(self, tangent: Callable) -> None:
        self.tangent = tangent

    def _split(self, args):
        nondiff = tuple(args[i] for i in self.nondiff_argnums)
        dyn = tuple(a for i, a in enumerate(args) if i not in self.nondiff_argnums)
        return nondiff, dyn

    def _full(self, nondiff, dyn):
        it_n, it_d = iter(nondiff), iter(dyn)
        n = len(nondiff) + len(dyn)
        return tuple(next(it_n) if i in self.nondiff_argnums else next(it_d) for i in range(n))

    def _rules(self, nondiff) -> _Rules:
        n = len(nondiff)
        # fun and fwd take the full argument list; bwd and tangent take nondiff args first.
        full = lambda f: (lambda *a: f(*self._full(a[:n], a[n:])))
        primal = functools.partial(full(self._ranks(self.fun)), *nondiff)
        fwd = _differentiable(full(self._ranks(self.fwd)), nondiff, forwards_inputs=True)
        bwd = _differentiable(self._ranks(self.bwd), nondiff)
        tangent = None
        if self.tangent is not None:
            rule = self._ranks(self.tangent)
            tangent = _differentiable(lambda *a: rule(*a[:n], a[n], *a[n + 1]), nondiff)
        return _Rules(self.name, primal, fwd, bwd, tangent)

    def __call__(self, *args):
        calls = _CALLS.get()
        if calls is not None:
            calls.append(self.name)
        nondiff, dyn = self._split(args)
        # Inside a vma-checked shard_map, operands vary over the same manual axes, as JAX's
        # own primitives make them: AD then transposes the cast of an invariant weight into
        # the psum of its gradient, which the bwd rule computes per device.
        dyn, vma = S.vary_together(dyn)
        rules = self._rules(nondiff)
        impls = [i for i in map(_impl_of, nondiff) if i is not None]
        if vma is not None and any(i.pallas and i.interpret for i in impls):
            guard = functools.partial(_interpreted_under_vma, self.name)
            rules = dataclasses.replace(
                rules, primal=guard("forward", rules.primal), fwd=guard("forward", rules.fwd),
                bwd=guard("backward", rules.bwd),
                tangent=None if rules.tangent is None else guard("forward-mode kernel", rules.tangent))
        if not _HAVE_HIJAX:
            return self._call_custom_vjp(rules, dyn)
        dyn = tuple(a if a is None or isinstance(a, jax.Array) else jnp.asarray(a) for a in dyn)
        in_avals = [None if a is None else jax.typeof(a) for a in dyn]
        # Traced (not eval_shape) so that the output's aval keeps the inputs' varying manual
        # axes inside a vma-checked shard_map.
        out_aval = jax.make_jaxpr(rules.primal)(*dyn).out_avals[0]
        return _Op(rules, in_avals, out_aval)(*dyn)

    def _call_custom_vjp(self, rules, dyn):
        def primal(*a):
            return rules.primal(*a)

        primal.__name__ = primal.__qualname__ = self.name  # jaxprs show custom_vjp_call[name=<op>]
        f = jax.custom_vjp(primal)
        avals = [None if a is None else jax.typeof(a) for a in dyn]
        f.defvjp(rules.fwd, lambda res, ct: tuple(S.typed_like(c, a) for c, a in zip(rules.bwd(res, ct), avals)))
        error = NotImplementedError(
            f"jaxbwd.{self.name}: forward-mode differentiation (jax.jvp, jax.jacfwd) needs jax >= 0.12, "
            f"got jax {jax.__version__}; reverse mode (jax.grad, jax.vjp, grad of grad) and forward over "
            "reverse (jax.hessian, jax.jvp of jax.grad) work")
        if _jvp_of_op(dyn):
            # Said here, while tracing: under jit JAX would fail only when it compiles the
            # staged jvp, with its generic TypeError for custom_vjp functions.
            raise error
        try:
            return f(*dyn)
        except TypeError as e:
            if any(m in str(e) for m in _FORWARD_MODE_ERRORS):
                raise error from e
            raise
