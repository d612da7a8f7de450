"""Partitioning of the ops under ``jit`` with sharded operands: one helper, ``partitioned``.

XLA cannot partition a ``pallas_call``: handed sharded operands, the SPMD partitioner
gathers each whole operand onto every device around the kernel. The ops therefore run
their custom_vjp (forward and Pallas/XLA backward) per shard, under ``jax.shard_map``,
whenever the operands' shardings are known at trace time and the op can run on shards
without communication.

Design, and why:

* ``jax.experimental.custom_partitioning`` was not used: it has no vmap batching rule, and
  every op must vmap (the contract tests vmap each one), so wrapping kernels in it would
  break vmap; it would also need one pair of partitioning callbacks per kernel.
* Instead, under a mesh whose axes are all ``AxisType.Explicit`` (set with
  ``jax.set_mesh``), operand shardings are part of the abstract value
  (``jax.typeof(x).sharding.spec``), so an op can read them while it is traced and run the
  whole custom_vjp under ``jax.shard_map`` with the operands' own specs. ``shard_map``
  batches under vmap, nests in grad/remat/scan, and its transpose does the one reduction
  the backward needs: a replicated operand (a norm's weight, a bias) gets its per-shard
  f32 partial gradients summed with a psum (an all-reduce) over the axes that shard the
  rows. Activations are never gathered for the layouts an op can split.
* ``check_vma=False``: a ``pallas_call`` inside a vma-checked ``shard_map`` must declare
  how each output varies across the mesh, which the kernels (shared with the unsharded
  path) do not; unchecked, the transpose divides output cotangents over, and psums input
  cotangents over, the axes an operand does not mention, which is exactly the sum of
  weight-gradient partials.
* Without a mesh, with Auto or Manual axes (e.g. already inside a user's shard_map), or
  when no operand is sharded, ``partitioned`` calls the op unchanged: behaviour is exactly
  as before.
* A layout the op cannot run on shards alone (a reduced axis sharded: a norm over a
  sharded hidden dim, a softmax over a sharded axis, attention over a sharded sequence; two
  operands sharding one dimension differently; axes that do not divide a dimension, e.g.
  one kv head with query heads sharded) is not left to XLA: under an explicit mesh the
  jnp formulas and the Pallas kernels fail to trace on such operands (scan carries change
  type, sharded refs cannot be indexed). ``partitioned`` instead reshards, with
  ``jax.sharding.reshard``, only the offending dimensions to replicated (the one
  all-gather this module adds, and only for such layouts) and keeps every other dimension
  sharded; the output is then replicated along the gathered dimension.
* An op may also communicate inside the body: cross_entropy with the class axis sharded
  (logits from a vocabulary-sharded output projection) runs vocab-parallel, combining
  per-shard logsumexp, label logit and logit sum with ``pmax``/``psum`` over the axes
  that shard the classes (``axes_of``); its backward needs no communication. embed with
  the table sharded over the vocabulary likewise looks up the ids its shard holds and
  psums the rows (Megatron-LM's vocab-parallel embedding); its backward scatters into
  the local shard only. Both restore the loss cotangent with ``replicated_cotangent``.
* Not covered: sequence-parallel attention (ring attention: a sharded sequence is
  gathered); glu over a sharded hidden dim (gate and up are the two halves of the last
  axis, so a shard holds only gates or only ups: gathered). matmul, scale, residual_add, reshape and row_slice have
  XLA backwards and are partitioned by XLA itself (matmul over output columns included).

Each op states its layout with a small einsum-like signature, e.g. ``"...D,D->...D"``
for rms_norm: one letter per dimension, ``...`` for any number of leading dimensions
(all operands with ``...`` share them). Lower-case letters are dimensions the op is
independent along: they may be sharded, and every operand carrying the same letter is
given the same mesh axes (the first operand sharding it decides; an operand that is
replicated there is resharded to match, which is a local slice). Upper-case letters are
dimensions the op reduces or mixes over (the normalised axis, the softmax axis,
attention's sequence and head dims): they are gathered if sharded. Leading ``...``
dimensions align from the right across operands.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

import jax
from jax.sharding import PartitionSpec as P

__all__ = ["partitioned", "plan", "spec", "matmul_out_spec", "replicated_cotangent"]

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


def _explicit_mesh():
    try:
        mesh = jax.sharding.get_abstract_mesh()
    except Exception:  # pragma: no cover - very old jax
        return None
    if mesh is None or getattr(mesh, "empty", True) or not mesh.axis_names:
        return None
    explicit = jax.sharding.AxisType.Explicit
    if any(t != explicit for t in mesh.axis_types):
        return None
    return mesh


def _axes(entry) -> tuple:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _spec_of(x, ndim):
    sharding = getattr(jax.typeof(x), "sharding", None)
    spec = tuple(getattr(sharding, "spec", ()) or ())
    return tuple(_axes(e) for e in spec) + ((),) * (ndim - len(spec))


def _expand(term, ndim):
    """term letters -> one name per dimension (ellipsis dims named '.-2', '.-1', from the right)."""
    if term and term[0] == _ELLIPSIS:
        n_lead = ndim - (len(term) - 1)
        if n_lead < 0:
            return None
        return tuple(f".{i - n_lead}" for i in range(n_lead)) + term[1:]  # right-aligned leads
    return term if len(term) == ndim else None


def _layout(signature: str, args):
    """(letters, dims, in_specs, out_specs) under the current explicit mesh, or None.

    ``letters`` maps each lower-case dimension that stays sharded to its mesh axes; the
    ``in_specs`` are what every operand must be resharded to before the op runs on shards:
    its own spec, less the axes on dimensions the op cannot split (upper-case ones, ones
    another operand shards differently, ones the axes do not divide).
    """
    mesh = _explicit_mesh()
    if mesh is None:
        return None
    ins, outs = _parse(signature)
    if len(ins) != len(args):
        raise ValueError(f"jaxbwd.sharding: signature {signature!r} has {len(ins)} inputs, got {len(args)}")
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    dims, extent = [], {}
    for term, a in zip(ins, args):
        names = None if a is None else _expand(term, a.ndim)
        if a is not None and names is None:
            return None  # rank does not fit the signature: the op's own checks report it
        dims.append(names)
        for name, size in zip(names or (), getattr(a, "shape", ())):
            extent.setdefault(name, set()).add(size)
    letters: dict = {}
    used: set = set()
    for names, a in zip(dims, args):
        for name, axes in zip(names or (), _spec_of(a, a.ndim) if names else ()):
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
    """``x``'s PartitionSpec under an explicit-sharding mesh (padded to its rank), else None.

    Passed as ``out_sharding`` to XLA contractions in a backward, so that a gradient keeps
    its operand's sharding, as JAX's own transpose of ``dot_general`` does (explicit mode
    otherwise refuses a contraction over a sharded dimension as ambiguous).
    """
    if _explicit_mesh() is None:
        return None
    entries = tuple(getattr(getattr(jax.typeof(x), "sharding", None), "spec", ()) or ())
    return P(*(entries + (None,) * (x.ndim - len(entries))))


def matmul_out_spec(x, w) -> Optional[P]:
    """Output spec of ``x [..., K] @ w [K, M]`` under an explicit mesh, else None.

    Leading dimensions keep x's sharding, M keeps w's (unless its axes already shard a
    leading dimension); a sharded K is summed over (XLA inserts the all-reduce of a
    row-parallel matmul, Megatron-LM's "g" operator) and leaves the result replicated
    along those axes.
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
    ``n`` restores them exactly (``n`` a power of two) without a collective.
    """
    if not axes:
        return ct
    sizes = dict(zip(jax.sharding.get_abstract_mesh().axis_names, jax.sharding.get_abstract_mesh().axis_sizes))
    return ct * math.prod(sizes[a] for a in axes)


def plan(signature: str, *args) -> Optional[tuple]:
    """(in_specs, out_specs) when the op will run per shard under ``shard_map``, else None.

    None means: no explicit mesh, or no dimension the op can split is sharded; the op then
    runs unchanged (after gathering any dimension it cannot split, see ``partitioned``).
    ``None`` arguments (absent optional operands) are skipped.
    """
    layout = _layout(signature, args)
    if layout is None or not layout[0]:
        return None
    return layout[2], layout[3]


def partitioned(signature: str, fn: Callable, *args, axes_of: Optional[str] = None) -> Any:
    """``fn(*args)``, run per shard under ``jax.shard_map`` when ``plan`` finds a layout.

    ``fn`` is the op's custom_vjp with its static parameters bound; ``args`` its array
    operands (``None`` for an absent optional one). Replicated operands' gradients are
    summed over the sharded axes by shard_map's transpose; nothing else communicates.

    ``axes_of``: a lower-case letter of the signature that ``fn`` itself communicates
    over. ``fn`` is then called with ``axes=`` the tuple of mesh axes that shard that
    dimension (``()`` when it is not sharded, or outside a mesh) and must reduce over them
    with collectives; outputs without that letter are replicated over those axes.
    vocab-parallel cross_entropy and embed use it.
    """
    layout = _layout(signature, args)
    extra = lambda letters: {} if axes_of is None else {"axes": tuple(letters.get(axes_of, ()))}  # noqa: E731
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
    if not letters:
        full = list(args)
        for i, a in zip(present, operands):
            full[i] = a
        return fn(*full, **extra({}))

    def body(*local):
        full = [None] * len(args)
        for i, a in zip(present, local):
            full[i] = a
        return fn(*full, **extra(letters))

    return jax.shard_map(
        body, in_specs=tuple(in_specs[i] for i in present), out_specs=out_specs, check_vma=False
    )(*operands)
