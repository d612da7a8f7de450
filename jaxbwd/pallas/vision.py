"""Backward kernels of upsample2d, pixel_shuffle and unpatchify.

All three are written in gather form: each program owns a tile of the *input* gradient
(viewed as [rows, channels]) and reads the output-gradient elements that land on it, so
every dx element is written exactly once, by one program, in a fixed order: no atomics,
bitwise reproducible.

- pixel_shuffle / unpatchify: the backward is the inverse permutation (pixel_unshuffle,
  patchify): one read and one write per element. pixel_shuffle with r = 2 loads the four
  source pixels' channel runs (contiguous) and interleaves them in registers; other r
  gather each element's (pixel, channel) source computed from the tile's (row, column)
  indices. unpatchify copies the contiguous runs of p*C values that a patch row is in both
  layouts. No flat index, so
  nothing wraps at 2**31.
- upsample2d: each dx pixel sums the (sh x sw) dy block it was copied to (nearest), or the
  dy pixels whose bilinear stencil touches it, weighted by the interpolation weights
  recomputed from the half-pixel-centre formula (bilinear). The taps are a static loop.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxbwd.pallas import _common as C

# Tiles of the permutation kernels: 4096 elements, up to 1024 channels wide.
PERMUTE_TILE = 4096


def _tiling(R: int, K: int) -> C.RowTiling:
    return C.row_tiling(R, K, max_tile=PERMUTE_TILE, max_block_rows=256)


# --------------------------------------------------------------------- permutations
def _gather_kernel(src_ref, out_ref, *, t: C.RowTiling, index):
    rows, cols, mask = C.tile_index(pl.program_id(0), pl.program_id(1), t)
    src_row, src_col = index(rows[:, None], cols[None, :])
    src = (jnp.where(mask, src_row, 0), jnp.where(mask, src_col, 0))
    C.store_tile(out_ref, rows, cols, C.load(src_ref, src, mask), mask)


def _gather(src, out_rows: int, out_cols: int, index, *, name: str, interpret: bool):
    """out[r, k] = src[index(r, k)] for a permutation ``index`` of the [pixels, channels] view
    of src (NHWC): ``index`` returns a (pixel, channel) pair, never a flat offset, so every
    index stays within int32 (Pallas widens to int64 when it scales them by strides)."""
    pixels = src.size // src.shape[-1]
    C.check_index_range(name.removesuffix("_bwd"), pixels=pixels, rows=out_rows, cols=out_cols)
    t = _tiling(out_rows, out_cols)
    return C.call(
        functools.partial(_gather_kernel, t=t, index=index), name=name,
        grid=(t.num_row_blocks, t.num_col_blocks),
        out_shape=jax.ShapeDtypeStruct((out_rows, out_cols), src.dtype), interpret=interpret,
        num_warps=t.num_warps, bytes_accessed=2 * C.nbytes(src),
    )(src.reshape(pixels, src.shape[-1]))


def _unshuffle2_kernel(dy_ref, out_ref, *, n_pix: int, H: int, W: int, Cc: int, block_rows: int, block_c: int):
    rows = pl.program_id(0) * block_rows + jnp.arange(block_rows, dtype=jnp.int32)
    c = pl.program_id(1) * block_c + jnp.arange(block_c, dtype=jnp.int32)
    rmask = rows < n_pix
    n, h, w = C.idiv(rows, H * W), C.imod(C.idiv(rows, W), H), C.imod(rows, W)
    mask = rmask[:, None] & (c < Cc)[None, :]

    def tap(i, j):  # dy pixel (n, 2h + i, 2w + j): one contiguous run of C channels
        src = jnp.where(rmask, ((n * H + h) * 2 + i) * (2 * W) + w * 2 + j, 0)
        return C.load(dy_ref, (src[:, None], c[None, :]), mask)

    # dx channel 4c + 2i + j: the four taps interleaved in registers (two pairwise joins:
    # i inner, j outer, so that j varies fastest).
    v = jnp.stack([jnp.stack([tap(0, 0), tap(1, 0)], axis=-1), jnp.stack([tap(0, 1), tap(1, 1)], axis=-1)], axis=-1)
    k = pl.program_id(1) * 4 * block_c + jnp.arange(4 * block_c, dtype=jnp.int32)
    C.store_tile(out_ref, rows, k, v.reshape(block_rows, 4 * block_c), rmask[:, None] & (k < 4 * Cc)[None, :])


def pixel_shuffle_bwd(dy, r: int, *, interpret: bool = False):
    """pixel_unshuffle of dy [N, H*r, W*r, C] -> dx [N, H, W, C*r*r].

    ``dx[n, h, w, c*r*r + i*r + j] = dy[n, h*r+i, w*r+j, c]``. For r = 2 each dx row is four
    contiguous dy channel runs interleaved in registers (contiguous loads and stores); other r
    gather element by element.
    """
    N, Hr, Wr, Cc = dy.shape
    H, W = Hr // r, Wr // r
    if r == 2:
        C.check_index_range("pixel_shuffle", pixels=N * Hr * Wr, rows=N * H * W, cols=Cc * 4)
        block_c = min(C.next_pow2(Cc), PERMUTE_TILE // 4)
        block_rows = max(1, min(C.next_pow2(N * H * W), PERMUTE_TILE // (4 * block_c)))
        kernel = functools.partial(_unshuffle2_kernel, n_pix=N * H * W, H=H, W=W, Cc=Cc, block_rows=block_rows,
                                   block_c=block_c)
        dx = C.call(
            kernel, name="pixel_shuffle_bwd", grid=(C.cdiv(N * H * W, block_rows), C.cdiv(Cc, block_c)),
            out_shape=jax.ShapeDtypeStruct((N * H * W, Cc * 4), dy.dtype), interpret=interpret,
            num_warps=max(1, min(8, block_rows * block_c * 4 // 512)), bytes_accessed=2 * C.nbytes(dy),
        )(dy.reshape(N * Hr * Wr, Cc))
        return dx.reshape(N, H, W, Cc * 4)

    def index(p, k):
        n, h, w = C.idiv(p, H * W), C.imod(C.idiv(p, W), H), C.imod(p, W)
        c, i, j = C.idiv(k, r * r), C.imod(C.idiv(k, r), r), C.imod(k, r)
        return ((n * H + h) * r + i) * Wr + w * r + j, c

    dx = _gather(dy, N * H * W, Cc * r * r, index, name="pixel_shuffle_bwd", interpret=interpret)
    return dx.reshape(N, H, W, Cc * r * r)


def _patchify_kernel(dy_ref, out_ref, *, n_tok: int, T: int, gw: int, p: int, seg: int, block_rows: int,
                     block_seg: int, Ho: int):
    rows = pl.program_id(0) * block_rows + jnp.arange(block_rows, dtype=jnp.int32)
    k = jnp.arange(block_seg, dtype=jnp.int32)
    mask = (rows < n_tok)[:, None] & (k < seg)[None, :]
    n, tok = C.idiv(rows, T), C.imod(rows, T)
    gi, gj = C.idiv(tok, gw), C.imod(tok, gw)
    for i in range(p):  # patch row i: p pixels x C channels, contiguous in dy and in the token
        src = jnp.where(rows < n_tok, n * Ho + gi * p + i, 0)
        v = C.load(dy_ref, (src[:, None], gj[:, None] * seg + k[None, :]), mask)
        C.store_tile(out_ref, rows, i * seg + k, v, mask)


def unpatchify_bwd(dy, gh: int, gw: int, p: int, *, interpret: bool = False):
    """patchify of dy [N, gh*p, gw*p, C] -> dtokens [N, gh*gw, p*p*C].

    ``dtokens[n, gi*gw+gj, (i*p+j)*C + c] = dy[n, gi*p+i, gj*p+j, c]``: for each patch row i
    the p*C values ``(j, c)`` are one contiguous run in dy (image row ``gi*p+i``, viewed as
    [N*H, W*C]) and in the token, so the kernel copies [block_rows, p*C] tiles of runs:
    contiguous, vectorisable loads and stores, no per-element index arithmetic.
    """
    N, Ho, Wo, Cc = dy.shape
    T, seg = gh * gw, p * Cc
    C.check_index_range("unpatchify", rows=N * Ho, cols=Wo * Cc, tokens=N * T)
    block_seg = C.next_pow2(seg)
    block_rows = max(1, min(C.next_pow2(N * T), PERMUTE_TILE // block_seg))
    kernel = functools.partial(_patchify_kernel, n_tok=N * T, T=T, gw=gw, p=p, seg=seg, block_rows=block_rows,
                               block_seg=block_seg, Ho=Ho)
    dt = C.call(
        kernel, name="unpatchify_bwd", grid=(C.cdiv(N * T, block_rows),),
        out_shape=jax.ShapeDtypeStruct((N * T, p * seg), dy.dtype), interpret=interpret,
        num_warps=max(1, min(8, block_rows * block_seg // 512)), bytes_accessed=2 * C.nbytes(dy),
    )(dy.reshape(N * Ho, Wo * Cc))
    return dt.reshape(N, T, p * seg)


# ------------------------------------------------------------------------ upsample2d
def bilinear_taps(s: int) -> tuple[int, ...]:
    """Offsets d such that output o = s*h + d can read input h under half-pixel bilinear
    upsampling by s: |(o + 0.5)/s - 0.5 - h| < 1, i.e. -s/2 - 1/2 < d < 3s/2 - 1/2."""
    return tuple(d for d in range(-s, 2 * s) if abs((d + 0.5) / s - 0.5) < 1.0)


def bilinear_weight(o, h, s: int, n_in: int):
    """Weight of input index h in output o (upsampling by s, half-pixel centres, edge
    taps clamped as ``jax.image.resize``): the sum of the two taps' weights that map to h."""
    u = (o.astype(jnp.float32) + 0.5) / s - 0.5
    i0 = (u + 1.0).astype(jnp.int32) - 1  # floor(u) for u > -1
    f = u - i0.astype(jnp.float32)
    t0 = jnp.clip(i0, 0, n_in - 1)
    t1 = jnp.clip(i0 + 1, 0, n_in - 1)
    return jnp.where(t0 == h, 1.0 - f, 0.0) + jnp.where(t1 == h, f, 0.0)


