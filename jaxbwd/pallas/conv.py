"""conv2d backward as implicit GEMMs: dgrad (dx) and wgrad (dw), NHWC x, HWIO w.

Forward: ``y[n, p, q, co] = sum_{a, b, ci} x[n, p*sh - pt + a*dh, q*sw - pl + b*dw, g*Cig + ci]
* w[a, b, ci, co]`` with g = co // Cog (Cig = Cin/groups, Cog = Cout/groups).

Implicit GEMM (as cuDNN and CUTLASS do): the GEMM operands are gathered tile by tile from
x / dy / w with computed row indices and masks (padding, image edges, tails); no im2col
matrix and no zero-dilated dy is ever written to HBM.

- wgrad, per tap (a, b) and group g: ``dw[a, b] = X_ab^T @ dY`` with M = Cig, N = Cog and
  K = N*Ho*Wo output pixels, X_ab's rows being the input pixels tap (a, b) reads. K is
  split over ``S`` programs that each write an f32 partial; XLA sums the S partials:
  fixed order, no atomics, deterministic.
- dgrad: ``dx = sum_{a, b} dY_ab @ w[a, b]^T`` with M = input pixels, N = Cig and
  K = taps x Cog. Input pixel h receives tap a from output row p = (h + pt - a*dh) / sh
  only when that division is exact. Programs own pixels of one stride phase
  (h mod sh, w mod sw), for which exactness is the same for every pixel of the tile: the
  taps that reach phase r are ``a0(r), a0(r) + sh/gcd(sh, dh), ...`` (a0 and their count
  tabulated per phase at trace time), so a program walks only those, 1/(sh*sw) of the taps'
  work at stride 2 x 2 as in CUTLASS's strided dgrad. The K loop is one flat loop over
  (tap, output-channel block) with no branch in its body, which Triton's software
  pipeliner can overlap (``num_stages`` loads in flight).
- Depthwise convolution (Cig == 1, groups == Cin, channel multiplier m = Cout/Cin) has no
  reduction over channels: the same kernels use elementwise products over channel tiles
  instead of tile matmuls (a matmul would be 1/16 useful).

Accumulation is f32; tiles are fed to ``dot`` in the input dtype (bf16/f16 tensor cores;
f32 through TF32 or 3xTF32 as ``jax.default_matmul_precision`` says: ``_common.dot``).
Tiles, warps and stages come from the tuning table (``_tuning.conv``): 128 x 128 output
tiles on 8 warps with 3 stages on sm_90 and sm_80, K steps of 64 (16-bit) or 32 (f32)
elements on sm_90, half that on sm_80 (its 164 KB of shared memory); wgrad's split of the
pixel reduction from the compiled occupancy and the SM count (``_tuning.split``).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxbwd.pallas import _common as C
from jaxbwd.pallas import _tuning



@dataclasses.dataclass(frozen=True)
class ConvGeometry:
    """Static shape of one convolution: x [N, H, W, Cin], w [KH, KW, Cin/groups, Cout],
    y [N, Ho, Wo, Cout], strides (sh, sw), dilations (dh, dw), top/left padding (pt, pl).

    Hashable, so it can be a static argument of the custom_vjp and of the kernels."""

    N: int
    H: int
    W: int
    Cin: int
    Ho: int
    Wo: int
    Cout: int
    KH: int
    KW: int
    sh: int
    sw: int
    dh: int
    dw: int
    pt: int
    pl: int
    groups: int
    pb: int = 0  # bottom / right padding: only the forward needs them
    pr: int = 0

    @property
    def Cig(self) -> int:
        return self.Cin // self.groups

    @property
    def Cog(self) -> int:
        return self.Cout // self.groups

    @property
    def taps(self) -> int:
        return self.KH * self.KW

    @property
    def depthwise(self) -> bool:
        return self.Cig == 1 and self.groups > 1

    @property
    def flops(self) -> int:
        return 2 * self.N * self.Ho * self.Wo * self.Cout * self.taps * self.Cig


def _block(n: int, cap: int) -> int:
    """Power-of-two tile edge for an extent ``n``: at most ``cap``, at least 16 (tl.dot)."""
    return max(16, min(C.next_pow2(n), cap))


def _warps(cfg: _tuning.Config, m: int, n: int) -> int:
    # Tiles under 128 x 64 (few channels) give each of 8 warps too little of the product.
    return cfg.num_warps if m * n >= 128 * 64 else min(cfg.num_warps, 4)


def _load(ref, idx, mask, dtype):
    return C.load(ref, idx, mask, dtype=dtype)


# ----------------------------------------------------------------------------- wgrad
def _wgrad_kernel(x_ref, dy_ref, dw_ref, *, geo: ConvGeometry, BK: int, BI: int, BO: int, S: int, n_iter: int):
    pid, s = pl.program_id(0), pl.program_id(1)
    dt = x_ref.dtype
    if geo.depthwise:
        nbo = C.cdiv(geo.Cout, BO)
        tap, bo = C.idiv(pid, nbo), C.imod(pid, nbo)
        co = bo * BO + jnp.arange(BO, dtype=jnp.int32)
        omask = co < geo.Cout
        xcols = C.idiv(co, geo.Cog)  # the input channel each output channel reads
        acc = jnp.zeros((BO,), jnp.float32)
    else:
        nbi, nbo = C.cdiv(geo.Cig, BI), C.cdiv(geo.Cog, BO)
        per_tap = geo.groups * nbi * nbo
        tap, rest = C.idiv(pid, per_tap), C.imod(pid, per_tap)
        g, bi, bo = C.idiv(rest, nbi * nbo), C.imod(C.idiv(rest, nbo), nbi), C.imod(rest, nbo)
        ci = bi * BI + jnp.arange(BI, dtype=jnp.int32)
        co = bo * BO + jnp.arange(BO, dtype=jnp.int32)
        imask, omask = ci < geo.Cig, co < geo.Cog
        xcols, ycols = g * geo.Cig + ci, g * geo.Cog + co
        acc = jnp.zeros((BI, BO), jnp.float32)
    a, b = C.idiv(tap, geo.KW), C.imod(tap, geo.KW)
    n_pix = geo.N * geo.Ho * geo.Wo

    def body(it, acc):
        pix = (s + it * S) * BK + jnp.arange(BK, dtype=jnp.int32)
        n, p, q = C.idiv(pix, geo.Ho * geo.Wo), C.imod(C.idiv(pix, geo.Wo), geo.Ho), C.imod(pix, geo.Wo)
        hi = p * geo.sh - geo.pt + a * geo.dh
        wi = q * geo.sw - geo.pl + b * geo.dw
        inb = pix < n_pix
        valid = inb & (hi >= 0) & (hi < geo.H) & (wi >= 0) & (wi < geo.W)
        xrow = jnp.where(valid, (n * geo.H + hi) * geo.W + wi, 0)
        yrow = jnp.where(inb, pix, 0)
        if geo.depthwise:
            m = valid[:, None] & omask[None, :]
            xt = C.load(x_ref, (xrow[:, None], xcols[None, :]), m)
            yt = C.load(dy_ref, (yrow[:, None], co[None, :]), m)
            return acc + jnp.sum(xt * yt, axis=0)
        xt = _load(x_ref, (xrow[:, None], xcols[None, :]), valid[:, None] & imask[None, :], dt)
        yt = _load(dy_ref, (yrow[:, None], ycols[None, :]), inb[:, None] & omask[None, :], dt)
        return acc + C.dot(xt, yt, trans_a=True)

    acc = lax.fori_loop(0, n_iter, body, acc)
    if geo.depthwise:
        C.store(dw_ref, (s * geo.taps + tap, co), acc, omask)
    else:
        rows = (s * geo.taps + tap) * geo.Cig + ci
        C.store_tile(dw_ref, rows, ycols, acc, imask[:, None] & omask[None, :])


def conv2d_wgrad(x, dy, geo: ConvGeometry, *, interpret: bool = False):
    """dw [KH, KW, Cig, Cout] float32 from x [N, H, W, Cin] and dy [N, Ho, Wo, Cout].

    Tiles: block_m input channels x block_n output channels per (tap, group), block_k
    output pixels per step; the pixel reduction is split over S programs (f32 partials)."""
    n_pix = geo.N * geo.Ho * geo.Wo
    cfg = _tuning.conv("conv2d_wgrad", x.dtype, geo.depthwise)
    BK = cfg.block_k if not geo.depthwise else cfg.block_m
    n_kb = C.cdiv(n_pix, BK)
    if geo.depthwise:
        BI, BO = 1, max(16, min(cfg.block_n, C.next_pow2(geo.Cout)))
        tiles = geo.taps * C.cdiv(geo.Cout, BO)
        rows_out = geo.taps
        nw = cfg.num_warps
    else:
        BI, BO = _block(geo.Cig, cfg.block_m), _block(geo.Cog, cfg.block_n)
        tiles = geo.taps * geo.groups * C.cdiv(geo.Cig, BI) * C.cdiv(geo.Cog, BO)
        rows_out = geo.taps * geo.Cig
        nw = _warps(cfg, BI, BO)
    # Split the pixel reduction to fill whole waves of resident programs (up to four; each
    # split adds an f32 partial of dw, kept within the bytes of x and dy together).
    S = _tuning.split(tiles, n_kb, cfg, max_waves=4, min_steps=4,
                      max_split=(C.nbytes(x) + C.nbytes(dy)) // (4 * rows_out * geo.Cout))
    n_iter = C.cdiv(n_kb, S)
    kernel = functools.partial(_wgrad_kernel, geo=geo, BK=BK, BI=BI, BO=BO, S=S, n_iter=n_iter)
    part = C.call(
        kernel, name="conv2d_wgrad", grid=(tiles, S),
        out_shape=jax.ShapeDtypeStruct((S * rows_out, geo.Cout), jnp.float32), interpret=interpret,
        num_warps=nw, num_stages=cfg.num_stages, flops=geo.flops,
        bytes_accessed=C.nbytes(x) * geo.taps + C.nbytes(dy) + 4 * S * rows_out * geo.Cout,
    )(x.reshape(-1, geo.Cin), dy.reshape(-1, geo.Cout))
    return part.reshape(S, geo.KH, geo.KW, geo.Cig, geo.Cout).sum(axis=0)


# ----------------------------------------------------------------------------- dgrad
def _phase_taps(k: int, s: int, d: int, pad: int) -> tuple[tuple[int, int], ...]:
    """Per stride phase r in [0, s): (first tap, number of taps) of the kernel taps a in
    [0, k) with (r + pad - a*d) divisible by s; those taps are first + i * s/gcd(s, d)."""
    out = []
    for r in range(s):
        hits = [a for a in range(k) if (r + pad - a * d) % s == 0]
        out.append((hits[0], len(hits)) if hits else (0, 0))
    return tuple(out)


def _select(r, table):
    """``table[r]`` for a traced scalar r and a short static table of ints."""
    v = jnp.int32(table[0])
    for i, t in enumerate(table[1:], 1):
        v = jnp.where(r == i, jnp.int32(t), v)
    return v


def _dgrad_kernel(dy_ref, w_ref, dx_ref, *, geo: ConvGeometry, BM: int, BI: int, BO: int):
    phase, mb, cb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    dt = dy_ref.dtype
    rh, rw = C.idiv(phase, geo.sw), C.imod(phase, geo.sw)
    Hp, Wp = C.cdiv(geo.H, geo.sh), C.cdiv(geo.W, geo.sw)
    m = mb * BM + jnp.arange(BM, dtype=jnp.int32)
    n, i, j = C.idiv(m, Hp * Wp), C.imod(C.idiv(m, Wp), Hp), C.imod(m, Wp)
    h, w = rh + geo.sh * i, rw + geo.sw * j
    pmask = (m < geo.N * Hp * Wp) & (h < geo.H) & (w < geo.W)
    if geo.depthwise:
        ci = cb * BI + jnp.arange(BI, dtype=jnp.int32)  # over all Cin channels
        cmask = ci < geo.Cin
        dxcols = ci
    else:
        nbi = C.cdiv(geo.Cig, BI)
        g, bi = C.idiv(cb, nbi), C.imod(cb, nbi)
        ci = bi * BI + jnp.arange(BI, dtype=jnp.int32)
        cmask = ci < geo.Cig
        dxcols = g * geo.Cig + ci
    # Non-negative shifts so that % and // act on non-negative numbers.
    off_h = geo.sh * C.cdiv(geo.dh * (geo.KH - 1), geo.sh)
    off_w = geo.sw * C.cdiv(geo.dw * (geo.KW - 1), geo.sw)
    # The taps that reach this program's stride phase (all of them at stride 1).
    taps_h, taps_w = _phase_taps(geo.KH, geo.sh, geo.dh, geo.pt), _phase_taps(geo.KW, geo.sw, geo.dw, geo.pl)
    step_h, step_w = geo.sh // math.gcd(geo.sh, geo.dh), geo.sw // math.gcd(geo.sw, geo.dw)
    a0, na = _select(rh, [t[0] for t in taps_h]), _select(rh, [t[1] for t in taps_h])
    b0, nb = _select(rw, [t[0] for t in taps_w]), _select(rw, [t[1] for t in taps_w])

    def tap_rows(ta):
        """Tap (a, b) of the phase's ta-th tap and the dy rows it reads (0 where invalid)."""
        if geo.sw == 1 and geo.sh == 1:  # static tap grid: static divisors
            a, b = C.idiv(ta, geo.KW), C.imod(ta, geo.KW)
        else:
            nb_ = nb.astype(ta.dtype)  # a traced divisor; the loop index's int32 under x64 too
            a = a0 + lax.div(ta, nb_) * step_h
            b = b0 + lax.rem(ta, nb_) * step_w
        hp = h + geo.pt - a * geo.dh
        wp = w + geo.pl - b * geo.dw
        p = C.idiv(hp + off_h, geo.sh) - off_h // geo.sh
        q = C.idiv(wp + off_w, geo.sw) - off_w // geo.sw
        valid = pmask & (hp >= 0) & (p < geo.Ho) & (wp >= 0) & (q < geo.Wo)
        return a * geo.KW + b, valid, jnp.where(valid, (n * geo.Ho + p) * geo.Wo + q, 0)

    n_taps = na * nb if (geo.sh, geo.sw) != (1, 1) else geo.taps
    if geo.depthwise:
        def tap_body(ta, acc):
            t, valid, yrow = tap_rows(ta)
            for k in range(geo.Cog):  # channel multiplier: co = ci * m + k
                co = ci * geo.Cog + k
                mk = valid[:, None] & cmask[None, :]
                yt = C.load(dy_ref, (yrow[:, None], co[None, :]), mk)
                wt = C.load(w_ref, (t, co), cmask)
                acc = acc + yt * wt[None, :]
            return acc

        acc = lax.fori_loop(0, n_taps, tap_body, jnp.zeros((BM, BI), jnp.float32))
    else:
        n_cob = C.cdiv(geo.Cog, BO)

        def k_body(kk, acc):  # one flat K loop over (tap, output-channel block)
            t, valid, yrow = tap_rows(C.idiv(kk, n_cob))
            co = C.imod(kk, n_cob) * BO + jnp.arange(BO, dtype=jnp.int32)
            omask = co < geo.Cog
            cols = g * geo.Cog + co
            yt = _load(dy_ref, (yrow[:, None], cols[None, :]), valid[:, None] & omask[None, :], dt)
            wt = _load(w_ref, ((t * geo.Cig + ci)[:, None], cols[None, :]), cmask[:, None] & omask[None, :], dt)
            return acc + C.dot(yt, wt, trans_b=True)

        acc = lax.fori_loop(0, n_taps * n_cob, k_body, jnp.zeros((BM, BI), jnp.float32))
    # Masked lanes get distinct out-of-range rows: interpret mode emulates a masked store as a
    # read-select-scatter, where a masked lane aliasing a real one could write a stale value.
    xrow = jnp.where(pmask, (n * geo.H + h) * geo.W + w, geo.N * geo.H * geo.W + jnp.arange(BM, dtype=jnp.int32))
    C.store(dx_ref, (xrow[:, None], dxcols[None, :]), acc, pmask[:, None] & cmask[None, :])


