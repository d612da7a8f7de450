"""Forward and backward kernels of cross_entropy over a large vocabulary.

``cross_entropy_fwd``: one program per row block walks the vocabulary in power-of-two
column tiles (the tail tile masked with -inf) keeping, per row, the online max ``m`` and
sum of exponentials ``s = sum(exp(x - m))`` (Milakov & Gimelshein 2018), the label's logit
and, with label smoothing, the mean of the logits. It writes four f32 values per row:
``m``, ``s``, the label's logit ``x[label]`` (0 where the label is -1) and
``mean(x) = sum(x / V)`` (0 without smoothing; summed as ``x / V`` so that logits near the
f32 maximum cannot overflow it). The loss, with ``lse = m + log(s)``,

    loss = lse - (1 - eps) * x[label] - eps * mean(x) + z * lse**2

is formed from them outside the kernel, on [rows] vectors. Keeping the partials apart is
what makes the kernel usable on a vocabulary shard: shards' ``(m, s)`` combine as an online
softmax does, the other two by a sum (vocab-parallel cross-entropy, Megatron-LM, Shoeybi
et al. 2019). Nothing of size [rows, V] is written besides the logits the caller already
holds.

``cross_entropy_bwd``: one program per (row block, vocab tile) recomputes the softmax
from the saved ``m`` and ``s`` and writes

    dlogits = g * ((1 + 2 z lse) * exp(x - m) / s - (1 - eps) * onehot(label) - eps / V)

Why ``(m, s)`` and not only ``lse``: ``exp(x - lse)`` with an f32 ``lse`` loses the digits
of ``log(s)`` below the ulp of ``m``: at logits near 1e4 the softmax rows sum to 1 +- 4e-4,
and two tied logits of 1e8 (``lse`` rounds to 1e8) would each get probability 1. ``x - m``
is exact for the logits that matter (Sterbenz), so ``exp(x - m) / s`` keeps f32 precision
at any offset.

with ``g`` the f32 per-row cotangent (already 0 for ignored rows, already divided by the
number of valid rows for ``reduction="mean"``) and ``V`` the number of classes of the
whole vocabulary (``n_classes``, which on a vocabulary shard exceeds the shard's width).
Rows with ``g == 0`` get exact zeros.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxbwd.pallas import _common as C

NEG_INF = float("-inf")


def _tiling(R: int, V: int) -> C.RowTiling:
    return C.row_tiling(R, V, max_block_rows=16)


def _ce_fwd_kernel(x_ref, lab_ref, m_ref, s_ref, xl_ref, sx_ref, *, t: C.RowTiling, with_sum: bool,
                   inv_n: float):
    rb = pl.program_id(0)
    rows = rb * t.block_rows + jnp.arange(t.block_rows)
    rmask = rows < t.n_rows
    # Labels arrive already validated: -1 marks an ignored row, or a label on another shard.
    lab = C.load(lab_ref, rows, rmask, other=-1, dtype=jnp.int32)

    def body(j, carry):
        m, s, xl, sx = carry
        _, cols, mask = C.tile_index(rb, j, t)
        x = C.load_tile(x_ref, rows, cols, mask, other=NEG_INF)
        m, s = C.online_lse_update(m, s, x)
        xl = xl + jnp.sum(jnp.where(cols[None, :] == lab[:, None], x, 0.0), axis=1)
        if with_sum:
            sx = sx + jnp.sum(jnp.where(mask, x * inv_n, 0.0), axis=1)
        return m, s, xl, sx

    zeros = jnp.zeros((t.block_rows,), jnp.float32)
    init = (jnp.full((t.block_rows,), NEG_INF, jnp.float32), zeros, zeros, zeros)
    m, s, xl, sx = jax.lax.fori_loop(0, t.num_col_blocks, body, init)
    C.store(m_ref, rows, m, rmask)
    C.store(s_ref, rows, s, rmask)
    C.store(xl_ref, rows, xl, rmask)
    C.store(sx_ref, rows, sx, rmask)


def cross_entropy_fwd(logits, labels, *, with_sum: bool = False, n_classes: int | None = None,
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
    R, V = logits.shape
    t = _tiling(R, V)
    kernel = functools.partial(_ce_fwd_kernel, t=t, with_sum=bool(with_sum), inv_n=1.0 / int(n_classes or V))
    vec = jax.ShapeDtypeStruct((R,), jnp.float32)
    return C.call(
        kernel, name="cross_entropy_fwd", grid=(t.num_row_blocks,), out_shape=(vec, vec, vec, vec),
        interpret=interpret, num_warps=t.num_warps, flops=6 * R * V, transcendentals=R * V,
        bytes_accessed=C.nbytes(logits, labels) + 16 * R,
    )(logits, labels)


def _ce_bwd_kernel(x_ref, lab_ref, m_ref, s_ref, g_ref, dx_ref, *, t: C.RowTiling, eps: float, z: float,
                   n_classes: int):
    rb, j = pl.program_id(0), pl.program_id(1)
    rows, cols, mask = C.tile_index(rb, j, t)
    rmask = rows < t.n_rows
    lab = C.load(lab_ref, rows, rmask, other=-1, dtype=jnp.int32)
    m = C.finite_or_zero(C.load(m_ref, rows, rmask))
    s = C.load(s_ref, rows, rmask)
    g = C.load(g_ref, rows, rmask)
    x = C.load_tile(x_ref, rows, cols, mask, other=NEG_INF)
    # Per-row factor once, one multiply per element: 1/s (0 for an all -inf row, s = 0),
    # times the z-loss factor 1 + 2 z lse.
    scale = jnp.where(s > 0.0, 1.0 / jnp.where(s > 0.0, s, 1.0), 0.0)
    if z:
        scale = scale * (1.0 + 2.0 * z * (m + jnp.log(jnp.where(s > 0.0, s, 1.0))))
    p = C.exp(x - m[:, None]) * scale[:, None]
    d = p - jnp.where(cols[None, :] == lab[:, None], 1.0 - eps, 0.0)
    if eps:
        d = d - eps / n_classes
    d = jnp.where(g[:, None] != 0.0, g[:, None] * d, 0.0)
    C.store_tile(dx_ref, rows, cols, d, mask)


def cross_entropy_bwd(logits, labels, m, s, g, *, label_smoothing: float = 0.0, z_loss: float = 0.0,
                      n_classes: int | None = None, interpret: bool = False):
    """dlogits [R, V] in logits' dtype from the saved row max ``m`` and ``s = sum(exp(x - m))``
    ([R] f32 each, over the whole vocabulary) and row cotangents ``g`` [R] f32.

    ``labels`` [R] int32 as for :func:`cross_entropy_fwd` (-1: no one-hot term here; ``g``
    must be 0 on ignored rows). ``n_classes``: the whole vocabulary's size when ``logits``
    is a vocabulary shard (default V).
    """
    R, V = logits.shape
    t = _tiling(R, V)
    kernel = functools.partial(_ce_bwd_kernel, t=t, eps=float(label_smoothing), z=float(z_loss),
                               n_classes=int(n_classes or V))
    return C.call(
        kernel, name="cross_entropy_bwd", grid=(t.num_row_blocks, t.num_col_blocks),
        out_shape=jax.ShapeDtypeStruct((R, V), logits.dtype), interpret=interpret,
        num_warps=t.num_warps, flops=6 * R * V, transcendentals=R * V,
        bytes_accessed=2 * C.nbytes(logits) + C.nbytes(labels, m, s, g),
    )(logits, labels, m, s, g)
