"""dot_product_attention: custom_vjp whose residuals are q, k, v, out and the f32 logsumexp.

Pallas path: the flash-attention forward kernel emits out and lse; the backward runs the
FlashAttention-2 dk/dv and dq kernels (``jaxbwd/pallas/attention.py``). XLA path: the same
algorithm blockwise over keys with ``lax.scan`` (online softmax forward, recompute-from-lse
backward), so it too never saves (or holds at once) a T x S array.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxbwd.pallas import attention as kernels
from jaxbwd.vjp import _base as B
from jaxbwd import sharding as S
from jaxbwd.sharding import vary_like

OP = "dot_product_attention"
# Keys per step of the XLA path: the scan holds [B, N, T, XLA_BLOCK] logits at a time.
XLA_BLOCK = 512
MAX_PALLAS_HEAD_DIM = 256


@dataclasses.dataclass(frozen=True)
class _Cfg:
    scale: float
    causal: bool
    window: Optional[int]
    softcap: Optional[float]
    segments: bool
    impl: B.Impl


def _dims(q, k, cfg: _Cfg) -> kernels.Dims:
    Bsz, T, N, H = q.shape
    return kernels.Dims(Bsz, T, k.shape[1], N, k.shape[2], H, cfg.scale, cfg.causal, cfg.window,
                        cfg.softcap, cfg.segments)


# ------------------------------------------------------------------------------ XLA path
def _xla_blocks(S: int):
    bk = min(S, XLA_BLOCK)
    nb = -(-S // bk)
    return bk, nb


def _xla_mask(cfg: _Cfg, T, cols, qseg, kseg_j):
    """[B or 1, 1, 1, T, bk] mask of query rows vs key columns ``cols``."""
    r, c = jnp.arange(T)[:, None], cols[None, :]
    m = kernels.position_mask(jnp.ones((T, cols.shape[0]), bool), r, c, cfg.causal, cfg.window)[None]
    if cfg.segments:
        m = m & (qseg[:, :, None] == kseg_j[:, None, :])
    return m[:, None, None]


def _xla_prep(q, k, v, kseg, cfg):
    """q as [B, K, G, T, H] in the accumulation dtype; k, v, kseg split into key blocks."""
    Bsz, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    acc = B.acc_dtype(q)
    bk, nb = _xla_blocks(S)
    pad = nb * bk - S
    qf = q.astype(acc).reshape(Bsz, T, K, G, H).transpose(0, 2, 3, 1, 4)

    def blocks(x):  # [B, S, K, H] -> [nb, B, K, bk, H]
        x = jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)))
        return x.reshape(Bsz, nb, bk, K, H).transpose(1, 0, 3, 2, 4)

    if cfg.segments:
        # Padded keys get a segment id no query has (masked below by the column bound too).
        ks = jnp.pad(kseg, ((0, 0), (0, pad)), constant_values=0)
        ks = ks.reshape(Bsz, nb, bk).transpose(1, 0, 2)
    else:
        ks = jnp.zeros((nb, 1, bk), jnp.int32)
    cols = (jnp.arange(nb)[:, None] * bk + jnp.arange(bk)[None, :])
    return qf, blocks(k), blocks(v), ks, cols, acc


def _xla_logits(cfg, qf, kj, acc):
    s = jnp.einsum("bkgth,bksh->bkgts", qf, kj.astype(acc)) * cfg.scale
    if cfg.softcap is None:
        return s, None
    t = jnp.tanh(s / cfg.softcap)
    return cfg.softcap * t, t


def _xla_fwd(q, k, v, qseg, kseg, cfg):
    Bsz, T, N, H = q.shape
    S = k.shape[1]
    qf, kb, vb, ksb, colsb, acc = _xla_prep(q, k, v, kseg, cfg)
    shape = qf.shape[:-1]  # [B, K, G, T]

    def step(carry, xs):
        o, m, l = carry
        kj, vj, ksj, cols = xs
        s, _ = _xla_logits(cfg, qf, kj, acc)
        mask = _xla_mask(cfg, T, cols, qseg, ksj) & (cols < S)
        s = jnp.where(mask, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp(m - m_safe)
        p = jnp.exp(s - m_safe[..., None])
        l = alpha * l + jnp.sum(p, axis=-1)
        o = o * alpha[..., None] + jnp.einsum("bkgts,bksh->bkgth", p, vj.astype(acc))
        return (o, m_new, l), None

    init = (jnp.zeros(qf.shape, acc), jnp.full(shape, -jnp.inf, acc), jnp.zeros(shape, acc))
    (o, m, l), _ = jax.lax.scan(step, vary_like(init, qf, kb), (kb, vb, ksb, colsb))
    seen = l > 0
    o = o / jnp.where(seen, l, 1.0)[..., None]
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
    out = o.transpose(0, 3, 1, 2, 4).reshape(Bsz, T, N, H).astype(q.dtype)
    return out, lse.reshape(Bsz, N, T).astype(jnp.float32 if acc == jnp.float32 else acc)


def _xla_bwd(q, k, v, qseg, kseg, o, lse, do, cfg):
    Bsz, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    qf, kb, vb, ksb, colsb, acc = _xla_prep(q, k, v, kseg, cfg)
    dof = do.astype(acc).reshape(Bsz, T, K, G, H).transpose(0, 2, 3, 1, 4)
    of = o.astype(acc).reshape(Bsz, T, K, G, H).transpose(0, 2, 3, 1, 4)
    delta = jnp.sum(of * dof, axis=-1)  # [B, K, G, T]
    lse = lse.astype(acc).reshape(Bsz, K, G, T)

    def step(dq, xs):
        kj, vj, ksj, cols = xs
        kjf, vjf = kj.astype(acc), vj.astype(acc)
        s, t = _xla_logits(cfg, qf, kj, acc)
        mask = _xla_mask(cfg, T, cols, qseg, ksj) & (cols < S)
        p = jnp.where(mask, jnp.exp(jnp.where(mask, s - lse[..., None], 0.0)), 0.0)
        dv = jnp.einsum("bkgts,bkgth->bksh", p, dof)
        dp = jnp.einsum("bkgth,bksh->bkgts", dof, vjf)
        ds = p * (dp - delta[..., None])
        if t is not None:
            ds = ds * (1.0 - t * t)
        dk = jnp.einsum("bkgts,bkgth->bksh", ds, qf) * cfg.scale
        dq = dq + jnp.einsum("bkgts,bksh->bkgth", ds, kjf) * cfg.scale
        return dq, (dk, dv)

    dq, (dk, dv) = jax.lax.scan(step, vary_like(jnp.zeros(qf.shape, acc), qf, kb, dof), (kb, vb, ksb, colsb))

    def unblock(x):  # [nb, B, K, bk, H] -> [B, S, K, H]
        nb, _, _, bk, _ = x.shape
        return x.transpose(1, 0, 3, 2, 4).reshape(Bsz, nb * bk, K, H)[:, :S]

    dq = dq.transpose(0, 3, 1, 2, 4).reshape(Bsz, T, N, H)
    return dq.astype(q.dtype), unblock(dk).astype(k.dtype), unblock(dv).astype(v.dtype)


# ------------------------------------------------------------------------ the custom_vjp
def _fwd_impl(q, k, v, qseg, kseg, cfg: _Cfg):
    if not cfg.impl.pallas:
        return _xla_fwd(q, k, v, qseg, kseg, cfg)
    d = _dims(q, k, cfg)
    o2, lse = kernels.attention_fwd(
        q.reshape(d.B * d.T, d.N * d.H), k.reshape(d.B * d.S, d.K * d.H), v.reshape(d.B * d.S, d.K * d.H),
        qseg, kseg, d, interpret=cfg.impl.interpret,
    )
    return o2.reshape(q.shape), lse.reshape(d.B, d.N, d.T)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attention(q, k, v, qseg, kseg, cfg):
    return _fwd_impl(q, k, v, qseg, kseg, cfg)[0]


def _attention_fwd(q, k, v, qseg, kseg, cfg):
    out, lse = _fwd_impl(q, k, v, qseg, kseg, cfg)
    return out, (q, k, v, qseg, kseg, out, lse)


def _attention_bwd(cfg, res, do):
    q, k, v, qseg, kseg, out, lse = res
    if cfg.impl.pallas:
        d = _dims(q, k, cfg)
        dq, dk, dv = kernels.attention_bwd(
            q.reshape(d.B * d.T, d.N * d.H), k.reshape(d.B * d.S, d.K * d.H), v.reshape(d.B * d.S, d.K * d.H),
            qseg, kseg, out.reshape(d.B * d.T, d.N * d.H), lse.reshape(d.B * d.N, d.T),
            do.reshape(d.B * d.T, d.N * d.H), d, interpret=cfg.impl.interpret,
        )
        dq, dk, dv = dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)
    else:
        dq, dk, dv = _xla_bwd(q, k, v, qseg, kseg, out, lse, do, cfg)
    return dq, dk, dv, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


# ----------------------------------------------------------------------------- checks
def _check(q, k, v, segment_ids, scale, is_causal, sliding_window, logit_softcap):
    for name, x in (("q", q), ("k", k), ("v", v)):
        B.check_float(OP, name, x)
    B.check_ndim(OP, "q", q, ndim=4, what="([B, T, N, H])")
    Bsz, T, N, H = q.shape
    B.check_ndim(OP, "k", k, ndim=4, what="([B, S, K, H])")
    S, K = k.shape[1], k.shape[2]
    B.check_nonempty_axis(OP, "k", k, 1, "key axis S")
    if k.shape[0] != Bsz or k.shape[3] != H:
        raise ValueError(
            f"jaxbwd.{OP}: k must have shape [B={Bsz}, S, K, H={H}] (q's batch and head dim), "
            f"got {tuple(k.shape)}"
        )
    B.check_shape(OP, "v", v, k.shape, what="(k's shape [B, S, K, H])")
    if K == 0 or N % K != 0:
        raise ValueError(
            f"jaxbwd.{OP}: q's head count N must be a multiple of k's head count K "
            f"(N % K == 0), got N={N}, K={K}"
        )
    B.check_same_dtype(OP, ("q", "k", "v"), (q, k, v))
    qseg = kseg = None
    if segment_ids is not None:
        if isinstance(segment_ids, (tuple, list)):
            if len(segment_ids) != 2:
                raise ValueError(
                    f"jaxbwd.{OP}: segment_ids must be an array [B, T] or a pair ([B, T], [B, S]), "
                    f"got a sequence of length {len(segment_ids)}"
                )
            qseg, kseg = segment_ids
            B.check_int(OP, "segment_ids[0]", qseg)
            B.check_int(OP, "segment_ids[1]", kseg)
            B.check_shape(OP, "segment_ids[0]", qseg, (Bsz, T), what="([B, T])")
            B.check_shape(OP, "segment_ids[1]", kseg, (Bsz, S), what="([B, S])")
        else:
            B.check_int(OP, "segment_ids", segment_ids)
            if T != S:
                raise ValueError(
                    f"jaxbwd.{OP}: segment_ids must be a pair ([B, T], [B, S]) when T != S, "
                    f"got one array of shape {tuple(segment_ids.shape)} for T={T}, S={S}"
                )
            B.check_shape(OP, "segment_ids", segment_ids, (Bsz, T), what="([B, T])")
            qseg = kseg = segment_ids
        qseg, kseg = qseg.astype(jnp.int32), kseg.astype(jnp.int32)
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"jaxbwd.{OP}: is_causal must be a Python bool, got {is_causal!r}")
    scale = H ** -0.5 if scale is None else B.check_static_number(OP, "scale", scale)
    window = None
    if sliding_window is not None:
        if isinstance(sliding_window, jax.core.Tracer):
            raise TypeError(f"jaxbwd.{OP}: sliding_window must be a static Python int, got a traced value")
        if isinstance(sliding_window, (bool, np.bool_)) or not isinstance(sliding_window, (int, np.integer)):
            raise TypeError(f"jaxbwd.{OP}: sliding_window must be a positive int, got {sliding_window!r}")
        if sliding_window <= 0:
            raise ValueError(f"jaxbwd.{OP}: sliding_window must be a positive int, got {sliding_window!r}")
        window = int(sliding_window)
    softcap = None
    if logit_softcap is not None:
        B.check_positive(OP, "logit_softcap", logit_softcap)
        softcap = float(logit_softcap)
    return qseg, kseg, float(scale), bool(is_causal), window, softcap


def dot_product_attention(q, k, v, *, scale=None, is_causal=False, segment_ids=None,
                          sliding_window=None, logit_softcap=None, implementation=None):
    """Multi-head (and grouped-query) scaled dot-product attention, flash style.

    ``out = softmax(mask(softcap(scale * q k^T))) v`` per head, never building the T x S
    matrix on the Pallas path, and only [B, N, T, 512] blocks of it on the XLA path.

    Args:
      q: [B, T, N, H] float32, bfloat16 or float16 (float64 on the XLA path).
      k, v: [B, S, K, H], q's dtype, with N % K == 0. K < N is grouped-query attention
        (query head n uses kv head n // (N // K)); K == 1 is multi-query attention.
      scale: static float multiplying the logits; default 1 / sqrt(H).
      is_causal: query i sees key j only when j <= i (top-left aligned, as
        ``jax.nn.dot_product_attention``; with T != S row i is still compared to column i).
      segment_ids: int [B, T] (T == S) or a pair (q_ids [B, T], kv_ids [B, S]): a query
        sees only keys with its own id (sequence packing).
      sliding_window: static positive int w: query i sees keys j with i - w < j (and
        j < i + w when not causal), i.e. (i - w, i] when causal.
      logit_softcap: static positive float c: logits -> c * tanh(logits / c) before masking
        (Gemma 2).
      implementation: ``None`` (Pallas on GPU, XLA elsewhere), ``"pallas"`` or ``"xla"``.

    Returns:
      [B, T, N, H] in q's dtype. A query row that sees no key gives 0 and zero gradients.
      Softmax statistics and accumulators are float32.

    Residuals: q, k, v, out (aliases of live arrays), the logsumexp [B, N, T] float32 and
    the segment ids: O(B*N*T) beyond the inputs, no T x S array.

    Raises:
      TypeError: non-floating or mixed q/k/v dtypes, non-integer segment_ids, traced or
        non-numeric scale/sliding_window/logit_softcap, non-bool is_causal.
      ValueError: q/k/v not rank 4, k/v batch or head dim (H) different from q's, v's shape
        not k's, N % K != 0, segment_ids of the wrong shape, sliding_window <= 0,
        logit_softcap <= 0, head dim > 256 on the Pallas path, unknown implementation.

    Source: Dao, "FlashAttention-2" (2023), Algorithm 1 (forward with logsumexp) and
    Algorithm 2 (backward recomputing P from the logsumexp); Gemma Team, "Gemma 2" (2024) for
    the logit softcap, whose derivative 1 - tanh^2 the backward applies.
    """
    qseg, kseg, scale, causal, window, softcap = _check(
        q, k, v, segment_ids, scale, is_causal, sliding_window, logit_softcap
    )
    impl = B.impl(implementation, OP, q, k)
    if impl.pallas and q.shape[-1] > MAX_PALLAS_HEAD_DIM:
        raise ValueError(
            f"jaxbwd.{OP}: q's head dim H must be <= {MAX_PALLAS_HEAD_DIM} for the Pallas kernels, "
            f"got H={q.shape[-1]} (use implementation='xla')"
        )
    cfg = _Cfg(scale, causal, window, softcap, qseg is not None, impl)
    return S.partitioned("bTnH,bSnH,bSnH,bT,bS->bTnH", lambda *a: _attention(*a, cfg), q, k, v, qseg, kseg)
