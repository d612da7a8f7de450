"""Partitioning of the ops under ``jit`` with sharded operands: ``partitioned``, and the
few helpers the ops use for what runs inside it (vocab-parallel collectives, matmul's
out_sharding, operands of a user's vma-checked shard_map).

XLA cannot partition a ``pallas_call``: handed sharded operands, the SPMD partitioner
gathers each whole operand onto every device around the kernel. The ops therefore
partition themselves, from one layout rule per op (a signature, below), in one of two
ways depending on the mesh set with ``jax.set_mesh``:

* Explicit axes (``AxisType.Explicit``): operand shardings are part of the abstract value
  (``jax.typeof(x).sharding.spec``), so an op reads them while it is traced and runs its
  whole custom_vjp (forward and Pallas/XLA backward) per shard under ``jax.shard_map``
  with the operands' own specs. ``shard_map`` batches under vmap, nests in
  grad/remat/scan, and its transpose does the one reduction the backward needs: a
  replicated operand (a norm's weight, a bias) gets its per-shard f32 partial gradients
  summed with a psum (an all-reduce) over the axes that shard the rows. Activations are
  never gathered for the layouts an op can split. Both implementations take this path
  (explicit mode would otherwise refuse the jnp formulas on some layouts).
* Auto axes (plain ``jax.jit(..., in_shardings=...)`` under ``jax.set_mesh``): shardings
  are decided by XLA after tracing, so the op is handed to XLA's (Shardy) partitioner
  through ``jax.experimental.custom_partitioning``, whose callback receives the operands'
  shardings and applies the same layout rule (see ``_auto_partitioned``: a custom_vjp
  over a partitioned forward and a partitioned backward that recomputes the op's
  forward on its shard, with custom_vmap falling back to the unpartitioned op under
  vmap, since custom_partitioning has neither AD nor batching rules). Both
  implementations take it: left to itself, XLA gathers around a kernel, and even the
  jnp formulas lose a sequence sharding where they flatten rows. Not for operands with
  symbolic shapes (``jax.export``), nor with ``config.use(custom_partitioning=False)``
  (``jax.export`` refuses custom_partitioning's Python callbacks): the op then runs as
  whole-array code that XLA partitions like any other.

Design notes:

* ``check_vma=False``: the bodies rely on the unchecked transpose, which divides output
  cotangents over, and psums input cotangents over, the axes an operand does not
  mention: exactly the sum of weight-gradient partials, with no per-op bookkeeping
  (``replicated_cotangent`` and the Auto path's division follow the same convention).
* Without a mesh, or with all axes Manual (inside a user's shard_map over every axis),
  ``partitioned`` calls the op unchanged. Inside a user's shard_map over some axes of an
  explicit mesh, the op partitions over the remaining Explicit axes (a nested shard_map
  over just those; when no operand is sharded over them, the op runs directly under vma
  checking, else in a nested shard_map with every operand replicated). With every operand
  replicated under explicit axes (no user shard_map) it runs the op whole under
  ``jax.sharding.auto_axes``. A mesh mixing Explicit and Auto axes with an
  operand sharded is refused with a ValueError: neither path applies there. Auto axes
  beside Manual ones (a user's shard_map over part of an Auto mesh) are not partitioned:
  the op runs unchanged and XLA handles it as it would any call.
* A layout the op cannot run on shards alone (a reduced axis sharded: a norm over a
  sharded hidden dim, a softmax over a sharded axis, attention over a sharded sequence; two
  a mesh axis that already shards another dimension; axes that do not divide a dimension, e.g.
  one kv head with query heads sharded) is not left to XLA: under an explicit mesh the
  jnp formulas and the Pallas kernels fail to trace on such operands (scan carries change
  type, sharded refs cannot be indexed). ``partitioned`` instead reshards, with
  ``jax.sharding.reshard``, only the offending dimensions to replicated (the one
  all-gather this module adds, and only for such layouts) and keeps every other dimension
  sharded; the output is then replicated along the gathered dimension.
* An op may also communicate inside the body: cross_entropy with the class axis sharded
  (logits from a vocabulary-sharded output projection) runs vocab-parallel, combining
  per-shard logsumexp, label logit and logit sum with ``pmax``/``psum`` over the axes
  that shard the classes (``axes_of``); its backward needs no communication (under Auto
  axes the recomputed forward repeats the collectives). embed with the table sharded
  over the vocabulary likewise looks up the ids its shard holds and psums the rows
  (Megatron-LM's vocab-parallel embedding); its backward scatters into the local shard
  only. Both restore their output's cotangent with ``replicated_cotangent``.
* Not covered: sequence-parallel attention (ring attention: a sharded sequence is
  gathered); gated_linear_unit over a sharded hidden dim (gate and up are the two halves of the last
  axis, so a shard holds only gates or only ups: gathered); under Auto axes, a vmapped
  op, forward mode and second derivatives run the op unpartitioned (custom_partitioning
  has no AD or batching rule; XLA partitions the plain computation itself, and may gather
  around a kernel); under explicit axes, vmap over a dimension
  sharded on one mesh axis around an op that shards another dimension on a second axis
  runs on the XLA path, while the Pallas kernels fail to trace in interpret mode (JAX's
  interpreter meets a mesh that is part Explicit, part Manual; untested on GPU). matmul, scale, residual_add, reshape and row_slice
  have XLA backwards and are partitioned by XLA itself (matmul over output columns and
  rows included; under explicit axes it states its ``out_sharding``).

Each op states its layout with a small einsum-like signature, e.g. ``"...D,D->...D"``
for rms_norm: one letter per dimension, ``...`` for any number of leading dimensions
(all operands with ``...`` share them). Lower-case letters are dimensions the op is
independent along: they may be sharded, and every operand carrying the same letter is
given the same mesh axes (the first operand sharding it decides; an operand that is
replicated there is resharded to match, which is a local slice); an ``axes_of`` letter is
one the op reduces over itself with collectives. Upper-case letters are
dimensions the op reduces or mixes over (the normalised axis, the softmax axis,
attention's sequence and head dims): they are gathered if sharded. Leading ``...``
dimensions align from the right across operands.

Source (for every function here): Shoeybi et al., "Megatron-LM" (2019) for the tensor-
and vocab-parallel layouts; JAX's sharded-computation guides (``jax.shard_map``, explicit
sharding, ``jax.experimental.custom_partitioning``) for the mechanisms.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxbwd import config
from jaxbwd.vjp._base import is_static_shape

__all__ = ["partitioned", "whole", "per_shard", "plan", "check_signature", "spec", "matmul_out_spec",
           "replicated_cotangent", "vary_together", "vary_like", "operands_mesh"]

_ELLIPSIS = "."


def _parse_term(term: str):
    term = term.strip()
    if term.startswith("..."):
        return (_ELLIPSIS,) + tuple(term[3:])
    if "..." in term:
        raise ValueError(f"jaxbwd.sharding: '...' must lead a term, got {term!r}")
    return tuple(term)


def _parse(signature: str):
    ins, outs = signature.split("->")
    return [_parse_term(t) for t in ins.split(",")], [_parse_term(t) for t in outs.split(",")]


def check_signature(signature, where: str) -> tuple[int, int]:
    """(inputs, outputs) of a layout signature (see the module docstring), checked.

    Args:
      signature: the signature string, e.g. ``"...D,D->...D"``.
      where: the caller's name for the message (``"jaxbwd.define_op"``).

    Returns:
      ``(number of input terms, number of output terms)``, Python ints.

    Raises:
      ValueError: not ``"terms->terms"`` with each term an optional leading ``...`` and
        ASCII letters (no lower-case letter twice in a term), naming ``where``.
    """
    def bad(why):
        return ValueError(f"{where}: sharding must be a layout signature such as '...D,D->...D' (one letter "
                          f"per dimension, '...' for leading ones; see jaxbwd.sharding), got {signature!r}: {why}")

    if not isinstance(signature, str) or signature.count("->") != 1:
        raise bad("expected one '->'")
    for side in signature.split("->"):
        for term in side.split(","):
            term = term.strip()
            letters = term[3:] if term.startswith("...") else term
            lower = [c for c in letters if c.islower()]  # split dims: one mesh axis each
            if not letters.isascii() or not (letters.isalpha() or letters == "") or len(set(lower)) < len(lower):
                raise bad(f"term {term!r} is not '...' and/or letters (lower-case ones distinct)")
    ins, outs = _parse(signature)
    return len(ins), len(outs)


def _mesh():
    """The abstract mesh set with ``jax.set_mesh`` (or a shard_map's), None without one."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh is None or getattr(mesh, "empty", True) or not mesh.axis_names else mesh


def _explicit_mesh():
    mesh = _mesh()
    if mesh is None:
        return None
    # Explicit axes, possibly beside Manual ones (inside a user's shard_map over some axes):
    # the op partitions over the Explicit axes; the Manual ones are already per-device.
    types = set(mesh.axis_types)
    if jax.sharding.AxisType.Explicit not in types or jax.sharding.AxisType.Auto in types:
        return None
    return mesh


def _varying(x) -> frozenset:
    """The manual mesh axes ``x`` varies over inside a vma-checked shard_map (else empty)."""
    return frozenset(getattr(getattr(jax.typeof(x), "manual_axis_type", None), "varying", None) or ())


def _explicit_axes(mesh) -> frozenset:
    return frozenset(n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == jax.sharding.AxisType.Explicit)


def vary_together(arrays):
    """(arrays, manual axis type) with every array varying over the same manual mesh axes.

    Inside a user's vma-checked ``shard_map``, arrays carry the set of manual axes they
    vary over. An op mixing a varying activation with an invariant weight must make the
    weight vary too (``pcast(..., to="varying")``), as JAX's own ops do implicitly: then
    AD transposes that cast into the psum of the weight's per-device gradient, and a
    kernel's outputs can declare how they vary. Returns the arrays unchanged and None
    when nothing varies (everywhere else). ``None`` entries pass through.

    Args: arrays, a sequence of arrays or None. Returns: ``(tuple of arrays, the manual
    axis type they share or None)``, shapes and dtypes unchanged. Raises nothing.
    """
    varying = frozenset().union(*(_varying(a) for a in arrays if a is not None))
    if not varying:
        return tuple(arrays), None
    out = vary_like(tuple(arrays), *(a for a in arrays if a is not None))
    mat = next(jax.typeof(a).manual_axis_type for a in arrays if a is not None)
    return out, type(mat)(varying=varying)


def vary_like(tree, *refs):
    """``tree``'s arrays made to vary over the manual axes any of ``refs`` varies over.

    A ``lax.scan`` carry initialised with constants inside a user's vma-checked shard_map
    must vary as the carry its body produces from ``refs``; elsewhere a no-op.

    Args: tree, a pytree of arrays; refs, arrays. Returns: ``tree`` with the same shapes
    and dtypes. Raises nothing.
    """
    varying = frozenset().union(*(_varying(r) for r in refs))
    if not varying:
        return tree

    def cast(a):
        missing = varying - _varying(a)
        return jax.lax.pcast(a, tuple(sorted(missing)), to="varying") if missing else a

    return jax.tree_util.tree_map(cast, tree)


def typed_like(ct, aval):
    """A cotangent ``ct`` resharded to its primal's explicit sharding (``aval``'s) where the
    two differ: a rule computes it in the output's sharding (``residual_add``'s dy for an
    operand sharded otherwise), and JAX's AD accepts only the primal's type. Elsewhere a
    no-op."""
    want = getattr(aval, "sharding", None)
    mesh = getattr(want, "mesh", None)
    if ct is None or mesh is None or jax.sharding.AxisType.Explicit not in set(getattr(mesh, "axis_types", ())):
        return ct
    if _spec_of(ct, ct.ndim) == _normalised(want.spec, ct.ndim):
        return ct
    return jax.sharding.reshard(ct, want.spec)


def _operands_mesh(args):
    """With no mesh set: the mesh of explicitly sharded operands, if any (else None)."""
    if _mesh() is not None:
        return None
    for a in args:
        mesh = getattr(getattr(jax.typeof(a), "sharding", None), "mesh", None) if a is not None else None
        if mesh is not None and jax.sharding.AxisType.Explicit in set(getattr(mesh, "axis_types", ())) \
                and any(_spec_of(a, a.ndim)):
            return getattr(mesh, "abstract_mesh", mesh)
    return None


def operands_mesh(*args):
    """A context entering the mesh of explicitly sharded operands when no mesh is set
    (``jit`` of arrays placed with explicit-axis NamedShardings, without ``jax.set_mesh``),
    so that an op partitions as under ``jax.set_mesh``; a no-op otherwise.

    Args: the operands (arrays or None). Returns: a context manager. Raises nothing."""
    own = _operands_mesh(args)
    return contextlib.nullcontext() if own is None else jax.sharding.use_abstract_mesh(own)


def _axes_kw(axes_of: Optional[str], axes: tuple = ()) -> dict:
    """The ``axes=`` keyword of an op that communicates itself (``axes_of``), else none."""
    return {} if axes_of is None else {"axes": tuple(axes)}


def _traced_op(fn: Callable, args):
    """Traces ``fn(*args)`` once: (its jaxpr, the name of the first op it applies or None)."""
    from jaxbwd.vjp._derivatives import recording_calls

    present = [i for i, a in enumerate(args) if a is not None]
    with recording_calls() as names:
        jaxpr = jax.make_jaxpr(lambda *a: fn(*_refill(args, present, a)))(*[args[i] for i in present])
    return jaxpr, (names[0] if names else None)


def _static(args) -> bool:
    return all(is_static_shape(a.shape) for a in args if a is not None)


def _refuse_unpartitionable(signature, fn, args, extra):
    """ValueError naming the op for sharded operands where neither path applies: a mesh
    mixing Explicit and Auto axes, or symbolic shapes on an explicit mesh."""
    mesh = _mesh()
    if mesh is None or not any(a is not None and any(_spec_of(a, a.ndim)) for a in args):
        return
    if {jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto} <= set(mesh.axis_types):
        kinds = ", ".join(f"{n}={t.name}" for n, t in zip(mesh.axis_names, mesh.axis_types))
        why = (f"got an operand sharded on a mesh that mixes axis types ({kinds}); jaxbwd partitions under "
               "meshes whose axes are all Explicit or all Auto (Manual axes of an enclosing shard_map may sit "
               "beside Explicit ones)")
    elif _explicit_mesh() is not None and not _static(args):
        # JAX's own jnp code exports there but cannot be called (its shape refinement fails);
        # through the op's shard_map the call crashes the process instead
        why = ("got an operand sharded on an explicit mesh with symbolic shapes (jax.export); JAX cannot call "
               "such a module, so it is refused here: export with static shapes, or with the operands "
               "replicated, or under a mesh of Auto axes")
    else:
        return
    try:
        name = _traced_op(lambda *a: fn(*a, **extra), args)[1]
    except Exception:  # the op's own checks fail on these operands: they report it when it runs
        name = None
    raise ValueError(f"jaxbwd.{name or f'op with layout {signature!r}'}: {why}")


def _axes(entry) -> tuple:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _refill(args, present, values):
    """``args`` with the entries at ``present`` (the non-None operands) replaced by ``values``."""
    out = list(args)
    for i, v in zip(present, values):
        out[i] = v
    return out


def _normalised(spec, ndim):
    """A PartitionSpec as one tuple of mesh axes per dimension, padded to ``ndim``."""
    spec = tuple(spec or ())
    return tuple(_axes(e) for e in spec) + ((),) * (ndim - len(spec))


def _spec_of(x, ndim):
    return _normalised(getattr(getattr(jax.typeof(x), "sharding", None), "spec", ()), ndim)


def _expand(term, ndim):
    """term letters -> one name per dimension (ellipsis dims named '.-2', '.-1', from the right)."""
    if term and term[0] == _ELLIPSIS:
        n_lead = ndim - (len(term) - 1)
        if n_lead < 0:
            return None
        return tuple(f".{i - n_lead}" for i in range(n_lead)) + term[1:]  # right-aligned leads
    return term if len(term) == ndim else None


def _layout(signature: str, args, mesh=None, specs=None):
    """(letters, dims, in_specs, out_specs) under the current explicit mesh, or None.

    ``mesh``/``specs`` (one normalised spec per operand) are given by the Auto-axes
    partitioner, which learns shardings at compile time instead of from the types.

    ``letters`` maps each lower-case dimension that stays sharded to its mesh axes; the
    ``in_specs`` are what every operand must be resharded to before the op runs on shards:
    its own spec, less the axes on dimensions the op cannot split (upper-case ones, ones
    another operand shards differently, ones the axes do not divide).
    """
    mesh = _explicit_mesh() if mesh is None else mesh
    if mesh is None:
        return None
    ins, outs = _parse(signature)
    if len(ins) != len(args):
        raise ValueError(f"jaxbwd.sharding: signature {signature!r} has {len(ins)} inputs, got {len(args)}")
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    if specs is None:
        specs = [None if a is None else _spec_of(a, a.ndim) for a in args]
    dims, extent = [], {}
    for term, a in zip(ins, args):
        names = None if a is None else _expand(term, len(a.shape))
        if a is not None and names is None:
            return None  # rank does not fit the signature: the op's own checks report it
        dims.append(names)
        for name, size in zip(names or (), getattr(a, "shape", ())):
            extent.setdefault(name, set()).add(size)
    letters: dict = {}
    used: set = set()
    for names, sp in zip(dims, specs):
        for name, axes in zip(names or (), sp if names else ()):
            if not axes or name.isupper() or name in letters or used & set(axes):
                continue  # upper-case: reduced over, gathered; the first operand decides
            if any(size % math.prod(sizes[ax] for ax in axes) for size in extent[name]):
                continue  # e.g. 2 kv heads cannot follow 8 query heads over 4 devices
            letters[name] = axes
            used |= set(axes)
    entry = lambda axes: None if not axes else axes[0] if len(axes) == 1 else axes  # noqa: E731
    in_specs = []
    for names, a in zip(dims, args):
        if names is None:
            in_specs.append(None)
            continue
        in_specs.append(P(*(entry(letters.get(n, ())) for n in names)))
    ref = next(d for d in dims if d is not None)
    n_lead = sum(1 for n in ref if n.startswith("."))
    out_specs = []
    for term in outs:
        names = _expand(term, n_lead + len(term) - 1) if term and term[0] == _ELLIPSIS else term
        out_specs.append(P(*(entry(letters.get(n, ())) for n in names)))
    return letters, dims, tuple(in_specs), (out_specs[0] if len(out_specs) == 1 else tuple(out_specs))


def spec(x) -> Optional[P]:
    """``x``'s PartitionSpec (padded to its rank) when it is typed on an explicit-sharding
    mesh (set with ``jax.set_mesh``, or carried by the array itself), else None.

    Passed as ``out_sharding`` to XLA contractions (matmul's forward and backward), so
    that a result or gradient keeps the intended sharding, as JAX's own transpose of
    ``dot_general`` does (explicit mode otherwise refuses a contraction over a sharded
    dimension as ambiguous).

    Args: x, an array or tracer of any shape. Returns: a PartitionSpec of length
    ``x.ndim`` or None. Raises nothing.
    """
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    if _explicit_mesh() is None and jax.sharding.AxisType.Explicit not in set(getattr(mesh, "axis_types", ()) or ()):
        return None  # neither an explicit mesh set nor an operand typed on one
    return P(*(None if not axes else axes[0] if len(axes) == 1 else axes for axes in _spec_of(x, x.ndim)))


def matmul_out_spec(x, w) -> Optional[P]:
    """Output spec of ``x [..., K] @ w [K, M]`` under an explicit mesh, else None.

    Leading dimensions keep x's sharding, M keeps w's (unless its axes already shard a
    leading dimension); a sharded K is summed over (XLA inserts the all-reduce of a
    row-parallel matmul, Megatron-LM's "g" operator) and leaves the result replicated
    along those axes.

    Args: x [..., K], w [K, M], any float dtypes. Returns: a PartitionSpec of rank
    ``x.ndim`` or None. Raises nothing. Source: Shoeybi et al., "Megatron-LM" (2019), for
    the column/row-parallel layouts.
    """
    sx, sw = spec(x), spec(w)
    if sx is None:
        return None
    lead = tuple(sx)[:-1]
    used = {a for e in lead for a in _axes(e)}
    m = tuple(sw)[1]
    return P(*lead, None if used & set(_axes(m)) else m)


def replicated_cotangent(ct, axes: tuple):
    """The cotangent of an output replicated over ``axes``, as a body of ``partitioned`` must use it.

    shard_map's unchecked transpose hands each of the ``n`` devices along ``axes`` the
    output's cotangent divided by ``n`` (it cannot know the copies are equal); an op whose
    forward made the copies equal with a collective (a psum over a vocabulary shard) wants
    the whole cotangent back. The divided values are equal on every device, so scaling by
    ``n`` restores them without a collective (exactly for a power-of-two ``n``, within
    an ulp otherwise).

    Args: ct, the cotangent (any shape, float dtype); axes, a tuple of mesh axis names
    (inside the body's shard_map). Returns: ``ct`` times the number of devices along
    ``axes``, same shape and dtype. Raises: JAX's NameError for an axis not bound there.
    """
    if not axes:
        return ct
    return ct * jax.lax.psum(1, axes)  # the number of devices along ``axes``


def plan(signature: str, *args) -> Optional[tuple]:
    """(in_specs, out_specs) when the op will run per shard under ``shard_map``, else None.

    None means: no explicit mesh, or no dimension the op can split is sharded; the op then
    runs whole (after gathering any dimension it cannot split, see ``partitioned``).
    ``None`` arguments (absent optional operands) are skipped.

    Args: signature, the layout signature; args, the operands (any shapes). Returns: a
    tuple ``(in_specs, out_specs)`` of PartitionSpecs (one per operand, ``None`` for an
    absent one), or None. Raises: ValueError for a malformed signature.
    """
    layout = _layout(signature, args)
    if layout is None or not layout[0]:
        return None
    return layout[2], layout[3]


def per_shard(signature: str, *args) -> bool:
    """Whether ``partitioned`` will run the op per shard: an explicit-axes plan, or any
    layout under Auto axes, partitioned at compile time (static shapes, custom_partitioning
    on); like ``partitioned``, on the operands' own mesh when no mesh is set.

    Args:
      signature: the op's layout signature (module docstring); args: its array operands
        (``None`` for an absent optional one), any shapes and dtypes.

    Returns:
      A Python bool, decided while tracing. Raises: ValueError for a malformed signature.
    """
    with operands_mesh(*args):
        return plan(signature, *args) is not None or (_auto_mesh() is not None and _custom_partitioned(args))


def partitioned(signature: str, fn: Callable, *args, axes_of: Optional[str] = None) -> Any:
    """``fn(*args)``, run per shard under ``jax.shard_map`` when ``plan`` finds a layout.

    ``fn`` is the op's custom_vjp with its static parameters bound; ``args`` its array
    operands (``None`` for an absent optional one). Replicated operands' gradients are
    summed over the sharded axes by shard_map's transpose; apart from what ``fn`` itself
    does for ``axes_of``, nothing else communicates.

    ``axes_of``: a lower-case letter of the signature that ``fn`` itself communicates
    over. ``fn`` is then called with ``axes=`` the tuple of mesh axes that shard that
    dimension (``()`` when it is not sharded, or outside a mesh) and must reduce over them
    with collectives; outputs without that letter are replicated over those axes.
    vocab-parallel cross_entropy and embed use it.

    Under a mesh with Auto axes (set with ``jax.set_mesh``) the op is handed to XLA's
    partitioner through ``custom_partitioning`` instead (see ``_auto_partitioned``), unless
    shapes are symbolic or ``config.custom_partitioning()`` is off.

    Args:
      signature: the layout signature (module docstring), e.g. ``"...D,D->...D"``.
      fn: ``fn(*args) -> array`` (one output), the op with its static parameters bound.
      args: the array operands, any shapes and dtypes the op takes; ``None`` for an absent
        optional one (passed to ``fn`` as ``None``).
      axes_of: see above.

    Returns:
      ``fn``'s output, with the sharding the signature gives its dimensions (replicated
      along any dimension that had to be gathered).

    Raises:
      ValueError: a malformed signature, an operand whose rank the signature cannot take,
        a sharded operand on a mesh mixing Explicit and Auto axes, or one with symbolic
        shapes on an explicit mesh (these two naming the op); ``fn``'s own errors otherwise.
    """
    if _auto_mesh() is not None:
        if _custom_partitioned(args):
            return _auto_partitioned(signature, fn, args, axes_of)
        # symbolic shapes (jax.export): custom_partitioning's call needs static ones; or
        # switched off: whole-array code that XLA partitions (gathering around a kernel)
        return fn(*args, **_axes_kw(axes_of))
    if _operands_mesh(args) is not None:  # explicitly sharded operands, no mesh set: use theirs
        with operands_mesh(*args):
            return partitioned(signature, fn, *args, axes_of=axes_of)
    extra = lambda letters: _axes_kw(axes_of, letters.get(axes_of, ()))  # noqa: E731
    _refuse_unpartitionable(signature, fn, args, extra({}))
    args, vma = vary_together(args)  # inside a user's vma-checked shard_map
    layout = _layout(signature, args)
    if layout is None:
        return fn(*args, **extra({}))
    letters, _, in_specs, out_specs = layout
    present = [i for i, a in enumerate(args) if a is not None]
    operands = []
    for i in present:
        a, want = args[i], tuple(_axes(e) for e in in_specs[i])
        if _spec_of(a, a.ndim) != want + ((),) * (a.ndim - len(want)):
            # replicated -> sharded is a local slice; a dimension the op cannot split is
            # gathered here, explicitly (the only all-gather this module ever adds)
            a = jax.sharding.reshard(a, in_specs[i])
        operands.append(a)
    mesh = _explicit_mesh()
    partial = len(_explicit_axes(mesh)) < len(mesh.axis_names)  # inside a user's shard_map
    if not letters and partial:
        # Nothing sharded over the axes the user's shard_map left Explicit: nothing to
        # partition. Not through ``auto_axes``: JAX cannot transpose it inside a partially
        # manual shard_map. Under vma checking the op runs directly (the transpose of an
        # unchecked shard_map would return cotangents that no longer vary over the user's
        # manual axes); otherwise replicated in a shard_map of its own over those axes,
        # where explicit-mode typing cannot reject its internal steps (Pallas's interpreter).
        whole = lambda *ops: fn(*_refill(args, present, ops), **extra({}))  # noqa: E731
        if vma is not None:
            return whole(*operands)
        return jax.shard_map(whole, in_specs=tuple(P() for _ in operands), out_specs=P(),
                             axis_names=_explicit_axes(mesh), check_vma=False)(*operands)
    if not letters:
        # Every operand replicated: no shard to run on. The op runs with the mesh's axes
        # switched to Auto (explicit-mode typing rejects some of its internal steps, e.g.
        # Pallas's interpreter; XLA has nothing to partition in a replicated op).
        def whole(*ops):
            return fn(*_refill(args, present, ops), **extra({}))

        # replicated at any rank (the op may already have reduced its output, e.g. a mean loss)
        out_sharding = jax.tree_util.tree_map(lambda _: P(), out_specs, is_leaf=lambda x: isinstance(x, P))
        return jax.sharding.auto_axes(whole, out_sharding=out_sharding)(*operands)

    def body(*local):
        return fn(*_refill(args, present, local), **extra(letters))

    # Inside a user's shard_map over some axes, only the Explicit ones are ours to take;
    # otherwise leave shard_map its default (under a vmap whose mapped dimension is
    # sharded, that default already excludes the axis the batch holds).
    manual = {"axis_names": _explicit_axes(mesh)} if partial else {}
    return jax.shard_map(
        body, in_specs=tuple(in_specs[i] for i in present), out_specs=out_specs, check_vma=False, **manual,
    )(*operands)


def whole(fn: Callable, *args) -> Any:
    """``fn(*args)`` on operands gathered whole, under explicit axes only.

    For ops whose Pallas kernels do not run per shard yet: under explicit axes a kernel
    handed sharded operands fails to trace (sharded refs cannot be indexed), so each
    operand is resharded to replicated and the op runs as ``partitioned`` runs a replicated
    one (one array out); an output of the first operand's shape is then sliced back to that
    operand's layout (a local slice), any other stays replicated. Under Auto axes XLA
    gathers around the kernel by itself, and without a mesh there is nothing to gather:
    ``fn(*args)`` as is.

    Args:
      fn: ``fn(*args) -> array``, the op with its static parameters bound.
      args: its array operands (no ``None``).

    Returns:
      ``fn(*args)``, in the first operand's layout when it has that operand's shape.
      Raises: ``fn``'s errors.
    """
    if _explicit_mesh() is None and _operands_mesh(args) is None:
        return fn(*args)
    letters = iter("ABCDEFGHIJKLMNOPQRSTUVWXYZ" * 8)  # upper case: never split; may repeat
    with operands_mesh(*args):
        shape = jax.eval_shape(fn, *args).shape
        terms = ["".join(next(letters) for _ in range(n)) for n in [a.ndim for a in args] + [len(shape)]]
        out = partitioned(",".join(terms[:-1]) + "->" + terms[-1], fn, *args)
        layout = spec(args[0]) if tuple(shape) == tuple(args[0].shape) else None
        return out if layout is None else jax.sharding.reshard(out, layout)


# ---------------------------------------------------------------- meshes with Auto axes
def _custom_partitioned(args) -> bool:
    """Under an Auto-axes mesh: whether the op goes through custom_partitioning (static
    shapes, and not switched off in ``config``)."""
    return _static(args) and config.custom_partitioning()


def _auto_mesh():
    """A mesh of Auto axes over more than one device (one device has nothing to split)."""
    mesh = _mesh()
    if mesh is None or math.prod(mesh.axis_sizes) == 1:
        return None
    return mesh if all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types) else None


