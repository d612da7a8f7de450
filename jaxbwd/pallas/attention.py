"""Flash-attention kernels: forward with logsumexp, FlashAttention-2 backward (dk/dv, dq).

Layout. The kernels read q, out, dout as free [B*T, N*H] views of [B, T, N, H] and k, v as
[B*S, K*H] views of [B, S, K, H]: the tile of head n, rows r, head-dim columns h is
``x2[b*T + r, n*H + h]``, so no transpose is ever made. Head dims are padded to a power of
two (>= 16) by masking the loads, sequence tails by masking rows/columns. The logsumexp
``lse`` and ``delta = rowsum(out * dout)`` are f32 [B*N, T].

Forward (Dao 2023, FlashAttention-2, Algorithm 1): one program per (query block, b*N + n)
walks the key blocks with an online softmax and writes out and lse. Backward (Algorithm 2,
split into two kernels so that nothing is accumulated with atomics):

- ``attention_bwd_dkdv``: one program per (key block, b*K + kv head). It loops over the
  G = N/K query heads of its kv group and over their query blocks, recomputes
  ``P = exp(S - lse)`` and accumulates ``dV += P^T dO`` and ``dK += dS^T Q`` in f32, so GQA
  gradients come out with K heads directly. Where the tuning table says ``keys_first`` it
  computes the transposed tiles ``S^T = K Q^T`` and ``dP^T = V dO^T`` instead, so that the
  key block is the M dimension of all four dots (f32 with TF32 dots on sm_90: wgmma for
  every dot at head_dim 64, and the registers for 32 x 32 tiles at 256; on sm_80 at 256).
- ``attention_bwd_dq``: one program per (query block, b*N + n), ``dQ += dS K``.

Where the tuning table gives a kernel a ``head_split`` (f32 forward and dq at head_dim 256
on sm_90/sm_100, the tangent pass there on sm_100), the grid has a last axis over that many
column parts of the head dim: each program keeps only its part's columns of the accumulator
and writes only those, and recomputes the score tile (dq also the dP tile, the tangent pass
the dS tile) from all parts (``_parts``).

with ``dS = P * (dO V^T - delta)`` times ``1 - tanh^2`` under a logit softcap (Gemma 2).
Exponentials are ``exp2`` of base-2 logits, ``log2(e)`` folded into the scale (see
``_logits``); ``lse`` is stored in natural units.
Causal and sliding-window masks bound the loops, and so do segment ids (each block's
range of ids gives the range of blocks that can match: ``segment_block_bounds``), so fully
masked blocks are skipped; in the forward and dq kernels the per-element mask is applied
only on the blocks that need one (the causal diagonal, sequence tails, window edges, segment
ids): their loops are split into an unmasked and a masked range (dk/dv, and dq for f32,
mask every block: a second loop body spills there). A query row that sees no key has lse = -inf,
output 0 and zero gradients (the masked ``where`` never lets exp(-inf + inf) through).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxbwd.pallas import _common as C
from jaxbwd.pallas import _tuning

NEG_INF = float("-inf")
_LN2 = math.log(2.0)


@dataclasses.dataclass(frozen=True)
class Dims:
    """Static description of one attention problem (hashable: a kernel parameter)."""

    B: int
    T: int
    S: int
    N: int
    K: int
    H: int
    scale: float
    causal: bool
    window: Optional[int]
    softcap: Optional[float]
    segments: bool

    @property
    def G(self) -> int:
        return self.N // self.K

    @property
    def Hp(self) -> int:
        return max(16, C.next_pow2(self.H))


_BLOCKS: contextvars.ContextVar[Optional[tuple]] = contextvars.ContextVar("jaxbwd_attention_blocks", default=None)


@contextlib.contextmanager
def block_sizes(block_q: int, block_k: int):
    """Overrides the kernels' (power-of-two) block sizes while tracing; for tests of tails
    and multi-block loops at small shapes. Blocks under 16 only work in interpret mode."""
    token = _BLOCKS.set((int(block_q), int(block_k)))
    try:
        yield
    finally:
        _BLOCKS.reset(token)


_KERNEL = {"fwd": "attention_fwd", "dkdv": "attention_bwd_dkdv", "dq": "attention_bwd_dq", "jvp": "attention_jvp"}


def _config(d: Dims, kind: str, dtype=jnp.bfloat16):
    """The tuning table's configuration of kernel ``kind`` ("fwd", "dkdv", "dq" or "jvp"),
    block sizes replaced by ``block_sizes`` when set.

    Head dims over 64 run 8 warps (two warpgroups). Hopper's wgmma splits a dot's M rows
    between the warpgroups only when M >= 128; with 64-row accumulators both warpgroups
    compute the same rows and every exp and mask is done twice (seen in the compiled SASS:
    ``python -m jaxbwd compile``). So on sm_90+ with 16-bit inputs dq, whose accumulator is
    [block_q, H], takes 128 query rows (compiled at head_dim 128: ex2 and instructions per
    S element halved, no spills). Not on sm_80 at head_dim 128 (mma.sync is per warp: no
    replica, and 128 rows take 255 registers), and not for dk/dv: its two [block_k, H] f32
    accumulators at block_k = 128 need 128 registers per thread by themselves and the kernel
    spills. 16-bit dk/dv on sm_90 instead keeps 64 key rows on 4 warps, one warpgroup: no
    replica either (255 registers at head_dim 128, no spills). f32 (TF32) takes its own
    tiles where the 16-bit ones spilled: on sm_90 128 query rows on 8 warps with 32-key
    blocks for dq (and the forward at head_dim 64), and for dk/dv 16 query rows against
    64 key rows at head_dim 80-128, one stage; dk/dv computes S^T = K Q^T (the table's
    ``keys_first``) at head_dims 64 and 256 on sm_90, 256 on sm_80; the forward and dq at
    head_dim 256 split the head dim between two programs on sm_90 and sm_100 (the table's
    ``head_split``, see ``_parts``). sm_100 (B200) takes
    sm_90's tiles except where they compiled worse there (e.g. f32 dk/dv at head_dim 80-128
    on 64 x 64, every dot on tcgen05). Under 3xTF32 the table's ``f32/x3`` tiles. The table
    is ``_tuning``'s.
    """
    cfg = _tuning.attention(_KERNEL[kind], d.Hp, dtype, d.T, d.S)
    over = _BLOCKS.get()
    if over is not None:
        cfg = dataclasses.replace(cfg, block_m=over[0], block_n=over[1])
    return cfg


def _blocks(d: Dims, kind: str, dtype=jnp.bfloat16):
    """(block_q, block_k, num_warps) of kernel ``kind`` (see ``_config``)."""
    cfg = _config(d, kind, dtype)
    return cfg.block_m, cfg.block_n, cfg.num_warps


def _cdiv_traced(x, n: int):
    return C.idiv(x + (n - 1), n)


def _kv_range(d: Dims, r0, bq: int, bk: int):
    """Key blocks [lo, hi) that query rows [r0, r0 + bq) may see (causal/window bounds)."""
    hi_col = d.S
    if d.causal:
        hi_col = jnp.minimum(d.S, r0 + bq)
    elif d.window is not None:
        hi_col = jnp.minimum(d.S, r0 + bq - 1 + d.window)
    lo = 0
    if d.window is not None:
        lo = C.idiv(jnp.maximum(0, r0 - d.window + 1), bk)
    return lo, _cdiv_traced(hi_col, bk) if not isinstance(hi_col, int) else C.cdiv(hi_col, bk)


def _q_range(d: Dims, c0, bq: int, bk: int):
    """Query blocks [lo, hi) whose rows may see keys [c0, c0 + bk)."""
    lo = 0
    if d.causal:
        lo = C.idiv(jnp.minimum(c0, d.T), bq)
    elif d.window is not None:
        lo = C.idiv(jnp.maximum(0, c0 - d.window + 1), bq)
    if d.window is not None:
        hi = _cdiv_traced(jnp.minimum(d.T, c0 + bk - 1 + d.window), bq)
    else:
        hi = C.cdiv(d.T, bq)
    return lo, hi


def _unmasked_kv_end(d: Dims, r0, bq: int, bk: int, lo, hi):
    """End m of the key blocks [lo, m) that need no mask for query rows [r0, r0 + bq):
    whole blocks inside S and, under causality, left of the diagonal block; ``lo`` (none)
    with a window or segment ids. The rest [m, hi) takes the per-element mask. Query rows
    past T need none: their q is zero, their results are never stored."""
    if d.segments or d.window is not None:
        return lo
    m = d.S // bk
    if d.causal:
        m = jnp.minimum(m, C.idiv(r0 + 1, bk))
    return jnp.maximum(lo, jnp.minimum(hi, m))


def segment_block_bounds(seg_rows, seg_cols, block_rows: int, block_cols: int):
    """For each row block, the column blocks [lo, hi) holding a segment id in the block's
    [min, max] id range: int32 [B * row_blocks, 2]. Columns outside it match no row of the
    block, so the kernels skip them (exact for any ids; tight for packed, sorted ids).
    Costs a [B, row_blocks, cols] comparison in XLA, no T x S array."""
    Bsz, R = seg_rows.shape
    Cn = seg_cols.shape[1]
    nrb = C.cdiv(R, block_rows)
    rs = jnp.pad(seg_rows, ((0, 0), (0, nrb * block_rows - R)), mode="edge").reshape(Bsz, nrb, block_rows)
    mn, mx = rs.min(axis=-1)[..., None], rs.max(axis=-1)[..., None]
    inside = (seg_cols[:, None, :] >= mn) & (seg_cols[:, None, :] <= mx)  # [B, nrb, cols]
    pos = jnp.arange(Cn, dtype=jnp.int32)
    lo = jnp.min(jnp.where(inside, pos, Cn), axis=-1) // block_cols
    hi = (jnp.max(jnp.where(inside, pos + 1, 0), axis=-1) + block_cols - 1) // block_cols
    return jnp.stack([lo, hi], axis=-1).reshape(Bsz * nrb, 2).astype(jnp.int32)


def _seg_range(d: Dims, bnd_ref, b, blk, n_blocks: int, lo, hi):
    """Intersects a loop range [lo, hi) with the segment bounds of block ``blk``."""
    if not d.segments:
        return lo, hi
    row = b * n_blocks + blk
    return jnp.maximum(lo, bnd_ref[row, 0]), jnp.minimum(hi, bnd_ref[row, 1])


def position_mask(m, r, c, causal: bool, window):
    """``m`` and the positional rule of query r vs key c: causal ``c <= r``; window w keeps
    ``r - w < c`` (and ``c < r + w`` when not causal). Shared by the kernels and the XLA path."""
    if causal:
        m = m & (c <= r)
    if window is not None:
        m = m & (c > r - window)
        if not causal:
            m = m & (c < r + window)
    return m


def _mask(d: Dims, rows, cols, qseg, kseg, keys_first: bool = False):
    """The mask of a [rows, cols] score tile, or of its transpose [cols, rows] with ``keys_first``."""
    r, c = (rows[None, :], cols[:, None]) if keys_first else (rows[:, None], cols[None, :])
    m = position_mask((r < d.T) & (c < d.S), r, c, d.causal, d.window)
    if qseg is not None:
        m = m & ((qseg[None, :] == kseg[:, None]) if keys_first else (qseg[:, None] == kseg[None, :]))
    return m


def _dot_parts(a, b):
    """``sum_i a[i] b[i]^T`` over matching head-dim parts (tuples from :func:`_parts`)."""
    return functools.reduce(lambda x, y: x + y, (C.dot(x, y, trans_b=True) for x, y in zip(a, b)))


def _logits(d: Dims, q, k):
    """The logits in base-2 units, ``log2(e) * scale * q k^T`` (f32), and, under a softcap,
    ``t = tanh(scale * q k^T / c)`` for the backward. ``q`` and ``k`` are tuples of
    head-dim parts (:func:`_parts`), summed over.

    Base 2 because the kernels exponentiate with ``exp2`` (one MUFU.EX2; ``exp`` is libdevice
    ``expf``, about ten instructions): ``log2(e)`` folds into the multiply by ``scale`` (or
    by the softcap ``c``) that happens anyway, so ``exp(s - m) = exp2(s2 - m2)`` costs
    nothing extra (the FlashAttention-2/Triton tutorial trick).
    """
    qk = _dot_parts(q, k)
    if d.softcap is None:
        return qk * (d.scale * C.LOG2E), None
    t, dt = C.tanh_with_grad(qk, d.scale / d.softcap)
    return (d.softcap * C.LOG2E) * t, dt


def _tile(ref, b, L, rows, head, H, Hp, rmask, c0=0):
    """Tile [len(rows), Hp] of head ``head``'s columns [c0, c0 + Hp) from a [B*L, heads*H]
    view, native dtype."""
    hc = c0 + jnp.arange(Hp, dtype=jnp.int32)
    idx = ((b * L + rows)[:, None], (head * H + hc)[None, :])
    mask = rmask[:, None] & (hc < H)[None, :]
    return idx, mask, C.load(ref, idx, mask, dtype=ref.dtype)


def _parts(d: Dims, split: int):
    """This program's head-dim part under a split of the head dim into ``split`` column
    parts (the grid's last axis): the part's width and the column offsets of all parts,
    this program's first. Its accumulator and results are its part's columns only; the
    score tile needs every column, so each part recomputes it from all parts' tiles.

    Why: at head_dim 256 in f32 a [64, 256] accumulator alone takes 128 registers per
    thread of a warpgroup, and every 64-row tile (wgmma's M) spilled. Two parts halve it,
    for 1.5x the forward's tensor-core work (S twice) and 1.67x dq's (S and dP twice).
    The parts of one block run in different waves, so the second reads its operands from
    HBM again where L2 no longer holds them: at the registry's head_dim-256 case (f32, 4096
    tokens, window 1024) at most 96 MiB more in the forward (q and k) and 192 MiB in dq (q,
    k, v, dO), 20-40 us at 4.8 TB/s: at most 10-15% of their tensor-core time at TF32's
    dense peak of 495 TFLOP/s (an estimate, not measured). With the parts as the first
    axis, side by side, dq spilled 8-32 B. Each part sums the per-part products of S
    starting with its own, so the parts' copies of S may differ in the last bit (rounding
    only)."""
    if split == 1:
        return d.Hp, (0,)
    p = pl.program_id(2)
    return d.Hp // split, tuple(((p + o) % split) * (d.Hp // split) for o in range(split))


def _check_split(d: Dims, split: int, kernel: str) -> int:
    """``split`` after checking that it cuts the padded head dim into parts of >= 16 columns
    (Triton's smallest dot). Raises ValueError naming the kernel."""
    if split > 1 and (d.Hp % split or d.Hp // split < 16):
        raise ValueError(f"{kernel}: head_split {split} must divide the padded head dim {d.Hp} "
                         f"into parts of at least 16 columns")
    return split


def _tiles(ref, b, L, rows, head, d: Dims, rmask, w, offsets):
    """The tiles of every head-dim part (:func:`_parts`), this program's first, and the
    index and mask of this program's part (where its results go)."""
    out = [_tile(ref, b, L, rows, head, d.H, w, rmask, c0) for c0 in offsets]
    return out[0][0], out[0][1], tuple(t for _, _, t in out)


def _split_grid(grid: tuple, split: int) -> tuple:
    return grid + (split,) if split > 1 else grid


def _s_meta(rows: int, cols: int, split: int) -> dict:
    """Metadata for ``python -m jaxbwd compile``: the score tile of one loop step and, under a
    head-dim split, how many programs compute each tile (its per-S-element figures)."""
    return {"s_tile": f"{rows}x{cols}", **({"s_repeats": str(split)} if split > 1 else {})}


def _query_block(d: Dims, bq: int):
    """Where a program over (query block i, b*N + n) works: i, bh, b, n, its kv head, the
    query rows and their in-bounds mask (the forward, dq and jvp kernels share this grid).

    Causal: the grid runs the query blocks of each head last-first, the heaviest (they see
    the most keys) launched first, so that the light ones fill the last wave's gaps."""
    i, bh = pl.program_id(0), pl.program_id(1)
    if d.causal:
        i = C.cdiv(d.T, bq) - 1 - i
    b, n = bh // d.N, bh % d.N
    rows = i * bq + jnp.arange(bq, dtype=jnp.int32)
    return i, bh, b, n, n // d.G, rows, rows < d.T


def _segs(d: Dims, qs_ref, ks_ref, b, rows, rmask, cols, cmask):
    if not d.segments:
        return None, None
    qs = C.load(qs_ref, (b, rows), rmask, other=-1, dtype=jnp.int32) if rows is not None else None
    ks = C.load(ks_ref, (b, cols), cmask, other=-2, dtype=jnp.int32) if cols is not None else None
    return qs, ks


# ---------------------------------------------------------------------------- forward
def _fwd_kernel(*refs, d: Dims, bq: int, bk: int, split: int):
    if d.segments:
        q_ref, k_ref, v_ref, qs_ref, ks_ref, bnd_ref, o_ref, lse_ref = refs
    else:
        (q_ref, k_ref, v_ref, o_ref, lse_ref), qs_ref, ks_ref, bnd_ref = refs, None, None, None
    i, bh, b, n, kvh, rows, rmask = _query_block(d, bq)
    w, offs = _parts(d, split)
    q_idx, q_mask, q = _tiles(q_ref, b, d.T, rows, n, d, rmask, w, offs)
    qs, _ = _segs(d, qs_ref, ks_ref, b, rows, rmask, None, None)

    def body(j, carry, masked: bool):
        acc, m, l = carry
        cols = j * bk + jnp.arange(bk, dtype=jnp.int32)
        cmask = cols < d.S
        _, _, k = _tiles(k_ref, b, d.S, cols, kvh, d, cmask, w, offs)
        _, _, v = _tile(v_ref, b, d.S, cols, kvh, d.H, w, cmask, offs[0])
        s, _ = _logits(d, q, k)  # base 2: m and the exponents below are too
        if masked:
            _, ks = _segs(d, qs_ref, ks_ref, b, None, None, cols, cmask)
            s = jnp.where(_mask(d, rows, cols, qs, ks), s, NEG_INF)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)
        alpha = C.exp2(m - m_safe)
        p = C.exp2(s - m_safe[:, None])
        l = alpha * l + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + C.dot(p.astype(v.dtype), v)
        return acc, m_new, l

    lo, hi = _seg_range(d, bnd_ref, b, i, C.cdiv(d.T, bq), *_kv_range(d, i * bq, bq, bk))
    mid = _unmasked_kv_end(d, i * bq, bq, bk, lo, hi)
    init = (jnp.zeros((bq, w), jnp.float32), jnp.full((bq,), NEG_INF, jnp.float32), jnp.zeros((bq,), jnp.float32))
    carry = lax.fori_loop(lo, mid, functools.partial(body, masked=False), init)
    acc, m, l = lax.fori_loop(mid, hi, functools.partial(body, masked=True), carry)
    seen = l > 0.0
    out = acc / jnp.where(seen, l, 1.0)[:, None]
    C.store(o_ref, q_idx, out, q_mask)
    # The residual stays in natural units: lse = ln(2) * (m2 + log2(l)).
    lse = jnp.where(seen, (m + jnp.log2(jnp.where(seen, l, 1.0))) * _LN2, NEG_INF)
    C.store(lse_ref, (bh, rows), lse, rmask & (offs[0] == 0))  # one part writes it


def _flops(d: Dims) -> int:
    return 4 * d.B * d.N * d.T * d.S * d.H // (2 if d.causal else 1)


def attention_fwd(q2, k2, v2, qseg, kseg, d: Dims, *, interpret: bool = False):
    """Flash-attention forward.

    Args:
      q2: [B*T, N*H] view of q; k2, v2: [B*S, K*H] views of k, v; qseg [B, T], kseg [B, S]
        int32 (or ``None`` when ``d.segments`` is False).
    Returns:
      out [B*T, N*H] in q's dtype and lse [B*N, T] float32 (-inf for rows that see no key).
    """
    cfg = _config(d, "fwd", q2.dtype)
    bq, bk, nw = cfg.block_m, cfg.block_n, cfg.num_warps
    segs = (qseg, kseg, segment_block_bounds(qseg, kseg, bq, bk)) if d.segments else ()
    inputs = (q2, k2, v2) + segs
    out_shape = [jax.ShapeDtypeStruct(q2.shape, q2.dtype), jax.ShapeDtypeStruct((d.B * d.N, d.T), jnp.float32)]
    split = _check_split(d, cfg.head_split, "attention_fwd")
    kernel = functools.partial(_fwd_kernel, d=d, bq=bq, bk=bk, split=split)
    return C.call(
        kernel, name="attention_fwd", grid=_split_grid((C.cdiv(d.T, bq), d.B * d.N), split), out_shape=out_shape,
        interpret=interpret, num_warps=nw, num_stages=cfg.num_stages, flops=_flops(d) * (split + 1) // 2,
        metadata=_s_meta(bq, bk, split),
        transcendentals=split * d.B * d.N * d.T * d.S // (2 if d.causal else 1),
        bytes_accessed=C.nbytes(*inputs) + (split - 1) * C.nbytes(q2, k2) + C.nbytes(q2) + 4 * d.B * d.N * d.T,
    )(*inputs)


# --------------------------------------------------------------------------- backward
def _p_ds(d: Dims, q, k, v, do, lse, delta, mask, keys_first: bool = False):
    """P (f32) and dS (f32, softcap derivative applied, scale not applied) of one tile from
    the head-dim parts of q, k, v, do (tuples, :func:`_parts`); ``mask`` None for a block
    that needs none. With ``keys_first`` their transposes P^T and
    dS^T ([keys, queries]), from S^T = K Q^T and dP^T = V dO^T computed as such."""
    row = (lambda x: x[None, :]) if keys_first else (lambda x: x[:, None])
    s, dt = _logits(d, k, q) if keys_first else _logits(d, q, k)
    p = C.exp2(s - row(lse * C.LOG2E))
    if mask is not None:
        p = jnp.where(mask, p, 0.0)
    dp = _dot_parts(v, do) if keys_first else _dot_parts(do, v)
    ds = p * (dp - row(delta))
    if dt is not None:
        ds = ds * dt
    return p, ds


def _dkdv_kernel(*refs, d: Dims, bq: int, bk: int, keys_first: bool, split: int):
    if d.segments:
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qs_ref, ks_ref, bnd_ref, dk_ref, dv_ref = refs
    else:
        (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref), qs_ref, ks_ref, bnd_ref = refs, None, None, None
    j, bkh = pl.program_id(0), pl.program_id(1)
    b, kvh = bkh // d.K, bkh % d.K
    cols = j * bk + jnp.arange(bk, dtype=jnp.int32)
    cmask = cols < d.S
    w, offs = _parts(d, split)
    kv_idx, kv_mask, k = _tiles(k_ref, b, d.S, cols, kvh, d, cmask, w, offs)
    _, _, v = _tiles(v_ref, b, d.S, cols, kvh, d, cmask, w, offs)
    _, ks = _segs(d, qs_ref, ks_ref, b, None, None, cols, cmask)
    lo, hi = _seg_range(d, bnd_ref, b, j, C.cdiv(d.S, bk), *_q_range(d, j * bk, bq, bk))

    def head(g, carry):
        n = kvh * d.G + g

        def body(i, carry, masked: bool):
            dk, dv = carry
            rows = i * bq + jnp.arange(bq, dtype=jnp.int32)
            rmask = rows < d.T
            _, _, q = _tiles(q_ref, b, d.T, rows, n, d, rmask, w, offs)
            _, _, do = _tiles(do_ref, b, d.T, rows, n, d, rmask, w, offs)
            lse = C.load(lse_ref, (b * d.N + n, rows), rmask)
            delta = C.load(delta_ref, (b * d.N + n, rows), rmask)
            mask = None
            if masked:
                qs, _ = _segs(d, qs_ref, ks_ref, b, rows, rmask, None, None)
                mask = _mask(d, rows, cols, qs, ks, keys_first)
            p, ds = _p_ds(d, q, k, v, do, lse, delta, mask, keys_first)
            dv = dv + C.dot(p.astype(do[0].dtype), do[0], trans_a=not keys_first)
            dk = dk + C.dot(ds.astype(q[0].dtype), q[0], trans_a=not keys_first)
            return dk, dv

        # Always masked: a second, unmasked copy of this loop body (the blocks below the
        # causal diagonal) compiled to 255 registers and spills on H200 at head_dim 128.
        return lax.fori_loop(lo, hi, functools.partial(body, masked=True), carry)

    zeros = jnp.zeros((bk, w), jnp.float32)
    dk, dv = lax.fori_loop(0, d.G, head, (zeros, zeros))
    C.store(dk_ref, kv_idx, dk * d.scale, kv_mask)
    C.store(dv_ref, kv_idx, dv, kv_mask)


def _dq_kernel(*refs, d: Dims, bq: int, bk: int, split: int):
    if d.segments:
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qs_ref, ks_ref, bnd_ref, dq_ref = refs
    else:
        (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref), qs_ref, ks_ref, bnd_ref = refs, None, None, None
    i, bh, b, n, kvh, rows, rmask = _query_block(d, bq)
    w, offs = _parts(d, split)
    q_idx, q_mask, q = _tiles(q_ref, b, d.T, rows, n, d, rmask, w, offs)
    _, _, do = _tiles(do_ref, b, d.T, rows, n, d, rmask, w, offs)
    lse = C.load(lse_ref, (bh, rows), rmask)
    delta = C.load(delta_ref, (bh, rows), rmask)
    qs, _ = _segs(d, qs_ref, ks_ref, b, rows, rmask, None, None)

    def body(j, dq, masked: bool):
        cols = j * bk + jnp.arange(bk, dtype=jnp.int32)
        cmask = cols < d.S
        _, _, k = _tiles(k_ref, b, d.S, cols, kvh, d, cmask, w, offs)
        _, _, v = _tiles(v_ref, b, d.S, cols, kvh, d, cmask, w, offs)
        mask = None
        if masked:
            _, ks = _segs(d, qs_ref, ks_ref, b, None, None, cols, cmask)
            mask = _mask(d, rows, cols, qs, ks)
        _, ds = _p_ds(d, q, k, v, do, lse, delta, mask)
        return dq + C.dot(ds.astype(k[0].dtype), k[0])

    lo, hi = _seg_range(d, bnd_ref, b, i, C.cdiv(d.T, bq), *_kv_range(d, i * bq, bq, bk))
    dq = jnp.zeros((bq, w), jnp.float32)
    if q_ref.dtype != jnp.float32:
        mid = _unmasked_kv_end(d, i * bq, bq, bk, lo, hi)
        dq = lax.fori_loop(lo, mid, functools.partial(body, masked=False), dq)
        lo = mid
    # f32 keeps one masked loop: the unmasked copy adds spills at 255 registers (H200, head_dim 80).
    dq = lax.fori_loop(lo, hi, functools.partial(body, masked=True), dq)
    C.store(dq_ref, q_idx, dq * d.scale, q_mask)


def attention_bwd(q2, k2, v2, qseg, kseg, o2, lse, do2, d: Dims, *, interpret: bool = False):
    """FlashAttention-2 backward: dq [B*T, N*H], dk and dv [B*S, K*H] in the inputs' dtypes.

    ``delta = rowsum(out * dout)`` (f32 [B*N, T]) is computed by XLA: one fused read of out
    and dout. Arguments are the views described in :func:`attention_fwd`.
    """
    delta = jnp.sum(
        (o2.astype(jnp.float32) * do2.astype(jnp.float32)).reshape(d.B, d.T, d.N, d.H), axis=-1
    ).transpose(0, 2, 1).reshape(d.B * d.N, d.T)
    base = (q2, k2, v2, do2, lse, delta)
    cfg = _config(d, "dkdv", q2.dtype)
    bq, bk, nw = cfg.block_m, cfg.block_n, cfg.num_warps
    kv_inputs = base + ((qseg, kseg, segment_block_bounds(kseg, qseg, bk, bq)) if d.segments else ())
    nbytes = C.nbytes(*base)
    split = _check_split(d, cfg.head_split, "attention_bwd_dkdv")
    dkdv = C.call(
        functools.partial(_dkdv_kernel, d=d, bq=bq, bk=bk, keys_first=cfg.keys_first, split=split),
        name="attention_bwd_dkdv", grid=_split_grid((C.cdiv(d.S, bk), d.B * d.K), split),
        out_shape=[jax.ShapeDtypeStruct(k2.shape, k2.dtype), jax.ShapeDtypeStruct(v2.shape, v2.dtype)],
        interpret=interpret, num_warps=nw, num_stages=cfg.num_stages, flops=_flops(d) * (split + 1),
        transcendentals=split * _flops(d) // (4 * d.H),
        bytes_accessed=split * nbytes + C.nbytes(k2, v2),
        metadata=_s_meta(bk, bq, split),
    )
    dk, dv = dkdv(*kv_inputs)
    cfg = _config(d, "dq", q2.dtype)
    bq, bk, nw = cfg.block_m, cfg.block_n, cfg.num_warps
    inputs = base + ((qseg, kseg, segment_block_bounds(qseg, kseg, bq, bk)) if d.segments else ())
    split = _check_split(d, cfg.head_split, "attention_bwd_dq")
    dq = C.call(
        functools.partial(_dq_kernel, d=d, bq=bq, bk=bk, split=split), name="attention_bwd_dq",
        grid=_split_grid((C.cdiv(d.T, bq), d.B * d.N), split), out_shape=jax.ShapeDtypeStruct(q2.shape, q2.dtype),
        interpret=interpret, num_warps=nw, num_stages=cfg.num_stages, flops=_flops(d) * (2 * split + 1) // 2,
        metadata=_s_meta(bq, bk, split),
        transcendentals=split * _flops(d) // (4 * d.H), bytes_accessed=split * nbytes + C.nbytes(q2),
    )(*inputs)
    return dq, dk, dv


# ------------------------------------------------------------------------ forward mode
def _jvp_kernel(*refs, d: Dims, bq: int, bk: int, split: int):
    if d.segments:
        q_ref, k_ref, v_ref, o_ref, lse_ref, dq_ref, dk_ref, dv_ref, qs_ref, ks_ref, bnd_ref, do_ref = refs
    else:
        (q_ref, k_ref, v_ref, o_ref, lse_ref, dq_ref, dk_ref, dv_ref, do_ref), qs_ref, ks_ref, bnd_ref = (
            refs, None, None, None)
    i, bh, b, n, kvh, rows, rmask = _query_block(d, bq)
    w, offs = _parts(d, split)
    o_idx, o_mask, q = _tiles(q_ref, b, d.T, rows, n, d, rmask, w, offs)
    _, _, dq = _tiles(dq_ref, b, d.T, rows, n, d, rmask, w, offs)
    lse = C.load(lse_ref, (bh, rows), rmask)
    qs, _ = _segs(d, qs_ref, ks_ref, b, rows, rmask, None, None)

    def body(j, carry):
        acc, rs = carry
        cols = j * bk + jnp.arange(bk, dtype=jnp.int32)
        cmask = cols < d.S
        # v and dv enter only the accumulator: this program's part alone (the loads in the
        # order of the unsplit kernel's, which compiles as before with head_split 1)
        _, _, k = _tiles(k_ref, b, d.S, cols, kvh, d, cmask, w, offs)
        _, _, v = _tile(v_ref, b, d.S, cols, kvh, d.H, w, cmask, offs[0])
        _, _, dk = _tiles(dk_ref, b, d.S, cols, kvh, d, cmask, w, offs)
        _, _, dv = _tile(dv_ref, b, d.S, cols, kvh, d.H, w, cmask, offs[0])
        _, ks = _segs(d, qs_ref, ks_ref, b, None, None, cols, cmask)
        s, dt = _logits(d, q, k)  # base 2, as lse * log2(e)
        p = jnp.where(_mask(d, rows, cols, qs, ks), C.exp2(s - (lse * C.LOG2E)[:, None]), 0.0)
        ds = (_dot_parts(dq, k) + _dot_parts(q, dk)) * d.scale
        if dt is not None:
            ds = ds * dt
        pds = p * ds
        acc = acc + C.dot(p.astype(dv.dtype), dv) + C.dot(pds.astype(v.dtype), v)
        return acc, rs + jnp.sum(pds, axis=1)

    lo, hi = _seg_range(d, bnd_ref, b, i, C.cdiv(d.T, bq), *_kv_range(d, i * bq, bq, bk))
    init = (jnp.zeros((bq, w), jnp.float32), jnp.zeros((bq,), jnp.float32))
    acc, rs = lax.fori_loop(lo, hi, body, init)
    _, _, o = _tile(o_ref, b, d.T, rows, n, d.H, w, rmask, offs[0])
    C.store(do_ref, o_idx, acc - rs[:, None] * o.astype(jnp.float32), o_mask)


def attention_jvp(q2, k2, v2, qseg, kseg, o2, lse, dq2, dk2, dv2, d: Dims, *, interpret: bool = False):
    """Output tangent of attention from the forward's residuals, one pass over key blocks.

    With ``P = exp(S - lse)`` recomputed per tile (lse from :func:`attention_fwd`, so no
    online rescaling is needed) and ``dS = scale * (dq k^T + q dk^T)`` (times ``1 - tanh^2``
    under a softcap): ``dO = P dV + (P * dS) V - rowsum(P * dS) * O``. One program per
    (query block, b*N + n), as the forward; memory O(T): no T x S array.

    Args:
      q2, dq2, o2: [B*T, N*H] views; k2, v2, dk2, dv2: [B*S, K*H] views; lse [B*N, T] f32;
        qseg, kseg as in :func:`attention_fwd`.
    Returns:
      dO [B*T, N*H] in q's dtype.
    """
    cfg = _config(d, "jvp", q2.dtype)
    bq, bk, nw = cfg.block_m, cfg.block_n, cfg.num_warps
    segs = (qseg, kseg, segment_block_bounds(qseg, kseg, bq, bk)) if d.segments else ()
    inputs = (q2, k2, v2, o2, lse, dq2, dk2, dv2) + segs
    split = _check_split(d, cfg.head_split, "attention_jvp")
    # 5 units of _flops(d) / 2: S, dq k^T, q dk^T (each part recomputes them), P dV, (P*dS) V
    return C.call(
        functools.partial(_jvp_kernel, d=d, bq=bq, bk=bk, split=split), name="attention_jvp",
        grid=_split_grid((C.cdiv(d.T, bq), d.B * d.N), split), out_shape=jax.ShapeDtypeStruct(q2.shape, q2.dtype),
        interpret=interpret, num_warps=nw, num_stages=cfg.num_stages, flops=(3 * split + 2) * _flops(d) // 2,
        transcendentals=split * d.B * d.N * d.T * d.S // (2 if d.causal else 1),
        bytes_accessed=split * C.nbytes(q2, k2, lse, dq2, dk2, *segs) + C.nbytes(o2, v2, dv2) + C.nbytes(q2),
        metadata=_s_meta(bq, bk, split),
    )(*inputs)
