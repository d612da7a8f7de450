"""dot_product_attention: custom derivatives whose residuals are q, k, v, out and the f32 logsumexp.

Pallas path: the flash-attention forward kernel emits out and lse; the backward runs the
FlashAttention-2 dk/dv and dq kernels (``jaxbwd/pallas/attention.py``), or, with the Mosaic
backend (``config.use(pallas_backend="mosaic")``, Hopper, 16-bit inputs, H <= 256), the
warp-specialized Mosaic GPU kernels of ``jaxbwd/pallas/mosaic/attention.py`` with the same
residuals (the forward-mode tangent stays on the Triton kernel). XLA path: the same
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
from jaxbwd.vjp._derivatives import custom_op
from jaxbwd import config, sharding as S
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
def _xla_blocks(S: int, block: int):
    if not B.is_static_shape((S,)):  # jax.export with a symbolic key length: one block of S
        return S, 1
    bk = min(S, block)
    nb = -(-S // bk)
    return bk, nb


def _xla_mask(cfg: _Cfg, T, cols, qseg, kseg_j):
    """[B or 1, 1, 1, T, bk] mask of query rows vs key columns ``cols``."""
    r, c = jnp.arange(T)[:, None], cols[None, :]
    m = kernels.position_mask(jnp.ones((T, cols.shape[0]), bool), r, c, cfg.causal, cfg.window)[None]
    if cfg.segments:
        m = m & (qseg[:, :, None] == kseg_j[:, None, :])
    return m[:, None, None]


def _xla_prep(q, k, v, kseg, cfg, block):
    """q as [B, K, G, T, H] in the accumulation dtype; k, v, kseg split into key blocks."""
    Bsz, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    acc = B.acc_dtype(q)
    bk, nb = _xla_blocks(S, block)
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


# Module-level jits with the configuration and the key block (XLA_BLOCK, read by the caller)
# static: the scan bodies below are closures made per call, which JAX's scan cache cannot
# match, so without them every eager call retraced and recompiled its scan (115-355 ms per
# eager forward at 2 heads of 32, against 1 ms).
@functools.partial(jax.jit, static_argnames=("cfg", "block"))
def _xla_fwd(q, k, v, qseg, kseg, cfg, block):
    Bsz, T, N, H = q.shape
    S = k.shape[1]
    qf, kb, vb, ksb, colsb, acc = _xla_prep(q, k, v, kseg, cfg, block)
    shape = qf.shape[:-1]  # [B, K, G, T]
    # Masked scores and the running max's start are the lowest finite value, not -inf, and
    # masked p is 0 by the mask: the same result, and no inf for jax.debug_infs to flag when
    # the op runs eagerly.
    low = jnp.finfo(acc).min

    def step(carry, xs):
        o, m, l = carry
        kj, vj, ksj, cols = xs
        s, _ = _xla_logits(cfg, qf, kj, acc)
        mask = _xla_mask(cfg, T, cols, qseg, ksj) & (cols < S)
        s = jnp.where(mask, s, low)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        l = alpha * l + jnp.sum(p, axis=-1)
        o = o * alpha[..., None] + jnp.einsum("bkgts,bksh->bkgth", p, vj.astype(acc))
        return (o, m_new, l), None

    init = (jnp.zeros(qf.shape, acc), jnp.full(shape, low, acc), jnp.zeros(shape, acc))
    (o, m, l), _ = jax.lax.scan(step, vary_like(init, qf, kb), (kb, vb, ksb, colsb))
    seen = l > 0
    o = o / jnp.where(seen, l, 1.0)[..., None]
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
    out = o.transpose(0, 3, 1, 2, 4).reshape(Bsz, T, N, H).astype(q.dtype)
    return out, lse.reshape(Bsz, N, T).astype(jnp.float32 if acc == jnp.float32 else acc)


@functools.partial(jax.jit, static_argnames=("cfg", "block"))
def _xla_bwd(q, k, v, qseg, kseg, o, lse, do, cfg, block):
    Bsz, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    qf, kb, vb, ksb, colsb, acc = _xla_prep(q, k, v, kseg, cfg, block)
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


@functools.partial(jax.jit, static_argnames=("cfg", "block"))
def _xla_tangent(q, k, v, qseg, kseg, o, lse, dq, dk, dv, cfg, block):
    """Output tangent from the residuals, blockwise over keys (no T x S array is held).

    With P = softmax(S) recomputed from lse and dS the logits' tangent
    (``scale * (dq k^T + q dk^T)``, times ``1 - tanh^2`` under a softcap):
    ``dO = P dV + (P * dS) V - rowsum(P * dS) * O``, since
    ``dP = P * (dS - rowsum(P * dS))``. One pass over key blocks accumulates the first two
    terms and the row sums; memory O(T) like the forward.
    """
    Bsz, T, N, H = q.shape
    S = k.shape[1]
    qf, kb, vb, ksb, colsb, acc = _xla_prep(q, k, v, kseg, cfg, block)
    dqf, dkb, dvb, _, _, _ = _xla_prep(dq, dk, dv, kseg, cfg, block)
    K, G = qf.shape[1], qf.shape[2]
    of = o.astype(acc).reshape(Bsz, T, K, G, H).transpose(0, 2, 3, 1, 4)
    lse = lse.astype(acc).reshape(Bsz, K, G, T)

    def step(carry, xs):
        do, rs = carry
        kj, vj, dkj, dvj, ksj, cols = xs
        s, t = _xla_logits(cfg, qf, kj, acc)
        mask = _xla_mask(cfg, T, cols, qseg, ksj) & (cols < S)
        p = jnp.where(mask, jnp.exp(jnp.where(mask, s - lse[..., None], 0.0)), 0.0)
        ds = (jnp.einsum("bkgth,bksh->bkgts", dqf, kj.astype(acc))
              + jnp.einsum("bkgth,bksh->bkgts", qf, dkj.astype(acc))) * cfg.scale
        if t is not None:
            ds = ds * (1.0 - t * t)
        pds = p * ds
        do = do + jnp.einsum("bkgts,bksh->bkgth", p, dvj.astype(acc)) \
            + jnp.einsum("bkgts,bksh->bkgth", pds, vj.astype(acc))
        return (do, rs + jnp.sum(pds, axis=-1)), None

    init = (jnp.zeros(qf.shape, acc), jnp.zeros(qf.shape[:-1], acc))
    (do, rs), _ = jax.lax.scan(step, vary_like(init, qf, kb, dqf), (kb, vb, dkb, dvb, ksb, colsb))
    do = do - rs[..., None] * of
    return do.transpose(0, 3, 1, 2, 4).reshape(Bsz, T, N, H).astype(q.dtype)


# ------------------------------------------------------------------- the custom derivative
def _kernels(cfg: _Cfg):
    """The kernel module of the resolved Pallas backend (same signatures, same residuals)."""
    if cfg.impl.mosaic:
        from jaxbwd.pallas.mosaic import attention as mosaic_kernels  # imported when chosen

        return mosaic_kernels
    return kernels


def _fwd_impl(q, k, v, qseg, kseg, cfg: _Cfg):
    if not cfg.impl.pallas:
        return _xla_fwd(q, k, v, qseg, kseg, cfg, XLA_BLOCK)
    d = _dims(q, k, cfg)
    o2, lse = _kernels(cfg).attention_fwd(
        q.reshape(d.B * d.T, d.N * d.H), k.reshape(d.B * d.S, d.K * d.H), v.reshape(d.B * d.S, d.K * d.H),
        qseg, kseg, d, interpret=cfg.impl.interpret,
    )
    return o2.reshape(q.shape), lse.reshape(d.B, d.N, d.T)


@functools.partial(custom_op, nondiff_argnums=(5,), name=OP)
def _attention(q, k, v, qseg, kseg, cfg):
    return _fwd_impl(q, k, v, qseg, kseg, cfg)[0]


def _attention_fwd(q, k, v, qseg, kseg, cfg):
    out, lse = _fwd_impl(q, k, v, qseg, kseg, cfg)
    return out, (q, k, v, qseg, kseg, out, lse)


def _attention_bwd(cfg, res, do):
    q, k, v, qseg, kseg, out, lse = res
    if cfg.impl.pallas:
        d = _dims(q, k, cfg)
        dq, dk, dv = _kernels(cfg).attention_bwd(
            q.reshape(d.B * d.T, d.N * d.H), k.reshape(d.B * d.S, d.K * d.H), v.reshape(d.B * d.S, d.K * d.H),
            qseg, kseg, out.reshape(d.B * d.T, d.N * d.H), lse.reshape(d.B * d.N, d.T),
            do.reshape(d.B * d.T, d.N * d.H), d, interpret=cfg.impl.interpret,
        )
        dq, dk, dv = dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)
    else:
        dq, dk, dv = _xla_bwd(q, k, v, qseg, kseg, out, lse, do, cfg, XLA_BLOCK)
    return dq, dk, dv, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def _attention_tangent(cfg, res, dq, dk, dv, dqseg, dkseg):
    q, k, v, qseg, kseg, out, lse = res
    if not cfg.impl.pallas:
        return _xla_tangent(*res, dq, dk, dv, cfg, XLA_BLOCK)
    d = _dims(q, k, cfg)
    qv, kv = (d.B * d.T, d.N * d.H), (d.B * d.S, d.K * d.H)
    do = kernels.attention_jvp(
        q.reshape(qv), k.reshape(kv), v.reshape(kv), qseg, kseg, out.reshape(qv), lse.reshape(d.B * d.N, d.T),
        dq.reshape(qv), dk.reshape(kv), dv.reshape(kv), d, interpret=cfg.impl.interpret,
    )
    return do.reshape(q.shape)


_attention.deftangent(_attention_tangent)


# ----------------------------------------------------------------------------- checks
def _check_unbatched(q, k, v, segment_ids):
    """The shape checks that name shapes, for unbatched [T, N, H] inputs, in the caller's own
    shapes (the batched path, which they then take with a batch axis of 1, would show that axis)."""
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"jaxbwd.{OP}: key must have shape [S, K, H={q.shape[-1]}] (query's head dim; unbatched), "
                         f"got {tuple(k.shape)}")
    B.check_shape(OP, "value", v, k.shape, what="(key's shape [S, K, H]; unbatched)")
    T, S = q.shape[0], k.shape[0]
    seg = segment_ids
    if isinstance(seg, (tuple, list)) and len(seg) == 2 and all(hasattr(x, "shape") for x in seg):
        B.check_shape(OP, "segment_ids[0]", seg[0], (T,), what="([T]; unbatched)")
        B.check_shape(OP, "segment_ids[1]", seg[1], (S,), what="([S]; unbatched)")
    elif hasattr(seg, "shape"):
        if T != S:
            raise ValueError(f"jaxbwd.{OP}: segment_ids must be a pair ([T], [S]) when T != S (unbatched), got one "
                             f"array of shape {tuple(seg.shape)} for T={T}, S={S}")
        B.check_shape(OP, "segment_ids", seg, (T,), what="([T]; unbatched)")


def _check(q, k, v, segment_ids, scale, is_causal, sliding_window, logit_softcap):
    for name, x in (("query", q), ("key", k), ("value", v)):
        B.check_float(OP, name, x)
    B.check_ndim(OP, "query", q, ndim=4, what="([B, T, N, H])")
    Bsz, T, N, H = q.shape
    B.check_ndim(OP, "key", k, ndim=4, what="([B, S, K, H])")
    S, K = k.shape[1], k.shape[2]
    B.check_nonempty_axis(OP, "key", k, 1, "key axis S")
    B.check_nonempty_axis(OP, "query", q, 3, "head dim H")
    B.check_nonempty_axis(OP, "query", q, 2, "head axis N")
    B.check_nonempty_axis(OP, "key", k, 2, "head axis K")
    if k.shape[0] != Bsz or k.shape[3] != H:
        raise ValueError(
            f"jaxbwd.{OP}: key must have shape [B={Bsz}, S, K, H={H}] (query's batch and head dim), "
            f"got {tuple(k.shape)}"
        )
    B.check_shape(OP, "value", v, k.shape, what="(key's shape [B, S, K, H])")
    if N % K != 0:
        raise ValueError(
            f"jaxbwd.{OP}: query's head count N must be a multiple of key's head count K "
            f"(N % K == 0), got N={N}, K={K}"
        )
    B.check_same_dtype(OP, ("query", "key", "value"), (q, k, v))
    qseg = kseg = None
    if segment_ids is not None:
        if isinstance(segment_ids, (tuple, list)):
            if len(segment_ids) != 2:
                raise ValueError(
                    f"jaxbwd.{OP}: segment_ids must be an array [B, T] or a pair ([B, T], [B, S]), "
                    f"got a sequence of length {len(segment_ids)}"
                )
            qseg, kseg = segment_ids
            qseg = B.check_int(OP, "segment_ids[0]", qseg)
            kseg = B.check_int(OP, "segment_ids[1]", kseg)
            B.check_shape(OP, "segment_ids[0]", qseg, (Bsz, T), what="([B, T])")
            B.check_shape(OP, "segment_ids[1]", kseg, (Bsz, S), what="([B, S])")
        else:
            segment_ids = B.check_int(OP, "segment_ids", segment_ids)
            if T != S:
                raise ValueError(
                    f"jaxbwd.{OP}: segment_ids must be a pair ([B, T], [B, S]) when T != S, "
                    f"got one array of shape {tuple(segment_ids.shape)} for T={T}, S={S}"
                )
            B.check_shape(OP, "segment_ids", segment_ids, (Bsz, T), what="([B, T])")
            qseg = kseg = segment_ids
        qseg, kseg = _segment_ids_int32(qseg, kseg)
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"jaxbwd.{OP}: is_causal must be a Python bool, got {is_causal!r}")
    scale = H ** -0.5 if scale is None else B.check_static_number(OP, "scale", scale)
    window = None
    if sliding_window is not None:
        # Wider than any distance means no limit; the clamp keeps it int32-safe.
        window = min(B.static_int(OP, "sliding_window", sliding_window, minimum=1), T + S)
    softcap = None
    if logit_softcap is not None:
        B.check_positive(OP, "logit_softcap", logit_softcap)
        softcap = float(logit_softcap)
    return qseg, kseg, float(scale), bool(is_causal), window, softcap


def _expand4(name, x):
    """jax.nn's rule for bias and mask: fewer than 4 dims get leading unit dims."""
    B.check_array(OP, name, x)
    if x.ndim > 4:
        raise ValueError(f"jaxbwd.{OP}: {name} must have at most 4 dims ([B, N, T, S]), got shape {tuple(x.shape)}")
    return x.reshape((1,) * (4 - x.ndim) + x.shape)


