"""Flash attention on Mosaic GPU for Hopper (sm_90): forward with logsumexp, dq and dk/dv.

The same algorithm and residual contract as the Triton kernels (``jaxbwd/pallas/attention.py``:
out, and lse in natural units, f32 [B*N, T]; FlashAttention-2 backward with ``delta =
rowsum(out * dout)``), so either backend's backward accepts either forward's residuals.
What changes is how a Hopper SM is driven (Shah et al. 2024, FlashAttention-3):

- TMA copies blocks of q, k, v (and do, lse, delta, segment ids) into 128-byte-swizzled
  shared memory; wgmma reads its operands from there (the second operand always, the first
  from registers for P and dS) and accumulates in f32 registers.
- Warp specialization (FA3 Algorithm 1 for the forward, Algorithm 2's split for the
  backward): per CTA, consumer warpgroups own 64 rows each of the resident tile (q rows in
  the forward and dq, k/v rows in dk/dv) and one producer warpgroup streams the other
  operand's blocks through a ``stages``-slot ring (``_mgpu.produce``/``_mgpu.consume``).
  With two consumers the forward runs FA3's ping-pong schedule (``_mgpu.take_turn``): one
  consumer's softmax runs while the other's p v and next q k^T wgmmas do. dq and dk/dv do
  not use it.
- Exponentials are ``exp2`` of base-2 logits (``log2(e)`` folded into the scale), lse is
  converted to and from natural units at the edges. Under ``approx_math`` they compile to
  ``ex2.approx.ftz`` (as the Triton kernels' ``_common.exp2``), and a softcap's ``jnp.tanh``
  to ``tanh.approx.f32`` (one MUFU.TANH, FlashAttention's choice; about 1.1e-5 relative
  error as measured by N. Juffa, against 1.4e-7 absolute for the Triton kernels'
  ``_common.tanh_with_grad``, which costs two MUFU operations and a few ALU ones): a logit
  error of ``softcap * 1.1e-5``, below bf16's rounding of P (2**-9) at any softcap up to
  170, above f16's (2**-12) past 22 (README, Mosaic GPU).

Tiles (``_plan``, sized from the compiled registers): 64 rows per consumer warpgroup
(wgmma's M); every kernel streams blocks of 64 through two ring stages. Up to head dim 128:
two consumers (128 rows) per CTA in the forward and dq, and in dk/dv at head dim 64 (one
above it). Shared memory at head dim 128, bf16: forward 32 KiB q + 2 stages x (k + v) 64
KiB = 96 KiB; dq 64 KiB q/do + 64 KiB ring = 128 KiB; dk/dv (one consumer) 32 KiB k/v +
64 KiB ring = 96 KiB (of 227 KiB). Above 128 (Gemma's 256) a [64, 256] f32 accumulator is
128 registers per thread, so the forward and dq run one consumer warpgroup (255 registers
per thread with two warpgroups per CTA), and dk and dv, which would hold two, run as two
kernels that each recompute the scores (8 matmuls per key/query block pair in the backward
instead of 7). At 256, compiled for an H200 with jax 0.12.1: forward no spills; dq 152 and dk
128 bytes of spills per thread, dv none (the accumulator beside the [64, 64] score,
probability and dP tiles; jax 0.12.0.1: dq and dk 128). One-consumer kernels keep the even
share of 255 registers per thread (``_mgpu.split_registers``). Shared memory at 256: forward
164 KiB, dq and dk 195 KiB, dv 162 KiB. Head dims are padded to a multiple of 64 (a swizzled
row), sequences to whole tiles (zero rows/keys, masked).

Masks (causal, sliding window, segment ids, the sequence tails) are applied per element on
the blocks that need them; the forward and dq walk the key blocks every row of the CTA
sees whole without masks (``_consume_kv``). Causal and window bounds limit the block range
of a CTA (the union of its consumers' ranges); segment ids do not (no block skipping on
this path).
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

from jaxbwd.pallas import _common as C
from jaxbwd.pallas import attention as TA
from jaxbwd.pallas.mosaic import _mgpu as M

Dims = TA.Dims
NEG_INF = float("-inf")
_LN2 = math.log(2.0)
BQ = M.WG_ROWS
MAX_HEAD_DIM = 256


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Tile sizes of one problem: streamed block ``bk`` (fwd), ``bk_bwd``, ring ``stages``,
    consumer warpgroups of the forward and dq (``consumers``) and of dk/dv, whether dk and
    dv run as two kernels (``split_dkdv``), padded ``Tp``, ``Sp``, ``Hp``."""

    bk: int
    bk_bwd: int
    stages: int
    consumers: int
    dkdv_consumers: int
    split_dkdv: bool
    Tp: int
    Sp: int
    Hp: int

    @property
    def cta_rows(self) -> int:
        """Query rows per CTA of the forward and dq: 64 per consumer warpgroup."""
        return self.consumers * BQ


