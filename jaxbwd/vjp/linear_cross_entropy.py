"""linear_cross_entropy: an LM head ``x @ w`` and its softmax cross-entropy in one op,
the [tokens, V] logits never stored (Cut Cross-Entropy, Wijmans et al., ICLR 2025).

The op's primitive maps x [R, D], w and labels [R] to two f32 rows per token: the loss
``lse - (1 - eps) z[label] - eps mean(z)`` (0 on ignored tokens) and the ``lse`` itself.
z-loss, per-token weights and the reduction are formed from these [R] vectors outside the
primitive, in plain JAX (so weights are differentiable and the z-loss gradient reaches the
kernels as the lse's cotangent).

Saved for the backward: x, w, the validated labels (int32) and per token the max ``m`` and
``s = sum(exp(z - m))`` (f32): O(tokens) beyond the inputs. Both implementations walk the
vocabulary in blocks and recompute logit blocks from x and w:

- Pallas (:mod:`jaxbwd.pallas.linear_cross_entropy`): a forward kernel over (token block,
  vocabulary split) tiles, a dx kernel over token blocks and a dw kernel over vocabulary
  blocks, deterministic.
- XLA: ``lax.scan`` over vocabulary chunks of at most ``CHUNK_ELEMENTS / R`` columns (an
  online logsumexp forward; dx accumulated in f32 in the carry, dw written chunk by chunk).
  The last chunk is clamped to end at V and its already-seen columns are masked, so w is
  never padded or copied.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxbwd.pallas import _common as PC
from jaxbwd.pallas import linear_cross_entropy as kernels
from jaxbwd.vjp import _base as B
from jaxbwd.vjp._derivatives import custom_op
from jaxbwd.vjp.losses import REDUCTIONS, _shard_labels, _valid_labels, check_options
from jaxbwd import sharding as S

# Logit elements one XLA chunk holds ([R, C] f32 arrays: the logits, their exponentials,
# dz): 2**22 is 16 MiB per array, so C = 512 vocabulary columns at R = 8192 tokens. Compiled
# for an H200 (x [8192, 2048], w [2048, 32000], bf16, value and grad), the XLA path's temp
# memory is 122 MiB with 2**22 against 180 MiB with 2**23 (3.5% and 5.1% of matmul +
# cross_entropy's XLA path). The price: each chunk reads and writes the [R, D] f32 dx carry,
# so twice the chunks move twice those bytes (16 -> 32 GB at V = 128256, D = 2048).
CHUNK_ELEMENTS = 2**22
_CHUNK: contextvars.ContextVar[Optional[int]] = contextvars.ContextVar("jaxbwd_lce_chunk", default=None)


@contextlib.contextmanager
def chunk_size(columns: int):
    """Overrides the XLA path's vocabulary chunk width while tracing (tests of the chunk
    loop and its clamped tail at small V)."""
    token = _CHUNK.set(int(columns))
    try:
        yield
    finally:
        _CHUNK.reset(token)


@dataclasses.dataclass(frozen=True)
class _Cfg:
    """Static arguments of one application (hashable; ``impl`` is switched to XLA for
    second-order derivatives by ``_derivatives``)."""

    eps: float
    softcap: Optional[float]
    transpose_w: bool
    n_classes: int  # the whole vocabulary (w may be a vocabulary shard)
    axes: tuple  # mesh axes sharding the vocabulary (vocab-parallel), () otherwise
    impl: B.Impl

    def dims(self, x2, w) -> kernels.Dims:
        V = w.shape[0] if self.transpose_w else w.shape[1]
        return kernels.Dims(R=x2.shape[0], D=x2.shape[1], V=V, n_classes=self.n_classes, eps=self.eps,
                            softcap=self.softcap, transpose_w=self.transpose_w)


# ------------------------------------------------------------------------- XLA chunks
def _chunking(R: int, V: int) -> tuple[int, int]:
    over = _CHUNK.get()
    c = over if over is not None else max(128, CHUNK_ELEMENTS // max(R, 1) // 128 * 128)
    c = min(c, V)
    return c, PC.cdiv(V, c)


def _w_chunk(w, start, c, transpose_w):
    """w's columns [start, start + c) as [D, c] ([c, D] rows with transpose_w): a slice."""
    if transpose_w:
        return jax.lax.dynamic_slice_in_dim(w, start, c, axis=0)
    return jax.lax.dynamic_slice_in_dim(w, start, c, axis=1)


