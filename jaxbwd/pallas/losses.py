"""Kernels of cross_entropy over a large vocabulary: the gradient written while the logits are on chip.

``cross_entropy_fwd`` (the forward of a differentiated call): one program per row block
walks the vocabulary twice in power-of-two column tiles (the tail tile masked with -inf).
The first walk keeps, per row, the online max ``m`` and sum of exponentials
``s = sum(exp(x - m))`` (Milakov & Gimelshein 2018) and, with label smoothing, the mean of
the logits; the label's logit is one gathered load per row. The second walk writes the
gradient of the row's weighted loss,

    d = w * ((1 + 2 z lse) * exp(x - m) / s - (1 - eps) * onehot(label) - eps / V),

with ``w`` the row's weight in the reduction (1 / valid rows for ``"mean"``, 1 for
``"sum"``/``"none"``, 0 for an ignored row) and ``lse = m + log(s)``. When the row fits one
tile (``V <= 8192``) it is loaded once and both walks use the registers; at a larger
vocabulary the second walk re-reads the row block's tiles, last tile first, so that the
tiles read most recently, the likeliest to be in L2, come first. Whether the re-read hits L2
depends on the rows in flight: at V = 128256 bf16 (256.5 KB per row) an H200's 50 MB L2
holds about 190 KB of each of the 264 rows that 2 resident 16-warp blocks per SM keep in
flight (an estimate from the compiled occupancy, not a measurement). ``d`` is the residual
of the backward instead of the logits.

``cross_entropy_bwd``: ``dlogits = g * d`` with ``g`` the per-row cotangent, written in
place over ``d`` (an input/output alias); a row block whose ``g`` is all ones (the
cotangent of ``jax.grad`` of a mean or summed loss) skips its tiles: no load, no store.

Bytes per token at V = 128256 bf16 (256.5 KB per pass over the row): the forward reads the
logits once and writes ``d`` once (513 KB; plus the second walk's re-read where it misses
L2, up to 256.5 KB), the backward moves nothing at ``g == 1`` and reads and writes ``d`` once otherwise
(513 KB). The unfused alternative (forward reads; backward reads the logits and writes
dlogits) is 770 KB at any cotangent. The upstream cotangent is only known in JAX's
backward, so no design writes dlogits once for every cotangent.

``cross_entropy_stats``: the first walk alone, for a loss without gradient (``jax.jit`` of
the loss, evaluation) and for a vocabulary shard, whose ``(m, s)`` must be combined with
the other shards' before any gradient is written (vocab-parallel cross-entropy,
Megatron-LM, Shoeybi et al. 2019): shards' ``(m, s)`` combine as an online softmax does,
the label's logit and the mean by a sum. ``cross_entropy_grad`` then writes the shard's
``d`` from the combined ``m`` and ``s``.

Why ``(m, s)`` and not only ``lse``: ``exp(x - lse)`` with an f32 ``lse`` loses the digits
of ``log(s)`` below the ulp of ``m``: at logits near 1e4 the softmax rows sum to 1 +- 4e-4,
and two tied logits of 1e8 (``lse`` rounds to 1e8) would each get probability 1. ``x - m``
is exact for the logits that matter (Sterbenz), so ``exp(x - m) / s`` keeps f32 precision
at any offset.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxbwd.pallas import _common as C

NEG_INF = float("-inf")


def _tiling(R: int, V: int) -> C.RowTiling:
    C.check_index_range("cross_entropy", rows=R, classes=V)
    return C.row_tiling(R, V, max_block_rows=16)


def _fwd_warps(t: C.RowTiling) -> int:
    """16 warps on a full 8192-element tile (16 values per thread): the two walks fit in 64-84
    registers (compiled for sm_90/sm_80; 8 warps need 120-168), and fewer rows in flight per
    SM leave more of each row in L2 for the second walk."""
    return max(1, min(16, t.block_rows * t.block_cols // 512))


def _row_factor(m, s, z: float):
    """The softmax's row shift and factor: exp(x - shift) * scale = (1 + 2 z lse) * softmax(x)."""
    shift = C.finite_or_zero(m)
    safe = jnp.where(s > 0.0, s, 1.0)
    scale = jnp.where(s > 0.0, 1.0 / safe, 0.0)  # an all -inf row (s = 0) has no softmax
    if z:
        scale = scale * (1.0 + 2.0 * z * (shift + jnp.log(safe)))
    return shift, scale


def _grad_tile(x, cols, lab, shift, scale, w, *, eps: float, inv_n: float):
    """``w * (scale * exp(x - shift) - (1 - eps) onehot - eps / V)`` on a [rows, cols] tile;
    exact zeros on rows of weight 0."""
    d = C.exp2((x - shift[:, None]) * C.LOG2E) * scale[:, None]
    d = d - jnp.where(cols[None, :] == lab[:, None], 1.0 - eps, 0.0)
    if eps:
        d = d - eps * inv_n
    return jnp.where(w[:, None] != 0.0, w[:, None] * d, 0.0)