_BLOCK_K: contextvars.ContextVar[Optional[int]] = contextvars.ContextVar("jaxbwd_mosaic_block_k", default=None)


@contextlib.contextmanager
def block_k(bk: int):
    """Overrides the streamed key block of every kernel (a multiple of 64) while tracing:
    small test shapes then span several blocks and wrap the ring."""
    if bk % 64:
        raise ValueError(f"jaxbwd.dot_product_attention: Mosaic block_k must be a multiple of 64, got {bk}")
    token = _BLOCK_K.set(int(bk))
    try:
        yield
    finally:
        _BLOCK_K.reset(token)


def _plan(d: Dims) -> _Plan:
    Hp = C.cdiv(d.H, 64) * 64
    over = _BLOCK_K.get()
    # Registers decide the tiles. In jax 0.12.0.1 ptxas ignores setmaxnreg in Mosaic's
    # kernels (C7504, "to maintain compatibility across compilation units"), so every thread
    # gets 65536 / threads: 168 with three warpgroups (python -m jaxbwd compile). With
    # 128-key steps the forward spilled (156 bytes at H = 128, 352 at H = 64), so every
    # kernel streams 64 keys: a [64, 64] f32 score tile is 32 registers per thread.
    # dk/dv holds two [64, H] f32 accumulators: at H = 128 that is 128 registers before any
    # score tile (two consumers spilled 820 bytes and ptxas serialized the wgmmas), so it
    # runs one consumer warpgroup (two warpgroups: 255 registers).
    # Above head dim 128 a [64, Hp] f32 accumulator is Hp / 2 registers per thread (128 at
    # 256), so the forward and dq run one consumer warpgroup (two warpgroups per CTA: 255
    # registers per thread), and dk and dv, two such accumulators, run as two kernels that
    # each recompute the scores (one more q k^T per key block: 8 matmuls instead of 7 in
    # the backward).
    bk = over or 64
    bk_bwd = over or 64
    consumers = M.CONSUMERS if Hp <= 128 else 1
    dkdv_consumers = M.CONSUMERS if Hp <= 64 else 1
    # Padded lengths are whole multiples of every block that walks them (a block_k override
    # need not divide the CTA's rows): queries of the forward/dq CTAs and of dk/dv's stream,
    # keys of the forward/dq stream and of dk/dv's CTAs.
    t_mult, s_mult = math.lcm(consumers * BQ, bk_bwd), math.lcm(bk, bk_bwd, 2 * BQ)
    Tp, Sp = C.cdiv(d.T, t_mult) * t_mult, C.cdiv(d.S, s_mult) * s_mult
    return _Plan(bk, bk_bwd, 2, consumers, dkdv_consumers, Hp > 128, Tp, Sp, Hp)


