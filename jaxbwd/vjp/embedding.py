"""embed: table lookup whose backward is a deterministic scatter-add (sorted ids + segment sums).

Forward (XLA gather): ``table[ids]``, zero rows for out-of-range ids. Saved for the
backward: the ids only (the table is not needed). Backward: ids are mapped to a sort key
(out-of-range and ``padding_idx`` ids become the sentinel V, i.e. dropped), stably sorted
by XLA and cut into chunks of one id; the Pallas ``embed_bwd`` kernel sums each chunk of dy
in f32 (programs only for the ids present, the rest of the gradient zero-filled by XLA) and
``embed_bwd_hot`` adds the chunks of ids with many tokens in a fixed order; or, on the XLA
path, ``segment_sum`` over the same keys.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxbwd.pallas import embedding as kernels
from jaxbwd.vjp import _base as B
from jaxbwd.vjp._derivatives import custom_op
from jaxbwd import sharding as S


def _keys(ids, V, padding_idx):
    """Flat int32 keys: the id where it receives gradient, V (the sentinel) where not."""
    flat = ids.reshape(-1)
    ok = (flat >= 0) & (flat < V)
    if padding_idx is not None:
        ok = ok & (flat != padding_idx)
    return jnp.where(ok, flat, V).astype(jnp.int32)


def _lookup(ids, table):
    V = table.shape[0]
    kernels.C.check_gather_range("embed", num_embeddings=V)
    valid = (ids >= 0) & (ids < V)
    rows = jnp.take(table, jnp.where(valid, ids, 0), axis=0)
    return jnp.where(valid[..., None], rows, jnp.zeros((), table.dtype))


def _shard_offset(V_local, axes):
    """First id of this vocabulary shard (0 when the table is whole)."""
    return jax.lax.axis_index(axes) * V_local if axes else 0


@functools.partial(custom_op, nondiff_argnums=(2, 3, 4))
def _embed(ids, table, padding_idx, impl, axes):
    return _embed_fwd(ids, table, padding_idx, impl, axes)[0]


def _embed_fwd(ids, table, padding_idx, impl, axes):
    # Vocabulary shard: ids outside it read zero rows here and the shards' rows add up.
    y = _lookup(ids - _shard_offset(table.shape[0], axes), table)
    y = jax.lax.psum(y, axes) if axes else y
    # A zero-size carrier keeps V, D and the dtype without saving the table.
    return y, (ids, jnp.zeros(table.shape + (0,), table.dtype))


def _embed_bwd(padding_idx, impl, axes, res, dy):
    ids, proto = res
    V, D = proto.shape[:2]
    dy = S.replicated_cotangent(dy, axes)
    off = _shard_offset(V, axes)  # ids of other shards fall out of range: dropped
    key = _keys(ids - off, V, None if padding_idx is None else padding_idx - off)
    dy2 = dy.reshape(-1, D)
    if impl.pallas and dy2.shape[0]:
        work = kernels.plan(key, V)
        dtable = kernels.embed_bwd(work, dy2, num_rows=V, dtype=proto.dtype, interpret=impl.interpret)
    else:
        acc = B.acc_dtype(dy2)
        dtable = jax.ops.segment_sum(dy2.astype(acc), key, num_segments=V + 1)[:V].astype(proto.dtype)
    return None, dtable


_embed.defvjp(_embed_fwd, _embed_bwd)


def _embed_tangent(padding_idx, impl, axes, res, _, dtable):
    """Linear in the table: the lookup of the table's tangent, zero where the id is
    ``padding_idx`` (its row gets no gradient, so no tangent either: jacfwd = jacrev)."""
    ids = res[0]
    dy = _embed.fun(ids, dtable, padding_idx, impl, axes)
    if padding_idx is None:
        return dy
    return jnp.where((ids == padding_idx)[..., None], jnp.zeros((), dy.dtype), dy)


_embed.deftangent(_embed_tangent)


def embed(ids, table, *, padding_idx=None, implementation=None):
    """Embedding lookup ``table[ids]`` with a deterministic scatter-add backward.

    Args:
      ids: [...] integer token ids (may be traced, vmapped).
      table: [V, D] float32, bfloat16 or float16 (float64 on the XLA path).
      padding_idx: ``None`` or a Python int in [-V, V) (negative counts from the end, as
        torch.nn.Embedding). The forward returns that row as stored; its gradient is zero.
      implementation: ``None`` (Pallas on GPU, XLA elsewhere), ``"pallas"`` or ``"xla"``.

    Returns:
      [..., D] in table's dtype.

    Out-of-range ids (< 0 or >= V): the forward gives a zero row and the backward drops
    them; nothing is read or written out of bounds.

    Residuals: ids only (plus a zero-size carrier of the table's shape and dtype).

    Sharding: under ``jax.set_mesh`` (explicit or Auto axes), ids may be sharded (data
    parallel) and the table may be sharded over V (vocab-parallel: each shard looks up
    the ids it holds, one psum of the [..., D] rows; the table is never gathered).

    Backward: dtable[v] = sum of dy over the tokens with id v, accumulated in float32 and
    returned in table's dtype. Deterministic: ids are stably sorted, each id's tokens are
    summed in chunks of 64 in a fixed order and the chunks are added in a fixed order (no
    atomics).

    Raises:
      TypeError: ids not integer, table not floating, padding_idx not an int.
      ValueError: table not of rank 2, padding_idx outside [-V, V), a NumPy int64 ids array
        with values outside int32 while ``jax_enable_x64`` is off (JAX would wrap them),
        unknown implementation.
      Also the errors common to every op (``help(jaxbwd)``).

    Source: the adjoint of a gather is a scatter-add (``torch.nn.Embedding`` semantics for
    ``padding_idx``).
    """
    op = "embed"
    ids = B.check_int(op, "ids", ids)
    B.check_float(op, "table", table)
    B.check_ndim(op, "table", table, ndim=2, what="([V, D])")
    B.check_nonempty_axis(op, "table", table, 0, "vocabulary axis V")
    B.check_nonempty_axis(op, "table", table, 1, "feature axis D")
    V = table.shape[0]
    padding_idx = B.static_int(op, "padding_idx", padding_idx, none_ok=True)
    if padding_idx is not None:
        if not -V <= padding_idx < V:
            raise ValueError(f"jaxbwd.{op}: padding_idx must be in [-{V}, {V}) (table has V={V} rows), got {padding_idx}")
        padding_idx %= V
    impl = B.impl(implementation, op, ids, table)
    # "v": the table may stay sharded over the vocabulary (vocab-parallel, see jaxbwd.sharding)
    return S.partitioned("...,vD->...D", lambda i, t, axes: _embed(i, t, padding_idx, impl, axes), ids, table,
                         axes_of="v")