def _check_dense(name, x, shape):
    try:
        if jnp.broadcast_shapes(x.shape, shape) == tuple(shape):
            return
    except ValueError:
        pass
    raise ValueError(f"jaxbwd.{OP}: {name} must broadcast to [B, N, T, S] = {tuple(shape)}, got {tuple(x.shape)}")


def _segment_ids_int32(qseg, kseg):
    """The ids as int32, equal exactly where the given ids are equal.

    A cast keeps that for 32-bit ids (it is one-to-one), not for 64-bit ones (2**32 and 0
    would meet): those are replaced by their ranks (:func:`_rank_ids`).
    """
    if jnp.dtype(qseg.dtype).itemsize <= 4 and jnp.dtype(kseg.dtype).itemsize <= 4:
        return qseg.astype(jnp.int32), kseg.astype(jnp.int32)
    dt = jnp.promote_types(qseg.dtype, kseg.dtype)
    if not jnp.issubdtype(dt, jnp.integer):  # int64 with uint64: no integer type holds both
        raise TypeError(
            f"jaxbwd.{OP}: segment_ids[0] and segment_ids[1] must have dtypes with a common "
            f"integer type, got {qseg.dtype} and {kseg.dtype}"
        )
    return _rank_ids(qseg.astype(dt), kseg.astype(dt))