def supported(d: Dims, dtype) -> Optional[str]:
    """None when these kernels run ``d`` with ``dtype`` inputs, else the reason."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"16-bit inputs only, got {jnp.dtype(dtype).name}"
    if d.H > MAX_HEAD_DIM:
        return f"head dim <= {MAX_HEAD_DIM}, got {d.H}"
    return None


# -------------------------------------------------------------------------- shared pieces
def _scaled(d: Dims, s):
    """Base-2 logits from f32 ``q k^T`` and, under a softcap, ``t = tanh(scale q k^T / c)``."""
    if d.softcap is None:
        return s * (d.scale * C.LOG2E), None
    t = jnp.tanh(s * (d.scale / d.softcap))
    return t * (d.softcap * C.LOG2E), t


def _mask(d: Dims, r, c, qs, ks):
    """Query rows ``r`` vs key columns ``c`` (int32 tiles); ``qs``/``ks`` segment id tiles."""
    m = TA.position_mask((r < d.T) & (c < d.S), r, c, d.causal, d.window)
    if qs is not None:
        m = m & (qs == ks)
    return m


def _bcast_rows(x, shape):
    return lax.broadcast_in_dim(x, shape, [0])


def _bcast_cols(x, shape):
    return lax.broadcast_in_dim(x, shape, [1])


def _pad_to(x, axis: int, size: int, value=0):
    if x.shape[axis] == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def _views(d: Dims, p: _Plan, q2, k2, v2, qseg, kseg):
    """[B, Tp, N, Hp] and [B, Sp, K, Hp] padded arrays from the [B*T, N*H] views."""
    q = _pad_to(_pad_to(q2.reshape(d.B, d.T, d.N, d.H), 3, p.Hp), 1, p.Tp)
    k = _pad_to(_pad_to(k2.reshape(d.B, d.S, d.K, d.H), 3, p.Hp), 1, p.Sp)
    v = _pad_to(_pad_to(v2.reshape(d.B, d.S, d.K, d.H), 3, p.Hp), 1, p.Sp)
    segs = ()
    if d.segments:
        segs = (_pad_to(qseg, 1, p.Tp, -1), _pad_to(kseg, 1, p.Sp, -2))
    return q, k, v, segs


def _unpad(x, d: Dims, L: int, heads: int):
    return x[:, :L, :, : d.H].reshape(d.B * L, heads * d.H)


def _consume_kv(d: Dims, qi, cta: int, lo, hi, bk: int, st: int, consumed, step, carry):
    """A consumer's walk over key blocks [lo, hi) of query CTA ``qi``: first the blocks every
    row of the CTA sees whole (below the causal diagonal, inside S, no window or segment
    ids) with ``step(..., masked=False)``, then the rest with the element masks (as FA3
    splits its loop, so that the interior blocks skip the iota/compare/select work)."""
    if d.window is not None or d.segments:
        mid = lo
    else:
        mid = d.S // bk
        if d.causal:
            mid = jnp.minimum(mid, M.div(qi * cta, bk))
        mid = jnp.clip(mid, lo, hi)
    carry = M.consume(lo, mid, st, consumed, functools.partial(step, masked=False), carry, base=lo)
    return M.consume(mid, hi, st, consumed, step, carry, base=lo)


def _produce_kv(lo, hi, st, consumed, nc, bk, b, kvh, k, v, ks) -> None:
    """The producer of a query-row program (forward, dq): streams key blocks ``lo .. hi-1``
    of batch ``b``, kv head ``kvh``; ``k``, ``v``, ``ks`` (segment ids, or None) are each
    (GMEM ref, SMEM ring, barriers)."""
    block = lambda ref, j: ref.at[b, M.ds(j * bk, bk), kvh]
    sources = [(functools.partial(block, ref), ring, bar) for ref, ring, bar in (k, v)]
    if ks is not None:
        ref, ring, bar = ks
        sources.append((lambda j: ref.at[b, M.ds(j * bk, bk)], ring, bar))
    M.produce(lo, hi, st, sources, consumed, nc)


# ----------------------------------------------------------------------------- forward
def _fwd_body(*refs, d: Dims, p: _Plan):
    nin = 5 if d.segments else 3
    ins, (o_ref, lse_ref), scratch = refs[:nin], refs[nin:nin + 2], refs[nin + 2:]
    q_ref, k_ref, v_ref = ins[:3]
    qs_ref, ks_ref = ins[3:] if d.segments else (None, None)
    (q_smem, k_ring, v_ring, lse_smem, qs_smem, ks_ring, stage, q_bar, k_bar, v_bar, ks_bar, consumed,
     schedule) = scratch
    bk, st = p.bk, p.stages
    qi, n, b = lax.axis_index("q"), lax.axis_index("heads"), lax.axis_index("batch")
    kvh = M.div(n, d.G)
    cta, nc = p.cta_rows, p.consumers
    lo, hi = TA._kv_range(d, qi * cta, cta, bk)
    wg = M.wg_index()

    @M.when(wg == nc)
    def _producer():
        _produce_kv(lo, hi, st, consumed, nc, bk, b, kvh, (k_ref, k_ring, k_bar), (v_ref, v_ring, v_bar),
                    (ks_ref, ks_ring, ks_bar) if d.segments else None)

    @M.when(wg < nc)
    def _consumer():
        M.split_registers(nc, producer=False)
        r0 = qi * cta + wg * BQ
        qsm = q_smem.at[wg]
        M.copy_gmem_to_smem(q_ref.at[b, M.ds(r0, BQ), n], qsm, q_bar.at[wg])
        qs = None
        if d.segments:
            M.copy_gmem_to_smem(qs_ref.at[b, M.ds(r0, BQ)], qs_smem.at[wg], q_bar.at[nc + wg])
            M.barrier_wait(q_bar.at[nc + wg])
            qs = _bcast_rows(M.row_vector(qs_smem.at[wg]), (BQ, bk))
        M.barrier_wait(q_bar.at[wg])
        rows = M.iota((BQ, bk), 0) + r0
        cols0 = M.iota((BQ, bk), 1)
        turn = (lambda: M.take_turn(schedule)) if schedule is not None else (lambda: None)
        if schedule is not None:
            M.when(wg == 1)(turn)

        def step(j, slot, carry, masked=True):
            acc, m, l = carry
            M.barrier_wait(k_bar.at[slot])
            s, _ = _scaled(d, M.matmul(qsm, k_ring.at[slot].T, (BQ, bk), after_issue=turn))
            ks = None
            if d.segments:
                M.barrier_wait(ks_bar.at[slot])
                ks = _bcast_cols(M.col_vector(ks_ring.at[slot]), (BQ, bk))
            if masked:
                s = jnp.where(_mask(d, rows, cols0 + j * bk, qs, ks), s, NEG_INF)
            m_new = jnp.maximum(m, s.max(axis=1))
            m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)
            alpha = jnp.exp2(m - m_safe)
            pr = jnp.exp2(s - _bcast_rows(m_safe, (BQ, bk)))
            if schedule is not None:
                M.barrier_arrive(schedule)  # softmax done: the other consumer's turn
            l = l * alpha + pr.sum(axis=1)
            acc = acc * _bcast_rows(alpha, (BQ, p.Hp))
            M.barrier_wait(v_bar.at[slot])
            if schedule is not None:
                M.barrier_wait(schedule)
            acc = M.matmul(pr.astype(v_ring.dtype), v_ring.at[slot], None, acc=acc,
                           stage=None if stage is None else stage.at[wg])
            return acc, m_new, l

        rl = M.Layout.WGMMA.reduce(1)
        init = (M.zeros((BQ, p.Hp)), M.full((BQ,), NEG_INF, rl), M.full((BQ,), 0.0, rl))
        acc, m, l = _consume_kv(d, qi, cta, lo, hi, bk, st, consumed, step, init)
        if schedule is not None:
            M.when(wg == 0)(turn)
        seen = l > 0.0
        l_safe = jnp.where(seen, l, 1.0)
        qsm[...] = (acc / _bcast_rows(l_safe, (BQ, p.Hp))).astype(qsm.dtype)
        # The residual in natural units: lse = ln(2) * (m2 + log2(l)).
        lse_smem.at[wg][...] = jnp.where(seen, (m + jnp.log2(l_safe)) * _LN2, NEG_INF)
        M.commit_smem()
        M.copy_smem_to_gmem(qsm, o_ref.at[b, M.ds(r0, BQ), n])
        M.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[b, n, M.ds(r0, BQ)])
        M.wait_smem_to_gmem(0)


def attention_fwd(q2, k2, v2, qseg, kseg, d: Dims, *, interpret: bool = False):
    """Flash-attention forward on Mosaic GPU (FA3 Algorithm 1, warp specialized).

    Args:
      q2: [B*T, N*H] view of q; k2, v2: [B*S, K*H] views of k, v (bfloat16 or float16, H <=
        256); qseg [B, T], kseg [B, S] int32, or ``None`` when ``d.segments`` is False.
    Returns:
      out [B*T, N*H] in q's dtype and lse [B*N, T] float32 in natural units (-inf for rows
      that see no key): the Triton forward's residual contract.
    Raises:
      ValueError: a dtype or head dim these kernels do not cover (see :func:`supported`).
    """
    _check(d, q2.dtype)
    p = _plan(d)
    q, k, v, segs = _views(d, p, q2, k2, v2, qseg, kseg)
    dt = q.dtype
    nc = p.consumers
    scratch = [
        M.tile_smem((nc, BQ, p.Hp), dt),
        M.tile_smem((p.stages, p.bk, p.Hp), dt),
        M.tile_smem((p.stages, p.bk, p.Hp), dt),
        M.vec_smem((nc, BQ), jnp.float32),
        M.vec_smem((nc, BQ), jnp.int32) if d.segments else None,
        M.vec_smem((p.stages, p.bk), jnp.int32) if d.segments else None,
        M.stage_smem((BQ, p.bk), dt, interpret, nc),
        M.barriers(2 * nc),
        M.barriers(p.stages),
        M.barriers(p.stages),
        M.barriers(p.stages) if d.segments else None,
        M.barriers(p.stages, arrivals=nc),
        M.barriers(1, arrivals=nc) if nc == 2 else None,  # the ping-pong turns (M.take_turn)
    ]
    out, lse = M.kernel(
        functools.partial(_fwd_body, d=d, p=p), name="attention_fwd_mosaic",
        out_type=[jax.ShapeDtypeStruct(q.shape, dt), jax.ShapeDtypeStruct((d.B, d.N, p.Tp), jnp.float32)],
        grid=(p.Tp // p.cta_rows, d.N, d.B), grid_names=("q", "heads", "batch"), scratch=scratch,
        interpret=interpret, consumers=nc,
    )(q, k, v, *segs)
    return _unpad(out, d, d.T, d.N), lse[:, :, : d.T].reshape(d.B * d.N, d.T)


def _check(d: Dims, dtype):
    why = supported(d, dtype)
    if why is not None:
        raise ValueError(f"jaxbwd.dot_product_attention: the Mosaic GPU kernels need {why}")


# ---------------------------------------------------------------------------- backward
def _dq_body(*refs, d: Dims, p: _Plan):
    """FA3 Algorithm 2's dQ half: consumers own 64 query rows, the producer streams k, v."""
    nin = 8 if d.segments else 6
    ins, dq_ref, scratch = refs[:nin], refs[nin], refs[nin + 1:]
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = ins[:6]
    qs_ref, ks_ref = ins[6:] if d.segments else (None, None)
    (q_smem, do_smem, lse_smem, delta_smem, qs_smem, k_ring, v_ring, ks_ring, stage,
     q_bar, k_bar, v_bar, ks_bar, consumed) = scratch
    bk, st = p.bk_bwd, p.stages
    qi, n, b = lax.axis_index("q"), lax.axis_index("heads"), lax.axis_index("batch")
    kvh = M.div(n, d.G)
    cta, nc = p.cta_rows, p.consumers
    lo, hi = TA._kv_range(d, qi * cta, cta, bk)
    wg = M.wg_index()

    @M.when(wg == nc)
    def _producer():
        _produce_kv(lo, hi, st, consumed, nc, bk, b, kvh, (k_ref, k_ring, k_bar), (v_ref, v_ring, v_bar),
                    (ks_ref, ks_ring, ks_bar) if d.segments else None)

    @M.when(wg < nc)
    def _consumer():
        M.split_registers(nc, producer=False)
        r0 = qi * cta + wg * BQ
        rows_at = (b, M.ds(r0, BQ), n)
        loads = [(q_ref.at[rows_at], q_smem.at[wg]), (do_ref.at[rows_at], do_smem.at[wg]),
                 (lse_ref.at[b, n, M.ds(r0, BQ)], lse_smem.at[wg]),
                 (delta_ref.at[b, n, M.ds(r0, BQ)], delta_smem.at[wg])]
        if d.segments:
            loads.append((qs_ref.at[b, M.ds(r0, BQ)], qs_smem.at[wg]))
        for i, (src, dst) in enumerate(loads):
            M.copy_gmem_to_smem(src, dst, q_bar.at[i * nc + wg])
        for i in range(len(loads)):
            M.barrier_wait(q_bar.at[i * nc + wg])
        shape = (BQ, bk)
        # Hoisted out of the loop (built inside each step, head dim 128's dq spilled 16 B).
        lse2 = _bcast_rows(M.row_vector(lse_smem.at[wg]) * C.LOG2E, shape)
        delta = _bcast_rows(M.row_vector(delta_smem.at[wg]), shape)
        qs = _bcast_rows(M.row_vector(qs_smem.at[wg]), shape) if d.segments else None
        rows = M.iota(shape, 0) + r0
        cols0 = M.iota(shape, 1)

        def step(j, slot, dq, masked=True):
            M.barrier_wait(k_bar.at[slot])
            s, t = _scaled(d, M.matmul(q_smem.at[wg], k_ring.at[slot].T, shape))
            ks = None
            if d.segments:
                M.barrier_wait(ks_bar.at[slot])
                ks = _bcast_cols(M.col_vector(ks_ring.at[slot]), shape)
            pr = jnp.exp2(s - lse2)
            if masked:
                pr = jnp.where(_mask(d, rows, cols0 + j * bk, qs, ks), pr, 0.0)
            if t is not None:  # the softcap's derivative folded in now: t is dead before dp
                pr = pr * (1.0 - t * t)
            M.barrier_wait(v_bar.at[slot])
            dp = M.matmul(do_smem.at[wg], v_ring.at[slot].T, shape)
            dsc = pr * (dp - delta)
            return M.matmul(dsc.astype(k_ring.dtype), k_ring.at[slot], None, acc=dq,
                            stage=None if stage is None else stage.at[wg])

        dq = _consume_kv(d, qi, cta, lo, hi, bk, st, consumed, step, M.zeros((BQ, p.Hp)))
        q_smem.at[wg][...] = (dq * d.scale).astype(q_smem.dtype)
        M.commit_smem()
        M.copy_smem_to_gmem(q_smem.at[wg], dq_ref.at[rows_at])
        M.wait_smem_to_gmem(0)