# upsample2d's tile: 1024 elements over 4 warps, 8 per thread. Each tap's load is issued
# ahead of the sum, so the bilinear stencil's 16 taps are live at once: at 4096 elements
# (32 per thread) the kernel compiled to 255 registers and spilled 8-40 B (f32, bf16 on
# H200); at 8 per thread, 96-172 registers and no spills, and nearest reaches full occupancy.
UPSAMPLE_TILE = 1024


def _upsample_bwd_kernel(dy_ref, dx_ref, *, t: C.RowTiling, H: int, W: int, sh: int, sw: int, bilinear: bool):
    rows, cols, mask = C.tile_index(pl.program_id(0), pl.program_id(1), t)
    Ho, Wo = H * sh, W * sw
    n, h, w = C.idiv(rows, H * W), C.imod(C.idiv(rows, W), H), C.imod(rows, W)
    taps_h = bilinear_taps(sh) if bilinear else tuple(range(sh))
    taps_w = bilinear_taps(sw) if bilinear else tuple(range(sw))
    acc = jnp.zeros((t.block_rows, t.block_cols), jnp.float32)
    for dh in taps_h:
        oh = h * sh + dh
        vh = (oh >= 0) & (oh < Ho)
        wh = bilinear_weight(oh, h, sh, H) if bilinear else None
        for dw in taps_w:
            ow = w * sw + dw
            valid = vh & (ow >= 0) & (ow < Wo)
            src = jnp.where(valid, (n * Ho + oh) * Wo + ow, 0)
            m = mask & valid[:, None]
            v = C.load_tile(dy_ref, src, cols, m)
            if bilinear:
                v = v * jnp.where(valid, wh * bilinear_weight(ow, w, sw, W), 0.0)[:, None]
            acc = acc + v
    C.store_tile(dx_ref, rows, cols, acc, mask)