def _dot(a, b, dims, acc):
    """``dot_general`` accumulating in ``acc`` (16-bit operands: ``_base.dot_16bit``)."""
    return B.dot_16bit(lambda a, b: jax.lax.dot_general(a, b, dims, preferred_element_type=acc), a, b)


def _xw(x2, wc, transpose_w, acc):
    return _dot(x2, wc, (((1,), (1,)), ((), ())) if transpose_w else (((1,), (0,)), ((), ())), acc)


def _chunk(cfg, x2, w, j, c, V, acc):
    """Chunk j: its column ids, which are new (the clamped last chunk repeats columns),
    its w slice, the soft-capped f32 logits and ``t = tanh(z / cap)`` (or None)."""
    start = jnp.minimum(j * c, V - c)
    cols = start + jnp.arange(c)
    fresh = cols >= j * c
    wc = _w_chunk(w, start, c, cfg.transpose_w)
    z = _xw(x2, wc, cfg.transpose_w, acc)
    t = None
    if cfg.softcap is not None:
        t = jnp.tanh(z / cfg.softcap)
        z = cfg.softcap * t
    return start, cols, fresh, wc, z, t


# The XLA formulas run under module-level jits with the configuration and the chunk width c
# static (the callers read c from ``chunk_size``'s context, outside them): their scan bodies
# are closures made per call, which JAX's scan cache cannot match, so without the jits every
# eager call retraced and recompiled its scans.
@functools.partial(jax.jit, static_argnames=("cfg", "V", "c"))
def _xla_partials(cfg, x2, w, lab, V, c):
    """Per token over this w's V columns: max, sum(exp(z - max)), z[label], sum(z) / n_classes."""
    acc = B.acc_dtype(x2, w)
    R = x2.shape[0]
    n = PC.cdiv(V, c)

    def body(carry, j):
        m, s, xl, sx = carry
        _, cols, fresh, _, z, _ = _chunk(cfg, x2, w, j, c, V, acc)
        z = jnp.where(fresh[None, :], z, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(z, axis=1))
        shift = PC.finite_or_zero(m_new)
        s = s * jnp.exp(m - shift) + jnp.sum(jnp.exp(z - shift[:, None]), axis=1)
        xl = xl + jnp.sum(jnp.where((cols.astype(lab.dtype) == lab[:, None]) & fresh[None, :], z, 0.0), axis=1)
        if cfg.eps:
            sx = sx + jnp.sum(jnp.where(fresh[None, :], z * (1.0 / cfg.n_classes), 0.0), axis=1)
        return (m_new, s, xl, sx), None

    zeros = jnp.zeros((R,), acc)
    init = (jnp.full((R,), -jnp.inf, acc), zeros, zeros, zeros)
    (m, s, xl, sx), _ = jax.lax.scan(body, S.vary_like(init, x2, w, lab), jnp.arange(n))
    return m, s, xl, sx


def _p_factor(m, s, g, gl):
    """exp(z - m) * a with a = (g + gl) / s (0 for s = 0)."""
    return (g + gl) * jnp.where(s > 0, 1.0 / jnp.where(s > 0, s, 1.0), 0.0)