def conv2d_dgrad(dy, w, geo: ConvGeometry, *, interpret: bool = False):
    """dx [N, H, W, Cin] in dy's dtype from dy [N, Ho, Wo, Cout] and w [KH, KW, Cig, Cout].

    Tiles: block_m input pixels (of one stride phase) x block_n input channels, block_k
    output channels per K step."""
    cfg = _tuning.conv("conv2d_dgrad", dy.dtype, geo.depthwise)
    BM = cfg.block_m
    if geo.depthwise:
        BI, BO = max(16, min(cfg.block_n, C.next_pow2(geo.Cin))), 1
        n_cb = C.cdiv(geo.Cin, BI)
        nw = cfg.num_warps
    else:
        BI, BO = _block(geo.Cig, cfg.block_n), _block(geo.Cog, cfg.block_k)
        n_cb = geo.groups * C.cdiv(geo.Cig, BI)
        nw = _warps(cfg, BM, BI)
    n_mb = C.cdiv(geo.N * C.cdiv(geo.H, geo.sh) * C.cdiv(geo.W, geo.sw), BM)
    kernel = functools.partial(_dgrad_kernel, geo=geo, BM=BM, BI=BI, BO=BO)
    dx = C.call(
        kernel, name="conv2d_dgrad", grid=(geo.sh * geo.sw, n_mb, n_cb),
        out_shape=jax.ShapeDtypeStruct((geo.N * geo.H * geo.W, geo.Cin), dy.dtype), interpret=interpret,
        num_warps=nw, num_stages=cfg.num_stages, flops=geo.flops,
        bytes_accessed=C.nbytes(dy) * geo.taps // (geo.sh * geo.sw) + C.nbytes(w) * n_mb
        + geo.N * geo.H * geo.W * geo.Cin * jnp.dtype(dy.dtype).itemsize,
    )(dy.reshape(-1, geo.Cout), w.reshape(geo.taps * geo.Cig, geo.Cout))
    return dx.reshape(geo.N, geo.H, geo.W, geo.Cin)