def upsample2d_bwd(dy, sh: int, sw: int, *, bilinear: bool, interpret: bool = False):
    """dx [N, H, W, C] of upsample2d from dy [N, H*sh, W*sw, C], f32 accumulation.

    nearest: ``dx[n, h, w] = sum_{a<sh, b<sw} dy[n, h*sh+a, w*sw+b]``; bilinear: the sum over
    the dy pixels whose interpolation stencil includes (h, w), times their weights.
    """
    N, Ho, Wo, Cc = dy.shape
    H, W = Ho // sh, Wo // sw
    C.check_index_range("upsample2d", pixels=N * Ho * Wo)
    t = C.row_tiling(N * H * W, Cc, max_tile=UPSAMPLE_TILE, max_block_rows=UPSAMPLE_TILE, per_thread=8,
                     max_warps=4, least_padded=True)
    n_taps = (len(bilinear_taps(sh)) * len(bilinear_taps(sw))) if bilinear else sh * sw
    dx = C.call(
        functools.partial(_upsample_bwd_kernel, t=t, H=H, W=W, sh=sh, sw=sw, bilinear=bilinear),
        name="upsample2d_bwd", grid=(t.num_row_blocks, t.num_col_blocks),
        out_shape=jax.ShapeDtypeStruct((N * H * W, Cc), dy.dtype), interpret=interpret,
        num_warps=t.num_warps, flops=2 * n_taps * N * H * W * Cc,
        bytes_accessed=C.nbytes(dy) * (n_taps // (sh * sw) if bilinear else 1) + C.nbytes(dy) // (sh * sw),
    )(dy.reshape(N * Ho * Wo, Cc))
    return dx.reshape(N, H, W, Cc)