@functools.partial(jax.jit, static_argnames=("cfg", "V", "c"))
def _xla_bwd(cfg, x2, w, lab, m, s, g, gl, V, c):
    acc = B.acc_dtype(x2, w)
    R, D = x2.shape
    n = PC.cdiv(V, c)
    m0 = PC.finite_or_zero(m)
    a = _p_factor(m, s, g, gl)
    b, cc = (1.0 - cfg.eps) * g, (cfg.eps / cfg.n_classes) * g
    contract = (((0,), (0,)), ((), ()))

    def body(carry, j):
        dx, dw = carry
        start, cols, fresh, wc, z, t = _chunk(cfg, x2, w, j, c, V, acc)
        onehot = cols.astype(lab.dtype)[None, :] == lab[:, None]
        dz = jnp.exp(z - m0[:, None]) * a[:, None] - jnp.where(onehot, b[:, None], 0.0)
        if cfg.eps:
            dz = dz - cc[:, None]
        if t is not None:
            dz = dz * (1.0 - t * t)
        # The clamped last chunk's repeated columns contribute nothing (and add 0 to dw).
        dz = jnp.where(fresh[None, :], dz, 0.0).astype(x2.dtype)
        if cfg.transpose_w:
            dx = dx + _dot(dz, wc, (((1,), (0,)), ((), ())), acc)
            dwc = _dot(dz, x2, contract, acc)  # [c, D]
            old = jax.lax.dynamic_slice_in_dim(dw, start, c, axis=0)
            dw = jax.lax.dynamic_update_slice_in_dim(dw, (old.astype(acc) + dwc).astype(dw.dtype), start, axis=0)
        else:
            dx = dx + _dot(dz, wc, (((1,), (1,)), ((), ())), acc)
            dwc = _dot(x2, dz, contract, acc)  # [D, c]
            old = jax.lax.dynamic_slice_in_dim(dw, start, c, axis=1)
            dw = jax.lax.dynamic_update_slice_in_dim(dw, (old.astype(acc) + dwc).astype(dw.dtype), start, axis=1)
        return (dx, dw), None

    init = (jnp.zeros((R, D), acc), jnp.zeros(w.shape, w.dtype))
    (dx, dw), _ = jax.lax.scan(body, S.vary_like(init, x2, w, lab, m, s, g, gl), jnp.arange(n))
    return dx, dw


# ---------------------------------------------------------------------------- the op
def _rows_out(cfg, m, s, xl, sx, lab):
    """[2, R]: the per-token loss (0 on ignored tokens) and the lse.

    ``(1 - eps)(m - z[label]) + log(s) + eps (m - mean(z))``: the large terms cancel before
    log(s) is added (as cross_entropy groups them), so the loss keeps f32 precision at
    large logits."""
    m0 = PC.finite_or_zero(m)
    loss = (1.0 - cfg.eps) * (m0 - xl) + jnp.log(s)
    if cfg.eps:
        loss = loss + cfg.eps * (m0 - sx)
    return jnp.stack([jnp.where(lab >= 0, loss, 0.0), m0 + jnp.log(s)])


def _lce_fwd(x2, w, lab, cfg):
    d = cfg.dims(x2, w)
    local = _shard_labels(lab, d.V, cfg.axes)
    if cfg.impl.pallas:
        parts = kernels.linear_cross_entropy_fwd(x2, w, local, d, with_sum=bool(cfg.eps), interpret=cfg.impl.interpret)
        m, s, xl, sx = kernels.combine_splits(*parts)
    else:
        m, s, xl, sx = _xla_partials(cfg, x2, w, local, d.V, _chunking(d.R, d.V)[0])
    if cfg.axes:  # vocab-parallel: the shards' partials combine as the splits' do
        # The global max is a shift that cancels in the loss: no derivative through pmax.
        pmax = lambda v: jax.lax.stop_gradient(jax.lax.pmax(jax.lax.stop_gradient(v), cfg.axes))  # noqa: E731
        psum = lambda v: jax.lax.psum(v, cfg.axes)  # noqa: E731
        m, s, xl, sx = kernels.combine_splits(m, s, xl, sx, reduce_max=pmax, reduce_sum=psum)
    return _rows_out(cfg, m, s, xl, sx, lab), (x2, w, lab, m, s)


@functools.partial(custom_op, nondiff_argnums=(3,), name="linear_cross_entropy")
def _lce(x2, w, lab, cfg):
    return _lce_fwd(x2, w, lab, cfg)[0]