def _dkdv_body(*refs, d: Dims, p: _Plan, part: str):
    """FA3 Algorithm 2's dK/dV half: consumers own 64 key rows and accumulate dK and dV over
    every query block of the G query heads of their kv head (GQA reduced in-kernel, no
    atomics); the producer streams q, do, lse, delta (and query segment ids).

    ``part`` is ``"dkdv"``, or ``"dk"`` / ``"dv"`` for one of the two kernels that split the
    work above head dim 128 (``_Plan.split_dkdv``): dv needs neither v nor delta."""
    nin = 8 if d.segments else 6
    want_dk, want_dv = part in ("dkdv", "dk"), part in ("dkdv", "dv")
    nout = want_dk + want_dv
    ins, outs, scratch = refs[:nin], refs[nin:nin + nout], refs[nin + nout:]
    dk_ref = outs[0] if want_dk else None
    dv_ref = outs[-1] if want_dv else None
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = ins[:6]
    qs_ref, ks_ref = ins[6:] if d.segments else (None, None)
    (k_smem, v_smem, ks_smem, q_ring, do_ring, lse_ring, delta_ring, qs_ring, stage,
     kv_bar, q_bar, do_bar, lse_bar, delta_bar, qs_bar, consumed) = scratch
    bq, st = p.bk_bwd, p.stages  # streamed query block
    nc = p.dkdv_consumers
    cta = nc * M.WG_ROWS
    ci, kvh, b = lax.axis_index("kv"), lax.axis_index("heads"), lax.axis_index("batch")
    qlo, qhi = TA._q_range(d, ci * cta, bq, cta)
    nq = jnp.maximum(qhi - qlo, 0)
    # One flat stream over (query head g of the group, query block i): step -> (g, i).
    lo, hi = 0, d.G * nq
    head = lambda step: kvh * d.G + M.div(step, jnp.maximum(nq, 1))
    qblk = lambda step: qlo + M.rem(step, jnp.maximum(nq, 1))
    wg = M.wg_index()

    @M.when(wg == nc)
    def _producer():
        rows = lambda s: M.ds(qblk(s) * bq, bq)
        sources = [(lambda s: q_ref.at[b, rows(s), head(s)], q_ring, q_bar),
                   (lambda s: do_ref.at[b, rows(s), head(s)], do_ring, do_bar),
                   (lambda s: lse_ref.at[b, head(s), rows(s)], lse_ring, lse_bar)]
        if want_dk:
            sources.append((lambda s: delta_ref.at[b, head(s), rows(s)], delta_ring, delta_bar))
        if d.segments:
            sources.append((lambda s: qs_ref.at[b, rows(s)], qs_ring, qs_bar))
        M.produce(lo, hi, st, sources, consumed, nc)

    @M.when(wg < nc)
    def _consumer():
        M.split_registers(nc, producer=False)
        c0 = ci * cta + wg * BQ
        cols_at = (b, M.ds(c0, BQ), kvh)
        loads = [(k_ref.at[cols_at], k_smem.at[wg])]
        if want_dk:
            loads.append((v_ref.at[cols_at], v_smem.at[wg]))
        if d.segments:
            loads.append((ks_ref.at[b, M.ds(c0, BQ)], ks_smem.at[wg]))
        for i, (src, dst) in enumerate(loads):
            M.copy_gmem_to_smem(src, dst, kv_bar.at[i * nc + wg])
        for i in range(len(loads)):
            M.barrier_wait(kv_bar.at[i * nc + wg])
        shape = (BQ, bq)  # transposed tiles: key rows x query columns
        ks_row = M.row_vector(ks_smem.at[wg]) if d.segments else None  # broadcast per step, as in dq
        stg = None if stage is None else stage.at[wg]

        def step(s_, slot, carry):
            dk, dv = carry if part == "dkdv" else (carry, carry)
            M.barrier_wait(q_bar.at[slot])
            sT, t = _scaled(d, M.matmul(k_smem.at[wg], q_ring.at[slot].T, shape))
            M.barrier_wait(lse_bar.at[slot])
            lse2 = _bcast_cols(M.col_vector(lse_ring.at[slot]) * C.LOG2E, shape)
            qs = None
            if d.segments:
                M.barrier_wait(qs_bar.at[slot])
                qs = _bcast_cols(M.col_vector(qs_ring.at[slot]), shape)
            ks = _bcast_rows(ks_row, shape) if d.segments else None
            pT = jnp.exp2(sT - lse2)
            if t is not None and not want_dv:  # dk alone: the softcap's derivative now (as dq)
                pT, t = pT * (1.0 - t * t), None
            m = _mask(d, M.iota(shape, 1) + qblk(s_) * bq, M.iota(shape, 0) + c0, qs, ks)
            pT = jnp.where(m, pT, 0.0)
            M.barrier_wait(do_bar.at[slot])
            if want_dv:
                dv = M.matmul(pT.astype(do_ring.dtype), do_ring.at[slot], None, acc=dv, stage=stg)
                if not want_dk:
                    return dv
            if t is not None:  # t is dead before dp^T
                pT = pT * (1.0 - t * t)
            dpT = M.matmul(v_smem.at[wg], do_ring.at[slot].T, shape)
            M.barrier_wait(delta_bar.at[slot])
            dsT = pT * (dpT - _bcast_cols(M.col_vector(delta_ring.at[slot]), shape))
            dk = M.matmul(dsT.astype(q_ring.dtype), q_ring.at[slot], None, acc=dk, stage=stg)
            return (dk, dv) if want_dv else dk

        init = (M.zeros((BQ, p.Hp)), M.zeros((BQ, p.Hp))) if part == "dkdv" else M.zeros((BQ, p.Hp))
        acc = M.consume(lo, hi, st, consumed, step, init)
        dk, dv = acc if part == "dkdv" else (acc, acc)
        # The gradients leave through the resident tiles' shared memory (k and v are no
        # longer read): dk through k's, dv through v's, or k's when only dv is computed.
        dv_smem = v_smem if want_dk else k_smem
        if want_dk:
            k_smem.at[wg][...] = (dk * d.scale).astype(k_smem.dtype)
        if want_dv:
            dv_smem.at[wg][...] = dv.astype(dv_smem.dtype)
        M.commit_smem()
        if want_dk:
            M.copy_smem_to_gmem(k_smem.at[wg], dk_ref.at[cols_at])
        if want_dv:
            M.copy_smem_to_gmem(dv_smem.at[wg], dv_ref.at[cols_at])
        M.wait_smem_to_gmem(0)


