"""cross_entropy: softmax cross-entropy over integer labels, the gradient written in the forward.

Forward of a differentiated call: the Pallas ``cross_entropy_fwd`` kernel (or the same math
in XLA) reads the logits once for the row max ``m`` and ``s = sum(exp(x - m))``, the label's
logit and the logit mean (the loss is formed from these [rows] partials) and, while the row
block is on chip, writes ``d``, the gradient of the reduced loss for a unit cotangent
(each row's ``dloss/dlogits`` times its weight in the reduction). ``d`` is the only residual:
the logits are not kept. Backward: ``dlogits = g * d`` with ``g`` the per-row upstream
cotangent, the Pallas ``cross_entropy_bwd`` kernel in place over ``d``, skipping row blocks
whose ``g`` is 1 (``jax.grad`` of the mean or summed loss), or the same product in XLA.
A loss that is not differentiated runs ``cross_entropy_stats`` (partials only).

Bytes per token at V = 128256 bf16: 513 KB forward + backward when the cotangent is 1
(one read of the logits, one write of ``d``), 1026 KB otherwise; recomputing the softmax in
the backward instead would be 770 KB at any cotangent (see :mod:`jaxbwd.pallas.losses`).

The softmax is ``exp(x - m) / s`` from the row max and sum, which keeps f32 precision at
any logit offset (``exp(x - lse)`` does not: see :mod:`jaxbwd.pallas.losses`).

Vocab-parallel: under an explicit-sharding mesh with the class axis sharded (the logits
of a vocabulary-sharded output projection), each device runs the kernels on its
vocabulary shard and the [rows] partials are combined with one ``pmax`` and two
``psum`` (three with label smoothing; the Megatron-LM scheme, Shoeybi et al. 2019) before
``cross_entropy_grad`` writes the shard's ``d``; the logits are never gathered.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxbwd.pallas import losses as kernels
from jaxbwd.vjp import _base as B
from jaxbwd.vjp._derivatives import custom_op
from jaxbwd import sharding as S

REDUCTIONS = ("mean", "sum", "none")


def _valid_labels(labels, V, ignore_index):
    """labels -> int32 labels with -1 for ignored and out-of-range rows (the documented policy);
    the range is checked before the cast, so 64-bit labels past int32 do not wrap into range."""
    info = jnp.iinfo(labels.dtype)
    ok = labels >= 0
    if info.min <= ignore_index <= info.max:  # else no label can equal it (int32 labels, 2**40)
        ok = ok & (labels != ignore_index)
    if V <= info.max:  # else every label is in range (and V does not fit the dtype)
        ok = ok & (labels < V)
    return jnp.where(ok, labels, -1).astype(jnp.int32)


def _shard_labels(lab, V_local, axes):
    """Global labels -> column index within this vocabulary shard, -1 where the label lies elsewhere."""
    if not axes:
        return lab
    local = lab - jax.lax.axis_index(axes) * V_local
    return jnp.where((lab >= 0) & (local >= 0) & (local < V_local), local, -1)


def _grad_dtype(dtype):
    """dtype of the saved gradient ``d``: the logits' own, except float32 for float16, whose
    range would flush small ``softmax / rows`` values before a loss-scaling cotangent
    brings them back."""
    return jnp.float32 if jnp.dtype(dtype) == jnp.float16 else dtype


def _row_weight(lab, reduction, acc):
    """Each row's weight in the reduced loss: 1 / valid rows (mean), 1 (sum, none), 0 if ignored."""
    valid = lab >= 0
    w = valid.astype(acc)
    if reduction == "mean":
        w = w / jnp.maximum(jnp.sum(valid), 1).astype(acc)
    return w


def _xla_partials(x2, lab, with_sum, V):
    """The kernel's partials in XLA: row max m, s = sum(exp(x - m)), label logit, sum(x / V)."""
    kernels.C.check_gather_range("cross_entropy", classes=x2.shape[-1])
    xf = x2.astype(B.acc_dtype(x2))
    m = jnp.max(xf, axis=-1)
    s = jnp.sum(jnp.exp(xf - jnp.where(jnp.isfinite(m), m, 0.0)[:, None]), axis=-1)
    xl = jnp.take_along_axis(xf, jnp.maximum(lab, 0)[:, None], axis=-1)[:, 0]
    sx = jnp.sum(xf * (1.0 / V), axis=-1) if with_sum else jnp.zeros_like(m)
    return m, s, jnp.where(lab >= 0, xl, 0.0), sx