def _ce_fwd_kernel(x_ref, lab_ref, *refs, t: C.RowTiling, grad: bool, with_sum: bool, eps: float, z: float,
                   inv_n: float):
    if grad:
        w_ref, m_ref, s_ref, xl_ref, sx_ref, d_ref = refs
    else:
        m_ref, s_ref, xl_ref, sx_ref = refs
    rb = pl.program_id(0)
    rows = rb * t.block_rows + jnp.arange(t.block_rows, dtype=jnp.int32)
    rmask = rows < t.n_rows
    # Labels arrive already validated: -1 marks an ignored row, or a label on another shard.
    lab = C.load(lab_ref, rows, rmask, other=-1, dtype=jnp.int32)
    xl = C.load(x_ref, (rows, jnp.maximum(lab, 0)), rmask & (lab >= 0))

    def tile(j):
        _, cols, mask = C.tile_index(rb, j, t)
        return cols, mask, C.load_tile(x_ref, rows, cols, mask, other=NEG_INF)

    def stats(carry, cols_mask_x):
        m, s, sx = carry
        _, mask, x = cols_mask_x
        m, s = C.online_lse_update(m, s, x)
        if with_sum:
            sx = sx + jnp.sum(jnp.where(mask, x * inv_n, 0.0), axis=1)
        return m, s, sx

    zeros = jnp.zeros((t.block_rows,), jnp.float32)
    init = (jnp.full((t.block_rows,), NEG_INF, jnp.float32), zeros, zeros)
    single = t.num_col_blocks == 1
    if single:  # the whole row block in registers: one load serves both walks
        first = tile(0)
        m, s, sx = stats(init, first)
    else:
        m, s, sx = jax.lax.fori_loop(0, t.num_col_blocks, lambda j, c: stats(c, tile(j)), init)
    C.store(m_ref, rows, m, rmask)
    C.store(s_ref, rows, s, rmask)
    C.store(xl_ref, rows, xl, rmask)
    C.store(sx_ref, rows, sx, rmask)
    if not grad:
        return
    w = C.load(w_ref, rows, rmask)
    shift, scale = _row_factor(m, s, z)

    def write(cols_mask_x):
        cols, mask, x = cols_mask_x
        C.store_tile(d_ref, rows, cols, _grad_tile(x, cols, lab, shift, scale, w, eps=eps, inv_n=inv_n), mask)

    if single:
        write(first)
    else:
        # Backwards: the tiles read last in the first walk are the likeliest still in L2.
        def body(j, carry):
            write(tile(t.num_col_blocks - 1 - j))
            return carry

        jax.lax.fori_loop(0, t.num_col_blocks, body, 0)


def _fwd_call(name, logits, labels, extra, d_dtype, *, grad, with_sum, eps, z, n_classes, interpret):
    R, V = logits.shape
    t = _tiling(R, V)
    kernel = functools.partial(_ce_fwd_kernel, t=t, grad=grad, with_sum=bool(with_sum), eps=float(eps),
                               z=float(z), inv_n=1.0 / int(n_classes or V))
    vec = jax.ShapeDtypeStruct((R,), jnp.float32)
    out = (vec, vec, vec, vec)
    if grad:
        out = out + (jax.ShapeDtypeStruct((R, V), d_dtype),)
    return C.call(
        kernel, name=name, grid=(t.num_row_blocks,), out_shape=out, interpret=interpret, num_warps=_fwd_warps(t),
        flops=(12 if grad else 6) * R * V, transcendentals=(2 if grad else 1) * R * V,
        bytes_accessed=C.nbytes(logits, labels, *extra) + 16 * R + (R * V * jnp.dtype(d_dtype).itemsize if grad else 0),
    )(logits, labels, *extra)


def cross_entropy_stats(logits, labels, *, with_sum: bool = False, n_classes: int | None = None,
                        interpret: bool = False):
    """Per-row partials of the cross-entropy of ``logits`` [R, V] (any float dtype), one pass.

    Args:
      logits: [R, V]. labels: [R] int32 in [0, V), or -1 (ignored row, or label elsewhere).
      with_sum: also sum each row's logits divided by ``n_classes`` (needed by label smoothing).
      n_classes: the whole vocabulary's size when ``logits`` is a vocabulary shard (default V).
    Returns:
      m [R] f32 (row max; -inf for an all -inf row), s [R] f32 (``sum(exp(x - m))``, 0 for
      an all -inf row), x_label [R] f32 (0 where the label is -1), x_mean [R] f32
      (``sum(x) / n_classes``; 0 unless ``with_sum``).
    """
    return _fwd_call("cross_entropy_stats", logits, labels, (), None, grad=False, with_sum=with_sum, eps=0.0, z=0.0,
                     n_classes=n_classes, interpret=interpret)