def _lce_bwd(cfg, res, ct):
    x2, w, lab, m, s = res
    ct = S.replicated_cotangent(ct, cfg.axes)  # every vocabulary shard holds a copy of the output
    g = jnp.where(lab >= 0, ct[0], 0.0).astype(m.dtype)
    gl = ct[1].astype(m.dtype)
    d = cfg.dims(x2, w)
    lab = _shard_labels(lab, d.V, cfg.axes)
    if cfg.impl.pallas:
        dx, dw = kernels.linear_cross_entropy_bwd(x2, w, lab, m, s, g, gl, d, interpret=cfg.impl.interpret)
    else:
        dx, dw = _xla_bwd(cfg, x2, w, lab, m, s, g, gl, d.V, _chunking(d.R, d.V)[0])
    # Under vocab-parallel sharding dx is this shard's partial: shard_map's transpose sums
    # the partials of x, an operand replicated over the vocabulary axes.
    return dx.astype(x2.dtype), dw.astype(w.dtype), None


def _lce_tangent(cfg, res, dx2, dw, _):
    """Per token, with p the softmax recomputed from the saved m and s and dz the logits'
    tangent ``(dx w + x dw)`` (times 1 - tanh^2 under a softcap), chunk by chunk:
    dlse = sum(p dz), dloss = dlse - (1 - eps) dz[label] - eps mean(dz)."""
    x2, w, glab, m, s = res
    R, V = x2.shape[0], cfg.dims(x2, w).V
    lab = _shard_labels(glab, V, cfg.axes)
    dlse, dxl, dsx = _xla_tangent(cfg, x2, w, lab, m, s, dx2.astype(x2.dtype), dw.astype(w.dtype), V,
                                  _chunking(R, V)[0])
    if cfg.axes:  # each vocabulary shard holds part of each sum
        dlse, dxl, dsx = (jax.lax.psum(t, cfg.axes) for t in (dlse, dxl, dsx))
    dloss = dlse - (1.0 - cfg.eps) * dxl - cfg.eps * dsx
    return jnp.stack([jnp.where(glab >= 0, dloss, 0.0), dlse])


@functools.partial(jax.jit, static_argnames=("cfg", "V", "c"))
def _xla_tangent(cfg, x2, w, lab, m, s, dx2, dw, V, c):
    acc = m.dtype
    R = x2.shape[0]
    n = PC.cdiv(V, c)
    m0 = PC.finite_or_zero(m)
    inv_s = _p_factor(m, s, jnp.ones_like(s), jnp.zeros_like(s))

    def body(carry, j):
        dlse, dxl, dsx = carry
        start, cols, fresh, wc, z, t = _chunk(cfg, x2, w, j, c, V, acc)
        dz = _xw(dx2, wc, cfg.transpose_w, acc) + _xw(x2, _w_chunk(dw, start, c, cfg.transpose_w), cfg.transpose_w, acc)
        if t is not None:
            dz = dz * (1.0 - t * t)
        dz = jnp.where(fresh[None, :], dz, 0.0)
        p = jnp.exp(z - m0[:, None]) * inv_s[:, None]
        dlse = dlse + jnp.sum(p * dz, axis=1)
        dxl = dxl + jnp.sum(jnp.where(cols.astype(lab.dtype)[None, :] == lab[:, None], dz, 0.0), axis=1)
        if cfg.eps:
            dsx = dsx + jnp.sum(dz, axis=1) * (1.0 / cfg.n_classes)
        return (dlse, dxl, dsx), None

    zeros = jnp.zeros((R,), acc)
    (dlse, dxl, dsx), _ = jax.lax.scan(body, S.vary_like((zeros, zeros, zeros), x2, w, lab, m, s, dx2, dw),
                                       jnp.arange(n))
    return dlse, dxl, dsx


_lce.defvjp(_lce_fwd, _lce_bwd)
_lce.deftangent(_lce_tangent)