def _mesh_spec(sharding, mesh):
    """An operand's sharding, as handed to a partition callback, as a PartitionSpec of ``mesh``.

    XLA's propagation may split a mesh axis into sub-axes (a dimension of 2 sharded over
    2 of an axis of 4 devices), a tiling no PartitionSpec spells; JAX's own decoding
    raises on it. Such an operand is read as replicated: the layout then comes from the
    other operands and XLA reshards this one to it (correct, at the cost of a reshard).
    """
    if getattr(sharding, "spec", None) is not None:
        return sharding.spec
    try:  # no public HloSharding -> PartitionSpec conversion
        from jax._src.sharding_impls import parse_flatten_op_sharding

        return parse_flatten_op_sharding(sharding._hlo_sharding, mesh)[0]
    except Exception:
        return P()


def _sdy_rule(terms_in, terms_out):
    """Our signature as a Shardy einsum rule ('... D, D -> ... D') and its upper-case factors."""
    def text(term):
        return " ".join("..." if t == _ELLIPSIS else t for t in term)
    rule = ", ".join(text(t) for t in terms_in) + " -> " + ", ".join(text(t) for t in terms_out)
    upper = []  # in order of first appearance: Shardy wants the special factors sorted
    for t in list(terms_in) + list(terms_out):
        upper += [c for c in t if c.isupper() and c not in upper]
    return rule, upper