def attention_bwd(q2, k2, v2, qseg, kseg, o2, lse, do2, d: Dims, *, interpret: bool = False):
    """FlashAttention backward on Mosaic GPU: dq [B*T, N*H], dk and dv [B*S, K*H] in the
    inputs' dtypes, from the forward's residuals (out and lse [B*N, T] f32, natural units,
    from either backend's forward). Deterministic (no atomics): dq with one CTA per (query
    rows of ``_Plan.cta_rows``, head); dk/dv with one CTA per (64 or 128 keys, kv head), as
    one kernel up to head dim 128 and as a dk and a dv kernel above it.

    ``delta = rowsum(out * dout)`` (f32) is computed by XLA, as on the Triton path.
    Raises:
      ValueError: a dtype or head dim these kernels do not cover (see :func:`supported`).
    """
    _check(d, q2.dtype)
    p = _plan(d)
    q, k, v, segs = _views(d, p, q2, k2, v2, qseg, kseg)
    do = _pad_to(_pad_to(do2.reshape(d.B, d.T, d.N, d.H), 3, p.Hp), 1, p.Tp)
    delta = jnp.sum(o2.astype(jnp.float32).reshape(d.B, d.T, d.N, d.H)
                    * do2.astype(jnp.float32).reshape(d.B, d.T, d.N, d.H), axis=-1).transpose(0, 2, 1)
    delta = _pad_to(delta, 2, p.Tp)
    lse3 = _pad_to(lse.reshape(d.B, d.N, d.T), 2, p.Tp)
    dt, bk, st = q.dtype, p.bk_bwd, p.stages
    inputs = (q, k, v, do, lse3, delta) + segs
    i32 = jnp.int32
    seg = d.segments

    nc = p.consumers
    dq_scratch = [
        M.tile_smem((nc, BQ, p.Hp), dt), M.tile_smem((nc, BQ, p.Hp), dt),
        M.vec_smem((nc, BQ), jnp.float32), M.vec_smem((nc, BQ), jnp.float32),
        M.vec_smem((nc, BQ), i32) if seg else None,
        M.tile_smem((st, bk, p.Hp), dt), M.tile_smem((st, bk, p.Hp), dt),
        M.vec_smem((st, bk), i32) if seg else None,
        M.stage_smem((BQ, bk), dt, interpret, nc),
        M.barriers(5 * nc), M.barriers(st), M.barriers(st),
        M.barriers(st) if seg else None, M.barriers(st, arrivals=nc),
    ]
    dq = M.kernel(
        functools.partial(_dq_body, d=d, p=p), name="attention_bwd_dq_mosaic",
        out_type=jax.ShapeDtypeStruct(q.shape, dt), grid=(p.Tp // p.cta_rows, d.N, d.B),
        grid_names=("q", "heads", "batch"), scratch=dq_scratch, interpret=interpret, consumers=nc,
    )(*inputs)

    if interpret:
        # Two interpreted kernels at once (dq and dk/dv do not depend on each other) block
        # twice the XLA:CPU pool threads in barrier waits (``_mgpu.check_interpreter_threads``
        # sizes the pool for one); ordering dk/dv after dq keeps to one. Compiled kernels need
        # no such order.
        dq, inputs = lax.optimization_barrier((dq, inputs))
    nc = p.dkdv_consumers
    kv_shape = jax.ShapeDtypeStruct(k.shape, dt)

    def dkdv_kernel(part, inputs):
        scratch = [
            M.tile_smem((nc, BQ, p.Hp), dt),
            M.tile_smem((nc, BQ, p.Hp), dt) if part != "dv" else None,
            M.vec_smem((nc, BQ), i32) if seg else None,
            M.tile_smem((st, bk, p.Hp), dt), M.tile_smem((st, bk, p.Hp), dt),
            M.vec_smem((st, bk), jnp.float32),
            M.vec_smem((st, bk), jnp.float32) if part != "dv" else None,
            M.vec_smem((st, bk), i32) if seg else None,
            M.stage_smem((BQ, bk), dt, interpret, nc),
            M.barriers(3 * nc), M.barriers(st), M.barriers(st), M.barriers(st),
            M.barriers(st) if part != "dv" else None,
            M.barriers(st) if seg else None, M.barriers(st, arrivals=nc),
        ]
        return M.kernel(
            functools.partial(_dkdv_body, d=d, p=p, part=part), name=f"attention_bwd_{part}_mosaic",
            out_type=[kv_shape] * (2 if part == "dkdv" else 1), grid=(p.Sp // (nc * M.WG_ROWS), d.K, d.B),
            grid_names=("kv", "heads", "batch"), scratch=scratch, interpret=interpret, consumers=nc,
        )(*inputs)

    if not p.split_dkdv:
        dk, dv = dkdv_kernel("dkdv", inputs)
    else:
        (dk,) = dkdv_kernel("dk", inputs)
        (dv,) = dkdv_kernel("dv", inputs)
    return _unpad(dq, d, d.T, d.N), _unpad(dk, d, d.S, d.K), _unpad(dv, d, d.S, d.K)