# ------------------------------------------------------------------------- public API
def linear_cross_entropy(x, w, labels, *, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, logit_softcap=None,
                         weights=None, reduction="mean", return_aux=False, transpose_w=False, implementation=None):
    """Softmax cross-entropy of the logits ``x @ w`` against integer ``labels``, the logits
    never stored: the LM head and its loss in one op.

    Equal to ``jaxbwd.cross_entropy(cap(jaxbwd.matmul(x, w)), labels, ...)`` with
    ``cap(z) = logit_softcap * tanh(z / logit_softcap)`` (Gemma 2; identity when None),
    except that the logits are kept in f32 (the unfused path rounds them to x's dtype
    first). Per token, with ``lse = logsumexp(z)``, ``eps = label_smoothing``, V classes:

        loss = lse - (1 - eps) * z[label] - eps / V * sum(z) + z_loss * lse**2

    (optax's smoothed softmax cross-entropy plus PaLM's z-loss, as :func:`jaxbwd.cross_entropy`).

    Args:
      x: [..., D] float32, bfloat16 or float16 (float64 on the XLA path): the final hidden states.
      w: [D, V] (a Dense kernel, ``flax.linen.Dense``/``nnx.Linear`` layout), or with
        ``transpose_w=True`` [V, D] (an embedding table, ``nn.Embed.embedding``: a tied
        head ``x @ table.T`` without a transposed copy). Floating; x and w of different
        dtypes are both cast to their result type.
      labels: [...] integer, x's leading shape. Tokens whose label equals ``ignore_index``,
        or lies outside [0, V), are ignored: loss 0, gradient 0, not counted by "mean".
      ignore_index: static Python int.
      label_smoothing: static float in [0, 1].
      z_loss: static float >= 0.
      logit_softcap: ``None`` or a static positive float.
      weights: ``None`` or [...] float per-token weights (differentiable): each token's loss
        (z-loss included) is multiplied by its weight.
      reduction: ``"mean"`` (the weighted mean over non-ignored tokens,
        ``sum(w_i loss_i) / sum(w_i)`` over them, the plain mean without weights; 0 when
        the denominator is 0, also for negative weights summing to 0), ``"sum"``, or
        ``"none"`` ([...] per-token weighted losses).
      return_aux: also return ``{"lse": [...] f32, "z_loss": [...] f32}``: each token's
        logsumexp (for every token, ignored or not) and its unweighted z-loss term
        ``z_loss * lse**2`` (0 on ignored tokens), e.g. for logging.
      transpose_w: whether w is [V, D] (see w).
      implementation: ``None`` (Pallas on GPU, XLA elsewhere), ``"pallas"`` or ``"xla"``.

    Returns:
      The loss, a scalar ("mean", "sum") or [...] ("none"), in ``result_type(x, w)``; with
      ``return_aux`` a pair ``(loss, aux)``.

    Residuals: x, w, the labels (int32) and per token the max and the shifted sum of
    exponentials of its logits (f32): O(tokens) beyond x and w; no [tokens, V] array is
    saved, and none is formed: the forward and the backward walk the vocabulary in blocks
    (Pallas tiles, or XLA chunks of at most ``CHUNK_ELEMENTS`` logits) and recompute them.
    Both round the logits' gradient ``dz`` (cotangent x token weight x ``softmax -
    onehot``) to x's dtype for the dx and dw dots; in float16 an entry beyond 65504 makes
    those gradients inf (dynamic loss scaling backs off from it).

    Raises:
      TypeError: x or w not floating, labels not integer, weights not floating, a traced
        static parameter, return_aux or transpose_w not a bool.
      ValueError: x of rank 0, w not rank 2 or not matching x's D, an empty vocabulary,
        labels' or weights' shape not x.shape[:-1], label_smoothing outside [0, 1] or
        z_loss < 0 (either not finite), logit_softcap <= 0 or not finite, unknown
        reduction or implementation; x of symbolic shape (``jax.export``: the XLA path
        sizes its token chunks from the token count).
      Also the errors common to every op (``help(jaxbwd)``).

    Source: Wijmans et al., "Cut Your Losses in Large-Vocabulary Language Models" (ICLR
    2025): logits recomputed blockwise from x and w, only the lse stored; the gradient
    ``dz = g ((1 + 2 z_loss lse) softmax - (1 - eps) onehot - eps / V)``, ``dx = dz w^T``,
    ``dw = x^T dz``; the online softmax of Milakov & Gimelshein (2018).
    """
    op = "linear_cross_entropy"
    B.check_float(op, "x", x)
    B.check_float(op, "w", w)
    B.check_ndim(op, "x", x, min_ndim=1, what="([..., D])")
    B.check_ndim(op, "w", w, ndim=2, what="([V, D])" if transpose_w is True else "([D, V])")
    if not isinstance(transpose_w, (bool, np.bool_)):
        raise TypeError(f"jaxbwd.{op}: transpose_w must be a bool, got {transpose_w!r}")
    if not isinstance(return_aux, (bool, np.bool_)):
        raise TypeError(f"jaxbwd.{op}: return_aux must be a bool, got {return_aux!r}")
    D = x.shape[-1]
    d_axis = 1 if transpose_w else 0
    if w.shape[d_axis] != D:
        want = f"[V, D={D}]" if transpose_w else f"[D={D}, V]"
        raise ValueError(f"jaxbwd.{op}: w must have shape {want} to match x's last dim, got {tuple(w.shape)}")
    V = int(w.shape[1 - d_axis])
    if V < 1:
        raise ValueError(f"jaxbwd.{op}: w must have at least one vocabulary entry (V >= 1), got shape {tuple(w.shape)}")
    labels = B.check_int(op, "labels", labels)
    B.check_shape(op, "labels", labels, x.shape[:-1], what="(x.shape[:-1])")
    ignore_index, eps, z = check_options(op, ignore_index, label_smoothing, z_loss)
    cap = None
    if logit_softcap is not None:
        cap = B.check_static_number(op, "logit_softcap", logit_softcap)
        if not cap > 0.0:
            raise ValueError(f"jaxbwd.{op}: logit_softcap must be None or > 0, got {logit_softcap!r}")
    if weights is not None:
        B.check_float(op, "weights", weights)
        B.check_shape(op, "weights", weights, x.shape[:-1], what="(x.shape[:-1])")
    if reduction not in REDUCTIONS:
        raise ValueError(f"jaxbwd.{op}: reduction must be one of 'mean', 'sum', 'none', got {reduction!r}")

    dtype = jnp.result_type(x, w)
    B.require_static(op, "x's shape", x.shape, "the logits are computed in chunks sized from the token count")
    PC.check_index_range(op, tokens=int(np.prod(x.shape[:-1])), D=D, V=V)
    impl = B.impl(implementation, op, x, w, weights)

    def run(x, w, labels, axes):
        x2, lead = B.rows(x)
        lab = _valid_labels(labels.reshape(-1), V, ignore_index)
        rows = _lce(x2, w, lab, _Cfg(eps, cap, bool(transpose_w), V, axes, impl))
        return rows.T.reshape(lead + (2,))

    # "v": the vocabulary may stay sharded (vocab-parallel: the op combines the shards
    # itself); the token dims "..." may be sharded (data-parallel); D is gathered if sharded.
    sig = "...D,vD,...->...K" if transpose_w else "...D,Dv,...->...K"
    rows = S.partitioned(sig, run, x.astype(dtype), w.astype(dtype), labels, axes_of="v")
    # Per-token [...] vectors from here on (no reshape: they may be sharded over the tokens).
    loss, lse = rows[..., 0], rows[..., 1]
    valid = _valid_labels(labels, V, ignore_index) >= 0
    zterm = jnp.where(valid, z * lse * lse, 0.0) if z else jnp.zeros_like(lse)
    loss = loss + zterm
    wts = None if weights is None else weights.astype(loss.dtype)
    if wts is not None:
        loss = loss * wts
    if reduction == "none":
        out = loss
    else:
        out = jnp.sum(loss)
        if reduction == "mean":
            den = jnp.sum(valid).astype(loss.dtype) if wts is None else jnp.sum(jnp.where(valid, wts, 0.0))
            # Weights may be negative, so the numerator need not vanish with den.
            out = jnp.where(den == 0, 0.0, out / jnp.where(den == 0, 1.0, den))
    out = out.astype(dtype)
    if return_aux:
        return out, {"lse": lse, "z_loss": zterm}
    return out