def _rank_ids(qseg, kseg):
    """Each id replaced by its rank among its batch row's q and kv ids: int32 in [0, T + S),
    equal where the ids are equal, in the ids' order (sorted ids stay sorted, so the kernels'
    per-block id ranges still skip blocks). One sort per row, along the sequence only, so a
    batch-sharded call sorts locally."""
    ids = jnp.concatenate([qseg, kseg], axis=1)
    rank = jax.vmap(jnp.searchsorted)(jnp.sort(ids, axis=1), ids).astype(jnp.int32)
    return rank[:, :qseg.shape[1]], rank[:, qseg.shape[1]:]


def _check_lengths(name, x, Bsz, n):
    """int32 lengths clipped to [0, n] before the cast (64-bit lengths past int32 do not wrap)."""
    if x is None:
        return None
    x = B.check_int(OP, name, x)
    B.check_shape(OP, name, x, (Bsz,), what="([B])")
    return jnp.clip(x, 0, n).astype(jnp.int32)


def _local_window(local_window_size):
    if local_window_size is None:
        return None
    return B.static_int_pair(OP, "local_window_size", local_window_size, minimum=0)


def _mean_v_rows(out, v, empty):
    """Rows in ``empty`` ([B, T, N] or broadcastable) get mean(v) over all keys, as jax.nn
    (its masked logits are a large finite negative, so such a row's softmax is uniform)."""
    (Bsz, _, N, H), K = out.shape, v.shape[2]
    mean_v = jnp.mean(v.astype(B.acc_dtype(v)), axis=1)  # [B, K, H]
    # broadcast then merge (not jnp.repeat) so a head-sharded Explicit mesh needs no out_sharding
    mean_v = jnp.broadcast_to(mean_v[:, :, None], (Bsz, K, N // K, H)).reshape(Bsz, N, H)
    return jnp.where(empty[..., None], mean_v[:, None].astype(out.dtype), out)


def _dense_attention(q, k, v, bias, mask, jmask_fn, qseg, kseg, cfg: _Cfg):
    """The documented XLA path for dense ``bias``/``mask`` (and asymmetric non-causal local
    windows): [B, N, T, S] logits in float32, differentiated by XLA's autodiff (bias too).
    Returns the output and the [B, T, N] rows jax.nn's masks leave without a key."""
    Bsz, T, N, H = q.shape
    Skv, K = k.shape[1], k.shape[2]
    acc = B.acc_dtype(q)
    logits = B.dot_16bit(lambda q, k: jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=acc),
                         q.reshape(Bsz, T, K, N // K, H), k).reshape(Bsz, N, T, Skv) * cfg.scale
    if cfg.softcap is not None:
        logits = cfg.softcap * jnp.tanh(logits / cfg.softcap)
    if bias is not None:
        logits = logits + bias.astype(acc)
    r, c = jnp.arange(T)[:, None], jnp.arange(Skv)[None, :]
    jm = jmask_fn(r, c)  # [B or 1, 1, T, S]: jax.nn's positional and length masks
    if mask is not None:
        jm = jm & mask
    keep = jm
    if cfg.window is not None:
        keep = keep & kernels.position_mask(jnp.ones((T, Skv), bool), r, c, cfg.causal, cfg.window)
    if qseg is not None:
        keep = keep & (qseg[:, :, None] == kseg[:, None, :])[:, None]
    logits = jnp.where(keep, logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    e = jnp.exp(logits - jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0)))
    s = jnp.sum(e, axis=-1, keepdims=True)
    p = (e / jnp.where(s == 0, 1.0, s)).reshape(Bsz, K, N // K, T, Skv)
    out = jnp.einsum("bkgts,bskh->btkgh", p, v.astype(acc)).reshape(Bsz, T, N, H).astype(q.dtype)
    empty = ~jnp.any(jnp.broadcast_to(jm, (Bsz, N, T, Skv)), axis=-1)  # [B, N, T]
    return out, jnp.swapaxes(empty, 1, 2)


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                          query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
                          segment_ids=None, sliding_window=None, logit_softcap=None, implementation=None):
    """Multi-head (and grouped-query) scaled dot-product attention, flash style, with
    ``jax.nn.dot_product_attention``'s signature and meaning plus three extras.

    ``out = softmax(mask(softcap(scale * q k^T) + bias)) v`` per head, never building the
    T x S matrix on the kernel path (Pallas, or the blockwise XLA scan), which covers
    everything but dense ``bias``/``mask``.

    Args (jax.nn's):
      query: [B, T, N, H] or unbatched [T, N, H]; float32, bfloat16 or float16 (float64 on
        the XLA path).
      key, value: [B, S, K, H] (or [S, K, H]), query's dtype, with N % K == 0. K < N is
        grouped-query attention (query head n uses kv head n // (N // K)); K == 1 is MQA.
      bias: optional float array broadcastable to [B, N, T, S] (fewer dims get leading unit
        dims, as jax.nn), added to the logits (after the softcap). Differentiable.
      mask: optional boolean array broadcastable to [B, N, T, S]; True takes part.
      scale: static float multiplying the logits; default 1 / sqrt(H).
      is_causal: query i sees key j only when j <= i (top-left aligned, as jax.nn; with
        T != S row i is still compared to column i).
      query_seq_lengths: optional int [B]: rows i >= length give 0 (and no gradient), as jax.nn.
      key_value_seq_lengths: optional int [B]: keys j >= length take no part.
      local_window_size: optional int w or pair (left, right) of non-negative ints: query i
        sees keys j with i - left <= j <= i + right (w means (w, w)), as jax.nn.
      A query row that jax.nn's arguments (is_causal, mask, local_window_size,
      key_value_seq_lengths) leave without any key gives mean(value) over all S keys, as
      jax.nn does (its softmax over a fully masked row is uniform).

    Args (jaxbwd's extras; conventions differ from jax.nn's, as stated):
      segment_ids: int [B, T] (T == S) or a pair (q_ids [B, T], kv_ids [B, S]) ([T]/[S]
        when unbatched): a query sees only keys with its own id (sequence packing).
      sliding_window: static positive int w: query i sees keys j with i - w < j (and
        j < i + w when not causal). ``sliding_window=w`` is ``local_window_size=w - 1``
        (with ``is_causal``: ``(w - 1, 0)``); give one of the two.
      logit_softcap: static positive float c: logits -> c * tanh(logits / c) before bias
        and masking (Gemma 2).
      A row that only these extras leave without a key gives 0 and zero gradients.
      implementation: ``None`` (Pallas on GPU, XLA elsewhere; XLA also for head dims past
        256 and float64), ``"pallas"``, ``"xla"``, or ``"pallas:triton"``/``"pallas:mosaic"``
        to name the Pallas backend for this call (``jaxbwd.config``).

    Paths: without ``bias``/``mask`` the flash kernels (or the blockwise XLA scan) run and
    handle is_causal, local windows (``(l, r)`` with ``is_causal``, ``r == 0`` or ``l == r``:
    a causal or symmetric window in-kernel), segment ids, softcap and both seq lengths
    (key lengths become key segment ids in-kernel; query lengths zero rows after).
    With a dense ``bias`` or ``mask``, or a non-causal window with ``0 < r != l``, every
    implementation runs the documented dense XLA path: [B, N, T, S] float32 logits and
    XLA's autodiff (O(T*S) memory, as jax.nn's own XLA implementation). The implementation
    named is still checked against the operands: float64 with a Pallas one is a TypeError,
    ``"pallas:mosaic"`` for a dtype or head dim without a Mosaic kernel a ValueError.

    Returns:
      query's shape and dtype. Softmax statistics and accumulators are float32.

    Residuals (kernel path): q, k, v, out (aliases of live arrays), the logsumexp [B, N, T]
    float32 and the segment ids: O(B*N*T) beyond the inputs, no T x S array.

    Numerics: the backward's ``delta = rowsum(dout * out)`` reads ``out`` in its own dtype,
    as FlashAttention-2 does. In bfloat16/float16, with a peaked softmax (logits with a
    spread of ~10), ``dP - delta`` cancels and that rounding shows in dq/dk: median error
    ~1.7e-3 against ~4e-4 for autodiff of ``jax.nn.dot_product_attention`` (bf16, T=S=512,
    head dim 64, q/k ~ N(0, 9)); with flatter scores the two match. It is the price of not
    keeping the T x S probabilities. The kernels (Triton and Mosaic) round ``dS = P (dP -
    delta)`` to the inputs' dtype for the tensor-core dots that give dq and dk (and the
    tangent pass its ``P dS``), as FlashAttention-2 does; in float16 an entry beyond 65504
    (a loss-scaled cotangent) makes those gradients inf, which dynamic loss scaling sees
    and backs off from. The XLA implementation keeps dS in float32.

    Raises:
      TypeError: non-floating or mixed query/key/value dtypes, non-integer segment_ids or seq lengths,
        non-boolean mask, traced or non-numeric scale/sliding_window/logit_softcap/
        local_window_size, non-bool is_causal.
      ValueError: query/key/value not rank 4 (or all rank 3), an empty key axis, head axis
        or head dim, key/value batch or head dim (H) different from query's, value's shape
        not key's, N % K != 0,
        segment_ids or seq lengths of the wrong shape, bias/mask not broadcastable to
        [B, N, T, S], sliding_window <= 0, a negative or malformed local_window_size, both
        local_window_size and sliding_window,
        logit_softcap <= 0, scale or logit_softcap not finite, head dim > 256 with
        ``implementation="pallas"`` (with None it runs the XLA path), unknown implementation.
      Also the errors common to every op (``help(jaxbwd)``).

    Source: Dao, "FlashAttention-2" (2023), Algorithm 1 (forward with logsumexp) and
    Algorithm 2 (backward recomputing P from the logsumexp); Gemma Team, "Gemma 2" (2024) for
    the logit softcap, whose derivative 1 - tanh^2 the backward applies; jax.nn's
    ``dot_product_attention`` for the meaning of its arguments.
    """
    q, k, v = query, key, value
    if all(getattr(a, "ndim", None) == 3 for a in (q, k, v)):
        _check_unbatched(q, k, v, segment_ids)
        seg = segment_ids
        # arrays gain the batch axis; anything else goes on as it is, for the batched
        # path's check to name (a list of ints is not a (q, kv) pair)
        if isinstance(seg, (tuple, list)) and all(hasattr(s, "ndim") for s in seg):
            seg = tuple(s[None] for s in seg)
        elif hasattr(seg, "ndim"):
            seg = seg[None]
        out = dot_product_attention(
            q[None], k[None], v[None], bias, mask, scale=scale, is_causal=is_causal,
            query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
            local_window_size=local_window_size, segment_ids=seg, sliding_window=sliding_window,
            logit_softcap=logit_softcap, implementation=implementation)
        return out[0]
    lr = _local_window(local_window_size)
    if lr is not None and sliding_window is not None:
        raise ValueError(f"jaxbwd.{OP}: give local_window_size (jax.nn's meaning) or sliding_window, not both; "
                         f"got {local_window_size!r} and {sliding_window!r}")
    qseg, kseg, scale, causal, window, softcap = _check(
        q, k, v, segment_ids, scale, is_causal, sliding_window, logit_softcap
    )
    Bsz, T, N, _ = q.shape
    Skv = k.shape[1]
    qlen = _check_lengths("query_seq_lengths", query_seq_lengths, Bsz, T)
    kvlen = _check_lengths("key_value_seq_lengths", key_value_seq_lengths, Bsz, Skv)
    dense = bias is not None or mask is not None
    if bias is not None:
        bias = _expand4("bias", bias)
        B.check_float(OP, "bias", bias)
        _check_dense("bias", bias, (Bsz, N, T, Skv))
    if mask is not None:
        mask = _expand4("mask", mask)
        if mask.dtype != jnp.bool_:
            raise TypeError(f"jaxbwd.{OP}: mask must be a boolean array (True takes part), got {mask.dtype}")
        _check_dense("mask", mask, (Bsz, N, T, Skv))
    kcausal = causal
    if lr is not None:
        # A window past every query-key distance is no limit: clipped so int32 masks hold it.
        lr = tuple(min(x, T + Skv) for x in lr)
        left, right = lr
        if causal or right == 0:
            kcausal, window = True, left + 1
        elif left == right:
            window = left + 1
        else:
            dense = True

    def jmask(r, c):  # jax.nn's positional and key-length masks, [B or 1, 1, T, S]
        m = jnp.ones((T, Skv), bool)
        if causal:
            m = m & (c <= r)
        if lr is not None:
            m = m & (r <= c + lr[0]) & (r >= c - lr[1])
        m = m[None, None]
        if kvlen is not None:
            m = m & (c < kvlen[:, None, None, None])
        return m

    impl = B.impl(implementation, OP, q, k)
    if dense:
        out, empty = _dense_attention(q, k, v, bias, mask, jmask, qseg, kseg,
                                      _Cfg(scale, causal, window if lr is None else None, softcap, False, impl))
    else:
        if impl.pallas and q.shape[-1] > MAX_PALLAS_HEAD_DIM:
            if config.named(implementation):  # asked for by name: say so rather than fall back
                raise ValueError(
                    f"jaxbwd.{OP}: query's head dim H must be <= {MAX_PALLAS_HEAD_DIM} for the Pallas "
                    f"kernels, got H={q.shape[-1]} (use implementation='xla' or None)"
                )
            impl = B.Impl("xla", impl.interpret)
        if kvlen is not None:
            # Keys past the length get an id no query holds: masked in-kernel, no dense mask.
            # Ranked ids are >= 0, so -1 is free (min(ids) - 1 would wrap at int32's minimum).
            if qseg is None:
                qseg, kseg = jnp.zeros((Bsz, T), jnp.int32), jnp.zeros((Bsz, Skv), jnp.int32)
            else:
                qseg, kseg = _rank_ids(qseg, kseg)
            kseg = jnp.where(jnp.arange(Skv, dtype=kvlen.dtype)[None] < kvlen[:, None], kseg, -1)
        cfg = _Cfg(scale, kcausal, window, softcap, qseg is not None, impl)
        out = S.partitioned("bTnH,bSnH,bSnH,bT,bS->bTnH", lambda *a: _attention(*a, cfg), q, k, v, qseg, kseg)
        empty = None
        if lr is not None or kvlen is not None:
            # Row i's keys under jax.nn's masks form one interval [lo, hi]; empty when lo > hi.
            t = jnp.arange(T, dtype=jnp.int32)[None]
            lo = jnp.maximum(t - lr[0], 0) if lr is not None else jnp.zeros_like(t)
            hi = jnp.full((1, T), Skv - 1, jnp.int32)
            if causal:
                hi = jnp.minimum(hi, t)
            if lr is not None:
                hi = jnp.minimum(hi, t + lr[1])
            if kvlen is not None:
                hi = jnp.minimum(hi, kvlen[:, None] - 1)
            empty = jnp.broadcast_to((lo > hi)[:, :, None], (Bsz, T, N))
    if empty is not None:
        out = _mean_v_rows(out, v, empty)
    if qlen is not None:
        valid = jnp.arange(T, dtype=qlen.dtype)[None] < qlen[:, None]
        out = jnp.where(valid[:, :, None, None], out, jnp.zeros((), out.dtype))
    return out