def _auto_partitioned(signature: str, fn: Callable, args, axes_of: Optional[str]):
    """The op under a mesh with Auto axes, partitioned at compile time by ``custom_partitioning``.

    With Auto axes the shardings are chosen by XLA after tracing, so the op cannot read
    them; ``jax.experimental.custom_partitioning`` lets XLA's (Shardy) partitioner call
    back with the operands' shardings and take a per-shard lowering. The layout rule is
    the same ``_layout`` as under explicit axes. custom_partitioning has no AD or vmap
    rule, hence the wrapping:

    * a custom_vjp whose forward and backward are each custom_partitioned; the backward
      takes the operands and the output cotangent and recomputes the op's forward on its
      shard before the op's own backward (``jax.vjp`` of ``fn``): saving the op's
      residuals would need a layout for each of them. The price is one extra forward
      (with its collectives, for a vocab-parallel op) per backward, as under remat; the
      memory saved is the op's residuals.
      Gradients of operands replicated along sharded axes (a norm's weight) are psummed
      over those axes, as shard_map's transpose does under explicit axes.
    * ``custom_vmap`` around each: under ``vmap`` the op runs unpartitioned (correct,
      gathered around the kernels), since the callbacks know no batch dimension.
    """
    from jax.experimental.custom_partitioning import custom_partitioning
    from jax.sharding import NamedSharding

    present = [i for i, a in enumerate(args) if a is not None]
    ops = [args[i] for i in present]
    diff = [k for k, a in enumerate(ops) if jnp.issubdtype(a.dtype, jnp.inexact)]
    ins, outs = _parse(signature)
    if len(outs) != 1:
        raise ValueError(f"jaxbwd.sharding: the Auto-axes path takes one output, got signature {signature!r}")
    if any(_expand(ins[i], ops[k].ndim) is None for k, i in enumerate(present)):
        return fn(*args, **_axes_kw(axes_of))  # rank misfit: the op's checks report it

    def call(local, axes=()):
        return fn(*_refill(args, present, local), **_axes_kw(axes_of, axes))

    # One trace of the op: its name (so that errors and remat policies see it here too), and
    # whether it closes over array constants, which custom_partitioning refuses (e.g. a
    # numpy table baked in): such an op, or its backward, runs unpartitioned rather than fail.
    fwd_jaxpr, name = _traced_op(lambda *a: call(a), ops)
    fwd_consts = bool(fwd_jaxpr.consts)

    def plan_for(mesh, shapes):
        specs = [None] * len(args)
        for i, sh in zip(present, shapes):
            specs[i] = _normalised(_mesh_spec(sh.sharding, mesh), len(sh.shape))
        layout = _layout(signature, _refill(args, present, shapes), mesh=mesh, specs=specs)
        letters, _, in_specs, out_spec = layout
        axes = tuple(letters.get(axes_of, ())) if axes_of else ()
        return letters, [in_specs[i] for i in present], out_spec, axes

    def bwd_local(local, ct, axes):
        def f(*d):
            arrs = list(local)
            for k, a in zip(diff, d):
                arrs[k] = a
            return call(arrs, axes)
        return jax.vjp(f, *[local[k] for k in diff])[1](ct)

    # forward: op on shards
    def fwd_partition(mesh, arg_shapes, result_shape):
        _, in_specs, out_spec, axes = plan_for(mesh, arg_shapes)
        named = lambda sp: NamedSharding(mesh, sp)  # noqa: E731
        return mesh, lambda *local: call(local, axes), named(out_spec), tuple(named(sp) for sp in in_specs)

    # backward: recompute on shards, op's backward, psum partials of replicated operands
    def bwd_partition(mesh, arg_shapes, result_shape):
        letters, in_specs, out_spec, axes = plan_for(mesh, arg_shapes[:-1])
        sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
        used = {a for v in letters.values() for a in v}
        out_axes = {a for e in out_spec for a in _axes(e)}
        # the op's body restores a cotangent that shard_map would have divided (see
        # replicated_cotangent): hand it the same division here
        div = math.prod(sizes[a] for a in axes if a not in out_axes)

        def lower(*local):
            *xs, ct = local
            grads = bwd_local(xs, ct / div if div > 1 else ct, axes)
            out = []
            for k, g in zip(diff, grads):
                mentioned = {a for e in in_specs[k] for a in _axes(e)}
                red = tuple(sorted(used - mentioned))
                out.append(jax.lax.psum(g, red) if red else g)
            return tuple(out)

        named = lambda sp: NamedSharding(mesh, sp)  # noqa: E731
        arg_sh = tuple(named(sp) for sp in in_specs) + (named(out_spec),)
        return mesh, lower, tuple(named(in_specs[k]) for k in diff), arg_sh

    sig_in = [ins[i] for i in present]
    rule_f, upper = _sdy_rule(sig_in, [outs[0]])
    rule_b, _ = _sdy_rule(sig_in + [outs[0]], [sig_in[k] for k in diff])
    fwd_cp, bwd_cp = custom_partitioning(lambda *local: call(local)), custom_partitioning(
        lambda *local: tuple(bwd_local(local[:-1], local[-1], ())))
    for cp, part, rule in ((fwd_cp, fwd_partition, rule_f), (bwd_cp, bwd_partition, rule_b)):
        # decode_shardings=False: operand shardings arrive as XLA's; _mesh_spec reads them
        cp.def_partition(partition=part, sharding_rule=rule, need_replication_factors=tuple(upper),
                         decode_shardings=False)

    def unpartitioned_vmap(body):
        def rule(axis_size, in_batched, *xs):
            out = jax.vmap(body, in_axes=tuple(0 if b else None for b in in_batched), axis_size=axis_size)(*xs)
            return out, jax.tree_util.tree_map(lambda _: True, out)
        return rule

    fwd_call = jax.custom_batching.custom_vmap(lambda *xs: fwd_cp(*xs))
    fwd_call.def_vmap(unpartitioned_vmap(lambda *xs: call(xs)))
    bwd_call = jax.custom_batching.custom_vmap(lambda *xs: bwd_cp(*xs))
    bwd_call.def_vmap(unpartitioned_vmap(lambda *xs: tuple(bwd_local(xs[:-1], xs[-1], ()))))

    # The partitioned forward's and backward's own derivatives (what grad of grad and
    # Hessians differentiate) are the unpartitioned op's and backward's, which XLA
    # partitions like any jnp code: custom_partitioning has no AD rule.
    @jax.custom_jvp
    def fwd_any(*xs):
        return call(xs) if fwd_consts else fwd_call(*xs)

    fwd_any.defjvp(lambda primals, tangents: jax.jvp(lambda *a: call(a), primals, tangents))
    body = lambda *a: tuple(bwd_local(a[:-1], a[-1], ()))  # noqa: E731  (the backward, unpartitioned)

    @jax.custom_jvp
    def bwd_any(*xs_ct):
        return body(*xs_ct) if jax.make_jaxpr(body)(*xs_ct).consts else bwd_call(*xs_ct)

    bwd_any.defjvp(lambda primals, tangents: jax.jvp(body, primals, tangents))

    def op_fwd(*xs):
        return fwd_any(*xs), xs

    def op_bwd(xs, ct):
        grads = dict(zip(diff, bwd_any(*xs, ct)))
        return tuple(grads.get(k) for k in range(len(xs)))

    def op_tangent(xs, *tangents):
        # Forward mode: the op's own tangent rule on the whole arrays, partitioned by XLA
        # (it may gather around a tangent kernel; the primal output stays partitioned).
        def f(*d):
            arrs = list(xs)
            for k, a in zip(diff, d):
                arrs[k] = a
            return call(arrs)
        return jax.jvp(f, tuple(xs[k] for k in diff), tuple(tangents[k] for k in diff))[1]

    from jaxbwd.vjp._derivatives import custom_op

    op = custom_op(lambda *xs: fwd_any(*xs), name=name or signature)
    op.defvjp(op_fwd, op_bwd)
    op.deftangent(op_tangent)
    return op(*ops)