def _xla_grad(x2, lab, m, s, w, eps, z, V):
    """``d = w * ((1 + 2 z lse) exp(x - m) / s - (1 - eps) onehot - eps/V)`` in XLA (the kernels' formula)."""
    xf = x2.astype(B.acc_dtype(x2))
    m, s = m.astype(xf.dtype), s.astype(xf.dtype)
    safe = jnp.where(s > 0, s, 1.0)
    scale = jnp.where(s > 0, 1.0 / safe, 0.0)
    if z:
        scale = scale * (1.0 + 2.0 * z * _lse(m, safe))
    p = jnp.exp(xf - jnp.where(jnp.isfinite(m), m, 0.0)[:, None]) * scale[:, None]
    onehot = jnp.arange(x2.shape[-1], dtype=lab.dtype)[None, :] == lab[:, None]
    d = p - jnp.where(onehot, 1.0 - eps, 0.0)
    if eps:
        d = d - eps / V
    d = jnp.where(w[:, None] != 0, w[:, None] * d, 0.0)
    return d.astype(_grad_dtype(x2.dtype))


def _lse(m, s):
    """log(sum(exp(x))) from the row max and the shifted sum; -inf for an all -inf row."""
    return jnp.where(jnp.isfinite(m), m, 0.0) + jnp.log(s)


def _combine(m, s, xl, sx, eps, axes):
    """The vocabulary shards' partials combined over ``axes``: (max, sum) as an online
    softmax does, the label logit and the mean by a sum."""
    if not axes:
        return m, s, xl, sx
    # The global max is a shift that cancels in the loss: no derivative through pmax.
    mg = jax.lax.stop_gradient(jax.lax.pmax(jax.lax.stop_gradient(m), axes))
    rescale = jnp.exp(m - jnp.where(jnp.isfinite(mg), mg, 0.0))
    s = jax.lax.psum(jnp.where(s > 0, s * rescale, 0.0), axes)
    m = jnp.where(jnp.isfinite(mg), mg, m)
    xl = jax.lax.psum(xl, axes)
    sx = jax.lax.psum(sx, axes) if eps else sx
    return m, s, xl, sx


def _row_loss(m, s, xl, sx, lab, eps, z):
    """Per-row loss from the whole vocabulary's partials, 0 on ignored rows."""
    # lse - (1 - eps) x[label] - eps mean(x), grouped so that the large terms cancel exactly
    # (m - x[label] is exact in f32 for nearby values) before log(s) is added: at logits of
    # 1e6 an f32 lse would round log(s) to the ulp of 1e6.
    m0 = jnp.where(jnp.isfinite(m), m, 0.0)
    loss = (1.0 - eps) * (m0 - xl) + jnp.log(s)
    if eps:
        loss = loss + eps * (m0 - sx)
    if z:
        lse = _lse(m, s)
        loss = loss + z * lse * lse
    return jnp.where(lab >= 0, loss, 0.0)


def _stats(impl, x2, local, eps, axes, V):
    """(m, s, x[label], mean(x)) per row over the whole vocabulary."""
    if impl.pallas:
        parts = kernels.cross_entropy_stats(x2, local, with_sum=bool(eps), n_classes=V, interpret=impl.interpret)
    else:
        parts = _xla_partials(x2, local, bool(eps), V)
    return _combine(*parts, eps, axes)


def _reduce(loss, lab, lead, reduction, dtype):
    if reduction == "none":
        return loss.reshape(lead).astype(dtype)
    total = jnp.sum(loss)
    if reduction == "mean":
        total = total / jnp.maximum(jnp.sum(lab >= 0), 1).astype(total.dtype)
    return total.astype(dtype)


@functools.partial(custom_op, nondiff_argnums=(2, 3, 4, 5, 6, 7, 8))
def _cross_entropy(logits, labels, ignore_index, eps, z, reduction, impl, V, axes):
    # Not differentiated: the partials only, no gradient written.
    x2, lead = B.rows(logits)
    lab = _valid_labels(labels.reshape(-1), V, ignore_index)
    m, s, xl, sx = _stats(impl, x2, _shard_labels(lab, x2.shape[-1], axes), eps, axes, V)
    return _reduce(_row_loss(m, s, xl, sx, lab, eps, z), lab, lead, reduction, logits.dtype)


