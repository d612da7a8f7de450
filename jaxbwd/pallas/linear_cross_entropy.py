"""Kernels of linear_cross_entropy: the LM head ``x @ w`` and its softmax cross-entropy
fused, the [tokens, V] logits never written to memory.

Every kernel builds logit tiles [block_t, block_v] from x [R, D] and w (the Dense layout
[D, V], or an embedding table [V, D] read transposed) with tensor-core dots over D chunks of
``block_d`` columns (f32 accumulation, ``_common.dot``), optionally soft-capped
(``c * tanh(z / c)``, Gemma 2). This is the shape of Cut Cross-Entropy (Wijmans et al.,
ICLR 2025), made deterministic by splitting the backward in two kernels that each own
their outputs (as the attention backward splits dq and dk/dv):

``linear_cross_entropy_fwd``: grid (token blocks, vocabulary splits). A program walks the
vocabulary blocks of its split keeping, per token, the online max ``m`` and sum of
exponentials ``s = sum(exp(z - m))`` (Milakov & Gimelshein 2018), the label's logit and,
with label smoothing, ``sum(z) / V``. It writes these four f32 partials per (split,
token); XLA combines the splits as vocab-parallel cross-entropy combines shards
(Megatron-LM, Shoeybi et al. 2019). Splitting the vocabulary keeps the GPU full when there
are few token blocks; the partials are O(tokens * splits).

Backward, with per-token f32 cotangents ``g`` (of the loss, 0 on ignored tokens) and
``gl`` (of the returned lse), and the softmax recomputed from the saved ``m`` and ``s``:

    dz = (g + gl) * exp(z - m) / s - (1 - eps) * g * onehot(label) - eps / V * g

(times ``1 - tanh^2`` under a softcap), cast to the operands' dtype for the tensor cores.

- ``linear_cross_entropy_bwd_dx``: one program per token block; for each vocabulary block
  it recomputes the logit tile and adds ``dz @ w_blk^T`` to its own rows of dx, one D chunk
  at a time (the [block_t, D] sum does not fit in registers, so it lives in the program's
  own rows of global memory: read, add, write, in a fixed order).
- ``linear_cross_entropy_bwd_dw``: a persistent grid (:func:`_dw_programs`), each program
  walking vocabulary blocks g, g + G, ...; for each token block it recomputes the logit tile and
  adds ``x_blk^T @ dz`` to its own columns of dw.

The running sums keep f32 precision without an f32 copy of dx or dw
(:func:`accumulation`): f32 operands sum in the outputs; bf16 ones as pairs of bf16 values,
the high half in the output itself and the low half in a bf16 companion (all of dx: R x D;
for dw a [D, block_v] slab per program, G x D x block_v); f16 ones in f32 (dx, then cast,
and dw's per-program slabs). The temporary memory of the backward is therefore the larger
of the two companions: at R = 8192, D = 2048 in bf16 on 132 SMs, 32 MiB for dx and 33 MiB
for dw, whatever V (an f32 dx alone would be 64 MiB, an f32 dw 1 GB at V = 128256).

Each step of these loops reads and writes a [block_t, D] (dx) or [D, block_v] (dw) sum, 8
bytes per element, against 4 * block_v (dx) or 4 * block_t (dw) flops per element: 32-64
flops per byte at the tiles used, below an H200's ratio of tensor-core flops to HBM bytes
(about 200). The sums in flight (R = 8192, D = 2048, bf16: 64 MiB for dx, 66 MiB for dw
with their hi halves) exceed its 50 MiB L2, so the backward kernels are likely bound by this
traffic rather than by their dots: an estimate from the loop structure; no GPU has timed
them.

No atomics: every output element has one writer and a fixed summation order, so the
gradients are bitwise reproducible. The backward costs two logit recomputations
(2 x 2RDV flops) besides the 2 x 2RDV of the gradients themselves. Exponentials are
``C.exp`` (exp2). Gradient filtering (skipping blocks whose softmax is below the output
dtype's resolution, as CCE does) is not implemented: every block is computed.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxbwd.pallas import _common as C
from jaxbwd.pallas import _tuning

NEG_INF = float("-inf")


@dataclasses.dataclass(frozen=True)
class Dims:
    """Static description of one problem (a hashable kernel parameter).

    R tokens, D features, V vocabulary columns of this w (a shard's width under
    vocab-parallel sharding), ``n_classes`` the whole vocabulary (for ``eps / V``).
    """

    R: int
    D: int
    V: int
    n_classes: int
    eps: float
    softcap: Optional[float]
    transpose_w: bool


_BLOCKS: contextvars.ContextVar[Optional[tuple]] = contextvars.ContextVar("jaxbwd_lce_blocks", default=None)


@contextlib.contextmanager
def block_sizes(block_t: int, block_v: int, block_d: int, dw_programs: Optional[int] = None):
    """Overrides the kernels' (power-of-two) block sizes, and the dw kernel's number of
    programs, while tracing; for tests of tails and multi-block loops at small shapes.
    Blocks under 16 only work in interpret mode."""
    token = _BLOCKS.set((int(block_t), int(block_v), int(block_d), dw_programs))
    try:
        yield
    finally:
        _BLOCKS.reset(token)


def _blocks(kernel: str, d: Dims, dtype):
    """(block_t, block_v, block_d, num_warps, config) of ``kernel``: its tuning-table entry
    (``_tuning.linear_cross_entropy``, where the compiled figures behind each choice are
    recorded) with each block clamped to the problem by :func:`_fit`, or the blocks of
    :func:`block_sizes` when set."""
    cfg = _tuning.linear_cross_entropy(kernel, dtype, d.transpose_w)
    over = _BLOCKS.get()
    if over is not None:
        return over[0], over[1], over[2], 4, cfg
    return _fit(cfg.block_m, d.R), _fit(cfg.block_n, d.V), _fit(cfg.block_k, d.D), cfg.num_warps, cfg


def _fit(block: int, n: int) -> int:
    """A block no wider than ``n`` needs (its power of two), and at least 16 (the dots' minimum)."""
    return min(block, max(16, C.next_pow2(n)))


def _w_tile(d: Dims, w_ref, dc, dmask, cols, cmask):
    """w's tile for D chunk ``dc`` and vocabulary columns ``cols``: [bd, bv] in the Dense
    layout, [bv, bd] (rows of the table) with ``transpose_w``; out-of-bounds lanes 0."""
    if d.transpose_w:
        return C.load(w_ref, (cols[:, None], dc[None, :]), cmask[:, None] & dmask[None, :], dtype=w_ref.dtype)
    return C.load(w_ref, (dc[:, None], cols[None, :]), dmask[:, None] & cmask[None, :], dtype=w_ref.dtype)


def _x_tile(x_ref, rows, rmask, dc, dmask):
    return C.load(x_ref, (rows[:, None], dc[None, :]), rmask[:, None] & dmask[None, :], dtype=x_ref.dtype)


def _logit_tile(d: Dims, x_ref, w_ref, rows, rmask, cols, cmask, bt: int, bv: int, bd: int):
    """The f32 logit tile [bt, bv] (soft-capped) and, under a softcap, ``t = tanh(z / c)``."""

    def body(k, acc):
        dc = k * bd + jnp.arange(bd, dtype=jnp.int32)
        dmask = dc < d.D
        xt = _x_tile(x_ref, rows, rmask, dc, dmask)
        wt = _w_tile(d, w_ref, dc, dmask, cols, cmask)
        return acc + C.dot(xt, wt, trans_b=d.transpose_w)

    z = lax.fori_loop(0, C.cdiv(d.D, bd), body, jnp.zeros((bt, bv), jnp.float32))
    if d.softcap is None:
        return z, None
    t, dt = C.tanh_with_grad(z, 1.0 / d.softcap)
    return d.softcap * t, dt


# ---------------------------------------------------------------------------- forward
def _fwd_kernel(x_ref, w_ref, lab_ref, m_ref, s_ref, xl_ref, sx_ref, *, d: Dims, bt: int, bv: int, bd: int,
                per_split: int, with_sum: bool):
    i, sp = pl.program_id(0), pl.program_id(1)
    rows = i * bt + jnp.arange(bt, dtype=jnp.int32)
    rmask = rows < d.R
    # Labels arrive validated: -1 marks an ignored token or a label on another shard.
    lab = C.load(lab_ref, rows, rmask, other=-1, dtype=jnp.int32)
    inv_n = 1.0 / d.n_classes

    def body(j, carry):
        m, s, xl, sx = carry
        cols = j * bv + jnp.arange(bv, dtype=jnp.int32)
        cmask = cols < d.V
        z, _ = _logit_tile(d, x_ref, w_ref, rows, rmask, cols, cmask, bt, bv, bd)
        z = jnp.where(cmask[None, :], z, NEG_INF)
        m, s = C.online_lse_update(m, s, z)
        xl = xl + jnp.sum(jnp.where(cols[None, :] == lab[:, None], z, 0.0), axis=1)
        if with_sum:
            sx = sx + jnp.sum(jnp.where(cmask[None, :], z * inv_n, 0.0), axis=1)
        return m, s, xl, sx

    lo = sp * per_split
    hi = jnp.minimum(lo + per_split, C.cdiv(d.V, bv))
    zeros = jnp.zeros((bt,), jnp.float32)
    m, s, xl, sx = lax.fori_loop(lo, hi, body, (jnp.full((bt,), NEG_INF, jnp.float32), zeros, zeros, zeros))
    for ref, v in ((m_ref, m), (s_ref, s), (xl_ref, xl), (sx_ref, sx)):
        C.store(ref, (sp, rows), v, rmask)


def _num_splits(d: Dims, bt: int, bv: int, cfg) -> int:
    """Vocabulary splits of the forward grid: ``_tuning.split`` fits token blocks x splits to
    whole waves of the compiled occupancy (``cfg.blocks_per_sm`` per SM), with splits of at
    least 8 vocabulary blocks (but the last); the partials cost 16 bytes per (split, token)."""
    return _tuning.split(C.cdiv(d.R, bt), C.cdiv(d.V, bv), cfg, max_waves=8, min_steps=8)


def linear_cross_entropy_fwd(x, w, labels, d: Dims, *, with_sum: bool, interpret: bool = False):
    """Per-token partials of the cross-entropy of the logits ``x @ w`` (soft-capped), one pass.

    Args:
      x: [R, D]; w: [D, V] ([V, D] with ``d.transpose_w``), x's dtype; labels: [R] int32 in
        [0, V) or -1 (ignored token, or label elsewhere).
      with_sum: also sum each token's logits divided by ``d.n_classes`` (label smoothing).
    Returns:
      (m, s, x_label, x_mean), each [splits, R] float32: per vocabulary split, the max, the
      shifted sum of exponentials, the label's logit (0 where absent) and ``sum(z) / V``
      (0 unless ``with_sum``). Combine the splits with :func:`combine_splits`.
    """
    bt, bv, bd, nw, cfg = _blocks("linear_cross_entropy_fwd", d, x.dtype)
    n_split = _num_splits(d, bt, bv, cfg)
    per_split = C.cdiv(C.cdiv(d.V, bv), n_split)
    vec = jax.ShapeDtypeStruct((n_split, d.R), jnp.float32)
    kernel = functools.partial(_fwd_kernel, d=d, bt=bt, bv=bv, bd=bd, per_split=per_split, with_sum=bool(with_sum))
    nrb = C.cdiv(d.R, bt)
    return C.call(
        kernel, name="linear_cross_entropy_fwd", grid=(nrb, n_split), out_shape=(vec, vec, vec, vec),
        interpret=interpret, num_warps=nw, num_stages=cfg.num_stages, flops=2 * d.R * d.D * d.V,
        transcendentals=d.R * d.V,
        bytes_accessed=C.nbytes(x, labels) + nrb * C.nbytes(w) + 16 * n_split * d.R,
    )(x, w, labels)


def combine_splits(m, s, xl, sx, *, reduce_max=None, reduce_sum=None):
    """Partials of disjoint vocabulary parts -> per-token (m, s, x_label, x_mean): the parts'
    (max, sum) combine as an online softmax does, the rest are sums.

    By default the parts are axis 0 (the forward kernel's splits); ``reduce_max`` and
    ``reduce_sum`` reduce over other parts instead (``pmax``/``psum`` over the mesh axes of
    a vocabulary-sharded w)."""
    rmax = reduce_max or (lambda v: jnp.max(v, axis=0))
    rsum = reduce_sum or (lambda v: jnp.sum(v, axis=0))
    mg = rmax(m)
    shift = C.finite_or_zero(mg)
    s = rsum(jnp.where(s > 0, s * jnp.exp(m - jnp.broadcast_to(shift, m.shape)), 0.0))
    return mg, s, rsum(xl), rsum(sx)


# --------------------------------------------------------------------------- backward
def _row_terms(d: Dims, lab_ref, m_ref, s_ref, g_ref, gl_ref, rows, rmask):
    """Per token: label, shift m, and the factors of dz = a exp(z - m) - b onehot - c."""
    lab = C.load(lab_ref, rows, rmask, other=-1, dtype=jnp.int32)
    m = C.finite_or_zero(C.load(m_ref, rows, rmask))
    s = C.load(s_ref, rows, rmask)
    g = C.load(g_ref, rows, rmask)
    gl = C.load(gl_ref, rows, rmask)
    a = (g + gl) * jnp.where(s > 0.0, 1.0 / jnp.where(s > 0.0, s, 1.0), 0.0)
    return lab, m, a, (1.0 - d.eps) * g, (d.eps / d.n_classes) * g


def _dlogits(d: Dims, x_ref, w_ref, rows, rmask, cols, cmask, terms, bt, bv, bd, dtype):
    lab, m, a, b, c = terms
    z, dt = _logit_tile(d, x_ref, w_ref, rows, rmask, cols, cmask, bt, bv, bd)
    dz = C.exp2((z - m[:, None]) * C.LOG2E) * a[:, None] - jnp.where(cols[None, :] == lab[:, None], b[:, None], 0.0)
    if d.eps:
        dz = dz - c[:, None]
    if dt is not None:
        dz = dz * dt
    return jnp.where(cmask[None, :], dz, 0.0).astype(dtype)


def accumulation(dtype) -> str:
    """How the backward kernels keep their f32 sums of block contributions, by operand dtype.

    - ``"output"`` (f32): in the f32 outputs themselves.
    - ``"pair"`` (bf16): as the pair ``hi + lo`` of two bf16 values, ``hi`` in the bf16
      output itself and ``lo = bf16(sum - hi)`` in a bf16 companion, so no f32 copy of dx
      or dw exists. ``hi + lo`` is exact in f32; each block's contribution is added to it
      in f32 and the result split again, which rounds ``lo``: at most 2^-16 of the sum per
      step (about 16 significant bits, bf16's 8 twice) against f32's 2^-24, and 2^8 below
      the output's own rounding. Measured on [64, 512] x [512, 32000] bf16 dx sums (250
      vocabulary blocks, float64 reference): every element within 1 ulp of the correctly
      rounded bf16 result, 0.35% of them off by one (f32 sums: 0.012%; a plain bf16 running
      sum: 75% off, up to 700 ulps). An infinite sum stays infinite (its ``lo`` is 0).
    - ``"f32_temp"`` (f16): f32 temporaries (dx [R, D] as an f32 output cast afterwards,
      dw's per-program [D, block_v] slabs copied to dw): f16's narrow range could overflow a
      partial sum that the f32 result would not, and a ``lo`` half would underflow.
    """
    dt = jnp.dtype(dtype)
    return "output" if dt == jnp.float32 else "pair" if dt == jnp.bfloat16 else "f32_temp"


def _accumulate(ref, idx, mask, value, first: bool, lo=None):
    """``ref[idx] (+)= value`` on elements the program owns: a fixed order, no atomics.

    ``lo = (lo_ref, lo_idx)``: the sum is the pair ``ref[idx] + lo_ref[lo_idx]`` of
    bf16 values (:func:`accumulation`'s ``"pair"``)."""
    if not first:
        old = C.load(ref, idx, mask)
        if lo is not None:
            old = old + C.load(lo[0], lo[1], mask)  # exact: lo is below half an ulp of hi
        value = value + old
    if lo is None:
        C.store(ref, idx, value, mask)
        return
    hi = value.astype(ref.dtype)
    C.store(ref, idx, hi, mask)
    # Exact in f32 (and not folded: Pallas emits plain truncf/extf, which MLIR folds only
    # under fast-math contract flags). inf - inf would make lo NaN, so lo is 0 there.
    hi32 = hi.astype(jnp.float32)
    C.store(lo[0], lo[1], jnp.where(jnp.isfinite(hi32), value - hi32, 0.0), mask)


def _dx_kernel(x_ref, w_ref, lab_ref, m_ref, s_ref, g_ref, gl_ref, dx_ref, *lo_ref, d: Dims, bt: int, bv: int,
               bd: int):
    i = pl.program_id(0)
    rows = i * bt + jnp.arange(bt, dtype=jnp.int32)
    rmask = rows < d.R
    terms = _row_terms(d, lab_ref, m_ref, s_ref, g_ref, gl_ref, rows, rmask)

    def step(j, first: bool):
        cols = j * bv + jnp.arange(bv, dtype=jnp.int32)
        cmask = cols < d.V
        dz = _dlogits(d, x_ref, w_ref, rows, rmask, cols, cmask, terms, bt, bv, bd, x_ref.dtype)

        def chunk(k, carry):
            dc = k * bd + jnp.arange(bd, dtype=jnp.int32)
            dmask = dc < d.D
            wt = _w_tile(d, w_ref, dc, dmask, cols, cmask)
            contrib = C.dot(dz, wt, trans_b=not d.transpose_w)  # [bt, bd]
            idx = (rows[:, None], dc[None, :])
            lo = (lo_ref[0], idx) if lo_ref else None
            _accumulate(dx_ref, idx, rmask[:, None] & dmask[None, :], contrib, first, lo)
            return carry

        lax.fori_loop(0, C.cdiv(d.D, bd), chunk, 0)

    step(0, True)  # the first vocabulary block writes, the others add

    def rest(j, carry):
        step(j, False)
        return carry

    lax.fori_loop(1, C.cdiv(d.V, bv), rest, 0)


def _dw_programs(d: Dims, bv: int, cfg, mode: str) -> int:
    """Programs of the dw kernel's persistent grid, each walking vocabulary blocks g, g + G, ...:
    as many as the compiled kernel runs at once (``cfg.blocks_per_sm`` per SM), except for
    16-bit operands, which take one per SM although registers allow two: each of their
    programs holds its own [D, block_v] slab of running sums, so every program in flight
    costs temporary memory (two per SM would double the 33 MiB at D = 2048 on 132 SMs)."""
    over = _BLOCKS.get()
    if over is not None and over[3]:
        n = over[3]
    else:
        n = C.num_sms() * (cfg.blocks_per_sm if mode == "output" else 1)
    return max(1, min(C.cdiv(d.V, bv), n))


def _dw_kernel(x_ref, w_ref, lab_ref, m_ref, s_ref, g_ref, gl_ref, dw_ref, *slab_ref, d: Dims, bt: int, bv: int,
               bd: int, G: int, mode: str):
    g = pl.program_id(0)
    lc = jnp.arange(bv, dtype=jnp.int32)
    nd = C.cdiv(d.D, bd)

    def slab_index(dc):
        """The program's own tile of its slab: [bd, bv] of a [D, bv] slab (Dense layout) or
        [bv, bd] of a [bv, D] slab (table layout)."""
        if d.transpose_w:
            return g * bv + lc[:, None], dc[None, :]
        return g * d.D + dc[:, None], lc[None, :]

    def vocab_block(it, carry):
        cols = (g + it * G) * bv + lc
        cmask = cols < d.V

        def out_index(dc, dmask):
            if d.transpose_w:
                return (cols[:, None], dc[None, :]), cmask[:, None] & dmask[None, :]
            return (dc[:, None], cols[None, :]), dmask[:, None] & cmask[None, :]

        def step(i, first: bool):
            rows = i * bt + jnp.arange(bt, dtype=jnp.int32)
            rmask = rows < d.R
            terms = _row_terms(d, lab_ref, m_ref, s_ref, g_ref, gl_ref, rows, rmask)
            dz = _dlogits(d, x_ref, w_ref, rows, rmask, cols, cmask, terms, bt, bv, bd, x_ref.dtype)

            def chunk(k, carry):
                dc = k * bd + jnp.arange(bd, dtype=jnp.int32)
                dmask = dc < d.D
                xt = _x_tile(x_ref, rows, rmask, dc, dmask)
                # [bv, bd] rows of the table, or [bd, bv] columns of the kernel
                contrib = C.dot(dz, xt, trans_a=True) if d.transpose_w else C.dot(xt, dz, trans_a=True)
                idx, mask = out_index(dc, dmask)
                if mode == "f32_temp":  # the slab holds the sum; dw gets it when the block is done
                    ref, idx, lo = slab_ref[0], slab_index(dc), None
                else:
                    ref, lo = dw_ref, (slab_ref[0], slab_index(dc)) if mode == "pair" else None
                _accumulate(ref, idx, mask, contrib, first, lo)
                return carry

            lax.fori_loop(0, nd, chunk, 0)

        step(0, True)

        def rest(i, carry):
            step(i, False)
            return carry

        lax.fori_loop(1, C.cdiv(d.R, bt), rest, 0)

        if mode == "f32_temp":
            def write(k, carry):  # the finished block, in w's dtype
                dc = k * bd + jnp.arange(bd, dtype=jnp.int32)
                idx, mask = out_index(dc, dc < d.D)
                C.store(dw_ref, idx, C.load(slab_ref[0], slab_index(dc), mask), mask)
                return carry

            lax.fori_loop(0, nd, write, 0)
        return carry

    lax.fori_loop(0, C.idiv(C.cdiv(d.V, bv) - g + (G - 1), G), vocab_block, 0)


def linear_cross_entropy_bwd(x, w, labels, m, s, g, gl, d: Dims, *, interpret: bool = False):
    """dx [R, D] and dw (w's shape) from the saved per-token ``m`` and ``s = sum(exp(z - m))``
    ([R] f32, over the whole vocabulary) and the per-token f32 cotangents ``g`` (of the loss;
    0 on ignored tokens) and ``gl`` (of the lse).

    ``labels`` [R] int32 as for :func:`linear_cross_entropy_fwd`. dx is float32 for f32 and
    f16 operands and bf16 for bf16 ones (see :func:`accumulation`); dw has w's dtype.
    """
    bt, bv, bd, nw, cfg = _blocks("linear_cross_entropy_bwd_dx", d, x.dtype)
    mode = accumulation(x.dtype)
    args = (x, w, labels, m, s, g, gl)
    flops = 4 * d.R * d.D * d.V
    common = dict(interpret=interpret, flops=flops, transcendentals=d.R * d.V)
    dx_dtype = x.dtype if mode == "pair" else jnp.float32
    dx_out = jax.ShapeDtypeStruct((d.R, d.D), dx_dtype)
    dx = C.call(
        functools.partial(_dx_kernel, d=d, bt=bt, bv=bv, bd=bd), name="linear_cross_entropy_bwd_dx",
        grid=(C.cdiv(d.R, bt),), out_shape=(dx_out, dx_out) if mode == "pair" else dx_out, num_warps=nw,
        num_stages=cfg.num_stages,
        bytes_accessed=C.nbytes(*args) + C.cdiv(d.R, bt) * C.nbytes(w) + 8 * d.R * d.D * C.cdiv(d.V, bv), **common,
    )(*args)
    if mode == "pair":
        dx = dx[0]
    bt, bv, bd, nw, cfg = _blocks("linear_cross_entropy_bwd_dw", d, x.dtype)
    G = _dw_programs(d, bv, cfg, mode)
    dw_out = jax.ShapeDtypeStruct(w.shape, w.dtype)
    if mode == "output":
        out_shape = dw_out
    else:
        slab = (G * bv, d.D) if d.transpose_w else (G * d.D, bv)
        out_shape = (dw_out, jax.ShapeDtypeStruct(slab, w.dtype if mode == "pair" else jnp.float32))
    dw = C.call(
        functools.partial(_dw_kernel, d=d, bt=bt, bv=bv, bd=bd, G=G, mode=mode), name="linear_cross_entropy_bwd_dw",
        grid=(G,), out_shape=out_shape, num_warps=nw, num_stages=cfg.num_stages,
        bytes_accessed=C.nbytes(*args) + C.cdiv(d.V, bv) * C.nbytes(x) + 8 * d.D * d.V * C.cdiv(d.R, bt), **common,
    )(*args)
    return dx, (dw if mode == "output" else dw[0])