def cross_entropy_fwd(logits, labels, weights, *, label_smoothing: float = 0.0, z_loss: float = 0.0,
                      grad_dtype=None, interpret: bool = False):
    """The partials of :func:`cross_entropy_stats` and the weighted gradient ``d`` [R, V], one kernel.

    Args:
      logits: [R, V] (the whole vocabulary). labels: [R] int32 in [0, V) or -1.
      weights: [R] f32, each row's weight ``w`` in the reduced loss (0 for ignored rows).
      grad_dtype: dtype of ``d`` (default logits' dtype).
    Returns:
      ``(m, s, x_label, x_mean, d)``; ``d = w * dloss_row/dlogits`` (module docstring).
    """
    return _fwd_call("cross_entropy_fwd", logits, labels, (weights,), grad_dtype or logits.dtype, grad=True,
                     with_sum=bool(label_smoothing), eps=label_smoothing, z=z_loss, n_classes=None,
                     interpret=interpret)


def _ce_grad_kernel(x_ref, lab_ref, m_ref, s_ref, w_ref, d_ref, *, t: C.RowTiling, eps: float, z: float,
                    inv_n: float):
    rb, j = pl.program_id(0), pl.program_id(1)
    rows, cols, mask = C.tile_index(rb, j, t)
    rmask = rows < t.n_rows
    lab = C.load(lab_ref, rows, rmask, other=-1, dtype=jnp.int32)
    shift, scale = _row_factor(C.load(m_ref, rows, rmask), C.load(s_ref, rows, rmask), z)
    w = C.load(w_ref, rows, rmask)
    x = C.load_tile(x_ref, rows, cols, mask, other=NEG_INF)
    C.store_tile(d_ref, rows, cols, _grad_tile(x, cols, lab, shift, scale, w, eps=eps, inv_n=inv_n), mask)


def cross_entropy_grad(logits, labels, m, s, weights, *, label_smoothing: float = 0.0, z_loss: float = 0.0,
                       n_classes: int | None = None, grad_dtype=None, interpret: bool = False):
    """``d`` [R, V] (module docstring) from given row statistics: the row max ``m`` and
    ``s = sum(exp(x - m))`` over the whole vocabulary ([R] f32 each), for a vocabulary shard.

    ``labels`` [R] int32 as for :func:`cross_entropy_stats` (-1: no one-hot term here),
    ``weights`` [R] f32 (0 on ignored rows), ``n_classes`` the whole vocabulary's size.
    """
    R, V = logits.shape
    t = _tiling(R, V)
    grad_dtype = grad_dtype or logits.dtype
    kernel = functools.partial(_ce_grad_kernel, t=t, eps=float(label_smoothing), z=float(z_loss),
                               inv_n=1.0 / int(n_classes or V))
    return C.call(
        kernel, name="cross_entropy_grad", grid=(t.num_row_blocks, t.num_col_blocks),
        out_shape=jax.ShapeDtypeStruct((R, V), grad_dtype), interpret=interpret,
        num_warps=t.num_warps, flops=6 * R * V, transcendentals=R * V,
        bytes_accessed=C.nbytes(logits, labels, m, s, weights) + R * V * jnp.dtype(grad_dtype).itemsize,
    )(logits, labels, m, s, weights)


def _ce_bwd_kernel(d_ref, g_ref, out_ref, *, t: C.RowTiling):
    rb = pl.program_id(0)
    rows = rb * t.block_rows + jnp.arange(t.block_rows, dtype=jnp.int32)
    rmask = rows < t.n_rows
    g = C.load(g_ref, rows, rmask, other=1.0)
    in_place = d_ref.dtype == out_ref.dtype

    def scale():
        def body(j, carry):
            _, cols, mask = C.tile_index(rb, j, t)
            C.store_tile(out_ref, rows, cols, g[:, None] * C.load_tile(d_ref, rows, cols, mask), mask)
            return carry

        jax.lax.fori_loop(0, t.num_col_blocks, body, 0)

    if in_place:  # the output is d's buffer: rows scaled by 1 are already right
        pl.when(jnp.max(jnp.where(g != 1.0, 1, 0)) > 0)(scale)
    else:
        scale()


def cross_entropy_bwd(d, g, *, out_dtype=None, interpret: bool = False):
    """dlogits = ``g[:, None] * d`` [R, V] in ``out_dtype`` (default d's), in place over ``d``
    when the dtypes agree; row blocks with ``g == 1`` are skipped (no memory traffic).

    ``d`` [R, V] from :func:`cross_entropy_fwd` or :func:`cross_entropy_grad`, ``g`` [R] f32.
    """
    R, V = d.shape
    t = _tiling(R, V)
    out_dtype = jnp.dtype(out_dtype or d.dtype)
    in_place = out_dtype == d.dtype
    return C.call(
        functools.partial(_ce_bwd_kernel, t=t), name="cross_entropy_bwd", grid=(t.num_row_blocks,),
        out_shape=jax.ShapeDtypeStruct((R, V), out_dtype), interpret=interpret, num_warps=t.num_warps,
        flops=R * V, bytes_accessed=C.nbytes(d, g) + R * V * out_dtype.itemsize,
        input_output_aliases={0: 0} if in_place else None,
    )(d, g)