def _cross_entropy_tangent(ignore_index, eps, z, reduction, impl, V, axes, res, dlogits, _):
    """``d`` is the reduced loss's gradient: the tangent is ``sum(d * dlogits)`` over the
    classes (then over the rows unless ``reduction="none"``)."""
    (d,) = res
    acc = B.acc_dtype(d)
    t = jnp.sum(d.astype(acc) * dlogits.astype(acc), axis=-1)
    if axes:  # each vocabulary shard holds part of each row's sum
        t = jax.lax.psum(t, axes)
    if reduction != "none":
        t = jnp.sum(t)
    return t.astype(dlogits.dtype)


def _cross_entropy_fwd(logits, labels, ignore_index, eps, z, reduction, impl, V, axes):
    x2, lead = B.rows(logits)
    lab = _valid_labels(labels.reshape(-1), V, ignore_index)
    local = _shard_labels(lab, x2.shape[-1], axes)
    acc = B.acc_dtype(logits)
    w = _row_weight(lab, reduction, jnp.float32 if impl.pallas else acc)
    if impl.pallas and not axes:  # one kernel: statistics, then the gradient from the same tiles
        m, s, xl, sx, d = kernels.cross_entropy_fwd(x2, local, w, label_smoothing=eps, z_loss=z,
                                                    grad_dtype=_grad_dtype(x2.dtype), interpret=impl.interpret)
    else:  # on a vocabulary shard the gradient needs the combined statistics first
        m, s, xl, sx = _stats(impl, x2, local, eps, axes, V)
        if impl.pallas:
            d = kernels.cross_entropy_grad(x2, local, m, s, w, label_smoothing=eps, z_loss=z, n_classes=V,
                                           grad_dtype=_grad_dtype(x2.dtype), interpret=impl.interpret)
        else:
            d = _xla_grad(x2, local, m, s, w, eps, z, V)
    loss = _reduce(_row_loss(m, s, xl, sx, lab, eps, z), lab, lead, reduction, logits.dtype)
    return loss, (d.reshape(logits.shape),)


def _cross_entropy_bwd(ignore_index, eps, z, reduction, impl, V, axes, res, ct):
    (d,) = res
    d2, _ = B.rows(d)
    acc = jnp.float32 if impl.pallas else B.acc_dtype(d, ct)
    g = ct.reshape(-1) if reduction == "none" else jnp.broadcast_to(ct, (d2.shape[0],))
    g = S.replicated_cotangent(g.astype(acc), axes)  # every vocabulary shard holds a copy of the loss
    if impl.pallas:
        dx = kernels.cross_entropy_bwd(d2, g, out_dtype=ct.dtype, interpret=impl.interpret)
    else:
        dx = (g[:, None] * d2.astype(acc)).astype(ct.dtype)
    return dx.reshape(d.shape), None


_cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)
_cross_entropy.deftangent(_cross_entropy_tangent)


def _broadcasts(shape, to) -> bool:
    try:
        return jnp.broadcast_shapes(shape, to) == tuple(to)
    except ValueError:
        return False


def _classes_last(op, logits, labels, axis, where, ignore_index, label_smoothing):
    """optax's ``axis``/``where`` conventions folded into a last-axis problem: class axes
    moved last and flattened; masked classes become -inf logits, rows without any class
    get the ignore_index label."""
    axes = axis if isinstance(axis, (tuple, list)) else (axis,)
    if not axes or not all(B.is_static_int(a) for a in axes):
        raise TypeError(f"jaxbwd.{op}: axis must be an int or a tuple of ints, got {axis!r}")
    if not all(-logits.ndim <= a < logits.ndim for a in axes):
        raise ValueError(f"jaxbwd.{op}: axis must be in [{-logits.ndim}, {logits.ndim}) for logits of shape "
                         f"{tuple(logits.shape)}, got {axis!r}")
    axes = tuple(int(a) % logits.ndim for a in axes)
    if len(set(axes)) != len(axes):
        raise ValueError(f"jaxbwd.{op}: axis must name distinct axes, got {axis!r}")
    rest = tuple(i for i in range(logits.ndim) if i not in axes)
    perm = rest + axes

    def last(x):
        x = x if perm == tuple(range(x.ndim)) else jnp.transpose(x, perm)
        # The class size spelled out: a -1 cannot be inferred for zero rows.
        return x.reshape(x.shape[:len(rest)] + (math.prod(x.shape[len(rest):]),))

    if where is not None:
        B.check_array(op, "where", where)
        if B.check_static_number(op, "label_smoothing", label_smoothing) != 0.0:
            raise ValueError(f"jaxbwd.{op}: where needs label_smoothing == 0, got {label_smoothing!r}")
        row_shape = tuple(logits.shape[i] for i in rest)
        if where.ndim not in (len(rest), logits.ndim) or (
                where.ndim == len(rest) and not _broadcasts(where.shape, row_shape)):
            raise ValueError(
                f"jaxbwd.{op}: where must have logits' shape {tuple(logits.shape)} or logits' shape "
                f"without the class axes {row_shape}, got {tuple(where.shape)}"
            )
        if where.ndim == len(rest):
            where = jnp.expand_dims(where, axes)
        logits = B.apply_where(op, "logits", logits, where)
    logits = last(logits)
    if where is not None:
        labels = B.check_int(op, "labels", labels)
        info = jnp.iinfo(labels.dtype)
        # a row with no class left is ignored: ignore_index, or an out-of-range label (also
        # ignored) where labels' dtype cannot hold ignore_index (uint32 and -100)
        none_left = ignore_index if info.min <= ignore_index <= info.max else info.max
        labels = jnp.where(jnp.any(last(where), axis=-1), labels, jnp.asarray(none_left, labels.dtype))
    return logits, labels


def check_options(op, ignore_index, label_smoothing, z_loss) -> tuple[int, float, float]:
    """The cross-entropy options shared with ``linear_cross_entropy``, checked: a static int
    ignore_index, label_smoothing in [0, 1] and z_loss >= 0 (static numbers)."""
    B.static_int(op, "ignore_index", ignore_index)
    eps = B.check_static_number(op, "label_smoothing", label_smoothing)
    if not 0.0 <= eps <= 1.0:
        raise ValueError(f"jaxbwd.{op}: label_smoothing must be in [0, 1], got {label_smoothing!r}")
    z = B.check_static_number(op, "z_loss", z_loss)
    if not z >= 0.0:
        raise ValueError(f"jaxbwd.{op}: z_loss must be >= 0, got {z_loss!r}")
    return int(ignore_index), eps, z


def cross_entropy(logits, labels, *, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, reduction="mean",
                  axis=-1, where=None, implementation=None):
    """Softmax cross-entropy of ``logits`` against integer ``labels``, with label smoothing and z-loss.

    Per row, with ``lse = logsumexp(logits)``, ``eps = label_smoothing`` and ``V`` classes:

        loss = lse - (1 - eps) * logits[label] - eps / V * sum(logits) + z_loss * lse**2

    which is ``optax.softmax_cross_entropy(logits, optax.smooth_labels(one_hot(label), eps))``
    (smoothing as Szegedy et al. 2016: ``(1 - eps) * onehot + eps / V``) plus the PaLM
    auxiliary z-loss ``z_loss * log(Z)**2`` (Chowdhury et al. 2022, as in t5x). With
    ``eps = z_loss = 0`` it equals ``optax.softmax_cross_entropy_with_integer_labels``.

    Args:
      logits: [..., V] float32, bfloat16 or float16, math in float32 (float64 on the XLA
        path). Entries may be -inf (masked vocabulary): the loss is finite as long as the
        label's logit is finite and ``label_smoothing == 0`` (smoothing puts mass on every
        class, so a -inf logit makes the smoothed loss +inf, as in optax).
      labels: [...] integer, the same leading shape. Rows whose label equals
        ``ignore_index`` are ignored (loss 0, gradient 0). Out-of-range labels (< 0 or
        >= V) are treated as ignored too: no out-of-bounds read, no NaN.
      ignore_index: Python int.
      label_smoothing: static float in [0, 1].
      z_loss: static float >= 0.
      reduction: ``"mean"`` (over non-ignored rows; 0 when every row is ignored),
        ``"sum"`` or ``"none"`` (per-row losses of shape [...]).
      axis: the class axis, an int or a tuple of ints (their joint entries are the
        classes, flattened in axis order; labels index that flattening), as
        ``optax.softmax_cross_entropy_with_integer_labels``; labels have logits' shape
        without those axes. Other than -1, the classes are moved last first (a transpose).
      where: ``None`` or a boolean mask of logits' shape (or without the class axes: one
        flag per row), as optax's: masked-out classes leave the normaliser (they become
        -inf logits) and a row with no class left gives loss 0 and counts as ignored.
        Differs from optax in one case: a label on a masked-out class gives +inf (optax
        returns the finite ``lse - logit[label]`` for a class outside its own normaliser).
        Requires ``label_smoothing == 0`` (smoothing would put mass on masked classes).
      implementation: ``None`` (Pallas on GPU, XLA elsewhere), ``"pallas"`` or ``"xla"``.

    Returns:
      A scalar (mean, sum) or [...] (none) in logits' dtype. A row whose logits are all
      -inf has a NaN loss, as optax's, but a finite gradient (``-onehot``, where optax's is
      NaN); mask such rows out with ``where`` (loss 0, ignored) to keep the loss finite.

    Residuals: the gradient for a unit cotangent, ``d`` [..., V] in logits' dtype (float32
    for float16 logits), computed in the forward while the logits are on chip; the logits
    themselves are not kept, so the saved bytes equal the logits' (twice theirs for float16).
    The backward scales ``d`` by the cotangent, in place, and skips rows whose cotangent is
    1 (with float16 logits every row is scaled and converted to float16: no skip). The softmax inside
    ``d`` comes from the row max and the shifted sum (not only their logsumexp), which keeps
    the gradient exact to f32 rounding at any logit offset: rows of ``softmax - onehot`` sum
    to 0 at logits of 1e6, and tied logits of 1e8 get equal probabilities.

    Sharding: under ``jax.set_mesh`` (explicit or Auto axes), rows may be sharded (data
    parallel) and so may the class axis V (vocab-parallel: per-shard partials combined by
    collectives over [rows] vectors; the logits are never gathered). See
    :mod:`jaxbwd.sharding`.

    Raises:
      TypeError: logits not floating, labels not integer, a traced static parameter, axis
        not an int or tuple of ints (a jax array included).
      ValueError: logits of rank 0, labels' shape not logits.shape[:-1], label_smoothing
        outside [0, 1] or z_loss < 0 (either not finite), axis out of range or repeated,
        unknown reduction or implementation.
      Also the errors common to every op (``help(jaxbwd)``).

    Source: ``dlogits = g * w * ((1 + 2 z lse) softmax - (1 - eps) onehot - eps/V)`` with ``w``
    the row's weight in the reduction, the softmax as ``exp(x - max) / sum`` from the row max
    and sum (the online-softmax statistics of Milakov & Gimelshein 2018); the gradient is
    written in the forward as Liger-Kernel's cross-entropy does (Hsu et al. 2024).
    """
    op = "cross_entropy"
    B.check_float(op, "logits", logits)
    B.check_ndim(op, "logits", logits, min_ndim=1, what="([..., V])")
    ignore_index, eps, z = check_options(op, ignore_index, label_smoothing, z_loss)
    # (a jax array axis goes to _classes_last's TypeError, not into a traced comparison)
    last_axis = B.is_static_int(axis) and axis == -1
    if not last_axis or where is not None:
        logits, labels = _classes_last(op, logits, labels, axis, where, ignore_index, label_smoothing)
    B.check_nonempty_axis(op, "logits", logits, -1, "class axis V")
    labels = B.check_int(op, "labels", labels)
    B.check_shape(op, "labels", labels, logits.shape[:-1],
                  what="(logits.shape[:-1])" if last_axis else "(logits' shape without the class axis)")
    if logits.shape[-1] < 1:
        raise ValueError(f"jaxbwd.{op}: logits must have at least one class (V >= 1), got shape {tuple(logits.shape)}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"jaxbwd.{op}: reduction must be one of 'mean', 'sum', 'none', got {reduction!r}")
    # "v": the class axis may stay sharded (vocab-parallel: the op combines the shards itself)
    impl, sig, V = B.impl(implementation, op, logits), "...v,...->...", int(logits.shape[-1])
    run = lambda red: (lambda x, y, axes: _cross_entropy(x, y, int(ignore_index), eps, z, red, impl, V, axes))  # noqa: E731
    if reduction == "none" or not S.per_shard(sig, logits, labels):
        return S.partitioned(sig, run(reduction), logits, labels, axes_of="v")
    # Sharded rows or classes: per-row losses per shard, then the global sum/mean (an all-reduce).
    loss = S.partitioned(sig, run("none"), logits, labels, axes_of="v").astype(B.acc_dtype(logits))
    return _reduce(loss, _valid_labels(labels, logits.shape[-1], int(ignore_index)), (), reduction, logits.dtype)
