"""Vision ops, channels last (NHWC): upsample2d, pixel_shuffle, unpatchify, conv2d.

upsample2d, pixel_shuffle and unpatchify save nothing (their backward needs only the
cotangent) and run gather-form Pallas backward kernels (``jaxbwd/pallas/vision.py``):
every input-gradient element is written once, no atomics. conv2d keeps XLA's forward
(cuDNN on GPU), saves x and w, and runs implicit-GEMM dgrad and wgrad kernels
(``jaxbwd/pallas/conv.py``).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxbwd.pallas import conv as conv_kernels
from jaxbwd.pallas import vision as kernels
from jaxbwd.vjp import _base as B
from jaxbwd.vjp._derivatives import custom_op
from jaxbwd import sharding as S

UPSAMPLE_METHODS = ("nearest", "bilinear")


# ------------------------------------------------------------------------ upsample2d
def _bilinear_matrix(n_in: int, s: int, dtype):
    """[n_in*s, n_in] interpolation matrix of half-pixel bilinear upsampling by s, edge taps
    clamped: the same weights as ``jax.image.resize(..., "bilinear")``. Built from iotas
    (not a numpy constant) so that the traced op carries no constants, which
    ``custom_partitioning`` (the Auto-axes path of jaxbwd.sharding) does not accept."""
    # output pixel o samples u = (o + 0.5) / s - 0.5 = (2o + 1 - s) / 2s: integer arithmetic
    # gives the tap i0 = floor(u) and the weight f = u - i0 exactly, then one rounding
    num = 2 * jnp.arange(n_in * s, dtype=jnp.int32) + 1 - s
    i0 = jnp.floor_divide(num, 2 * s)
    f = ((num - i0 * 2 * s).astype(dtype) / (2 * s))[:, None]
    cols = jnp.arange(n_in, dtype=jnp.int32)[None, :]
    lo, hi = jnp.clip(i0, 0, n_in - 1)[:, None], jnp.clip(i0 + 1, 0, n_in - 1)[:, None]
    return jnp.where(cols == lo, 1.0 - f, 0.0).astype(dtype) + jnp.where(cols == hi, f, 0.0).astype(dtype)


def _bilinear_apply(x, sh, sw, transpose=False):
    """Separable bilinear resampling (or its transpose, the backward) in the accumulation dtype."""
    dt = B.acc_dtype(x)
    hi = jax.lax.Precision.HIGHEST
    if transpose:
        H, W = x.shape[1] // sh, x.shape[2] // sw
    else:
        H, W = x.shape[1], x.shape[2]
    mh = _bilinear_matrix(H, sh, dt)
    mw = _bilinear_matrix(W, sw, dt)
    xf = x.astype(dt)
    if transpose:
        y = jnp.einsum("ph,npqc->nhqc", mh, xf, precision=hi)
        return jnp.einsum("qw,nhqc->nhwc", mw, y, precision=hi)
    y = jnp.einsum("ph,nhwc->npwc", mh, xf, precision=hi)
    return jnp.einsum("qw,npwc->npqc", mw, y, precision=hi)


@functools.partial(custom_op, nondiff_argnums=(1, 2, 3, 4))
def _upsample2d(x, sh, sw, bilinear, impl):
    if bilinear:
        return _bilinear_apply(x, sh, sw).astype(x.dtype)
    return jnp.repeat(jnp.repeat(x, sh, axis=1), sw, axis=2)


def _upsample2d_fwd(x, sh, sw, bilinear, impl):
    return _upsample2d.fun(x, sh, sw, bilinear, impl), None


def _upsample2d_bwd(sh, sw, bilinear, impl, res, dy):
    if impl.pallas and dy.size > 0:
        return (kernels.upsample2d_bwd(dy, sh, sw, bilinear=bilinear, interpret=impl.interpret),)
    if bilinear:
        return (_bilinear_apply(dy, sh, sw, transpose=True).astype(dy.dtype),)
    N, Ho, Wo, Cc = dy.shape
    dx = dy.astype(B.acc_dtype(dy)).reshape(N, Ho // sh, sh, Wo // sw, sw, Cc).sum(axis=(2, 4))
    return (dx.astype(dy.dtype),)


_upsample2d.defvjp(_upsample2d_fwd, _upsample2d_bwd)
_upsample2d.deftangent(lambda sh, sw, bilinear, impl, _, dx: _upsample2d.fun(dx, sh, sw, bilinear, impl))  # linear


def upsample2d(x, scale, *, method="nearest", implementation=None):
    """Upsamples images x [N, H, W, C] by integer factors.

    Args:
      x: [N, H, W, C] float32, bfloat16 or float16 (float64 on the XLA path).
      scale: int or (sh, sw), each >= 1.
      method: ``"nearest"`` (each pixel repeated sh x sw times) or ``"bilinear"``
        (half-pixel centres, edges clamped: ``jax.image.resize(x, ..., "bilinear")``).
      implementation: ``None`` (Pallas on GPU, XLA elsewhere), ``"pallas"`` or ``"xla"``.

    Returns:
      [N, H*sh, W*sw, C] in x's dtype (bilinear interpolates in float32).

    Residuals: none. Backward: a gather-form Pallas kernel: each dx pixel sums the dy
    pixels it contributed to (times their bilinear weights), in f32, written once:
    deterministic, no atomics.

    Raises:
      TypeError: x not floating; scale not ints.
      ValueError: x not rank 4, scale < 1 or not a pair, unknown method or implementation.
      Also the errors common to every op (``help(jaxbwd)``).

    Source: nearest-neighbour and bilinear upsampling as in UNet decoders (Ronneberger et
    al. 2015; Stable Diffusion's ``Upsample``); bilinear weights follow ``jax.image.resize``.
    """
    op = "upsample2d"
    B.check_float(op, "x", x)
    B.check_ndim(op, "x", x, ndim=4, what="([N, H, W, C])")
    sh, sw = B.static_int_pair(op, "scale", scale, minimum=1)
    if method not in UPSAMPLE_METHODS:
        raise ValueError(f"jaxbwd.{op}: method must be 'nearest' or 'bilinear', got {method!r}")
    impl = B.impl(implementation, op, x)
    return S.partitioned("nHWC->nPQC", lambda x: _upsample2d(x, sh, sw, method == "bilinear", impl), x)


# --------------------------------------------------------------------- pixel_shuffle
def _shuffle(x, r):
    N, H, W, Cr = x.shape
    y = x.reshape(N, H, W, Cr // (r * r), r, r).transpose(0, 1, 4, 2, 5, 3)
    return y.reshape(N, H * r, W * r, Cr // (r * r))


def _unshuffle(dy, r):
    N, Hr, Wr, Cc = dy.shape
    y = dy.reshape(N, Hr // r, r, Wr // r, r, Cc).transpose(0, 1, 3, 5, 2, 4)
    return y.reshape(N, Hr // r, Wr // r, Cc * r * r)


@functools.partial(custom_op, nondiff_argnums=(1, 2))
def _pixel_shuffle(x, r, impl):
    return _shuffle(x, r)


def _pixel_shuffle_bwd(r, impl, res, dy):
    if impl.pallas and dy.size > 0:
        return (kernels.pixel_shuffle_bwd(dy, r, interpret=impl.interpret),)
    return (_unshuffle(dy, r),)


_pixel_shuffle.defvjp(lambda x, r, impl: (_shuffle(x, r), None), _pixel_shuffle_bwd)
_pixel_shuffle.deftangent(lambda r, impl, _, dx: _shuffle(dx, r))  # linear


def pixel_shuffle(x, upscale_factor, *, implementation=None):
    """Sub-pixel shuffle (depth to space), torch.nn.PixelShuffle carried to NHWC.

    ``out[n, h*r+i, w*r+j, c] = x[n, h, w, c*r*r + i*r + j]``.

    Args:
      x: [N, H, W, C*r*r] float32, bfloat16 or float16 (float64 on the XLA path).
      upscale_factor: r, a positive Python int; x's channel count must be divisible by r*r.
      implementation: ``None`` (Pallas on GPU, XLA elsewhere), ``"pallas"`` or ``"xla"``.

    Returns:
      [N, H*r, W*r, C] in x's dtype.

    Residuals: none. Backward: pixel_unshuffle of dy as a Pallas gather kernel (one read,
    one write per element).

    Raises:
      TypeError: x not floating; upscale_factor not an int.
      ValueError: x not rank 4, upscale_factor < 1, channels not divisible by r*r.
      Also the errors common to every op (``help(jaxbwd)``).

    Source: Shi et al., "Real-Time Single Image and Video Super-Resolution Using an
    Efficient Sub-Pixel Convolutional Neural Network" (CVPR 2016).
    """
    op = "pixel_shuffle"
    B.check_float(op, "x", x)
    B.check_ndim(op, "x", x, ndim=4, what="([N, H, W, C*r*r])")
    r = B.static_int(op, "upscale_factor", upscale_factor, minimum=1)
    if x.shape[-1] % (r * r):
        raise ValueError(
            f"jaxbwd.{op}: x's channel count must be divisible by upscale_factor**2={r * r}, got {x.shape[-1]}"
        )
    impl = B.impl(implementation, op, x)
    return S.partitioned("nHWC->nPQD", lambda x: _pixel_shuffle(x, r, impl), x)


# ------------------------------------------------------------------------ unpatchify
def _unpatchify(tokens, gh, gw, p, Cc):
    N = tokens.shape[0]
    y = tokens.reshape(N, gh, gw, p, p, Cc).transpose(0, 1, 3, 2, 4, 5)
    return y.reshape(N, gh * p, gw * p, Cc)


def _patchify(dy, gh, gw, p, Cc):
    N = dy.shape[0]
    y = dy.reshape(N, gh, p, gw, p, Cc).transpose(0, 1, 3, 2, 4, 5)
    return y.reshape(N, gh * gw, p * p * Cc)


@functools.partial(custom_op, nondiff_argnums=(1, 2, 3, 4, 5), name="unpatchify")
def _unpatchify_op(tokens, gh, gw, p, Cc, impl):
    return _unpatchify(tokens, gh, gw, p, Cc)


def _unpatchify_bwd(gh, gw, p, Cc, impl, res, dy):
    if impl.pallas and dy.size > 0:
        return (kernels.unpatchify_bwd(dy, gh, gw, p, interpret=impl.interpret),)
    return (_patchify(dy, gh, gw, p, Cc),)


_unpatchify_op.defvjp(lambda t, gh, gw, p, Cc, impl: (_unpatchify(t, gh, gw, p, Cc), None), _unpatchify_bwd)
_unpatchify_op.deftangent(lambda gh, gw, p, Cc, impl, _, dt: _unpatchify(dt, gh, gw, p, Cc))  # linear


def unpatchify(tokens, *, grid, patch_size, channels, implementation=None):
    """Patch tokens back to an image (DiT/MAE order), the inverse of ViT patchification.

    ``out[n, gi*p+i, gj*p+j, c] = tokens[n, gi*gw+gj, (i*p+j)*C + c]``.

    Args:
      tokens: [N, gh*gw, p*p*C] float32, bfloat16 or float16 (float64 on the XLA path).
      grid: gh (square) or (gh, gw), patches per column and per row.
      patch_size: p, a positive int. channels: C, a positive int.
      implementation: ``None`` (Pallas on GPU, XLA elsewhere), ``"pallas"`` or ``"xla"``.

    Returns:
      [N, gh*p, gw*p, C] in tokens' dtype.

    Residuals: none. Backward: patchify of dy as a Pallas gather kernel (one read, one
    write per element).

    Raises:
      TypeError: tokens not floating; grid, patch_size or channels not ints.
      ValueError: tokens not rank 3, tokens.shape[1] != gh*gw, tokens.shape[2] != p*p*C,
        non-positive sizes.
      Also the errors common to every op (``help(jaxbwd)``).

    Source: Peebles & Xie, "Scalable Diffusion Models with Transformers" (DiT, ICCV 2023),
    ``unpatchify``; He et al., "Masked Autoencoders" (2022).
    """
    op = "unpatchify"
    B.check_float(op, "tokens", tokens)
    B.check_ndim(op, "tokens", tokens, ndim=3, what="([N, gh*gw, p*p*C])")
    gh, gw = B.static_int_pair(op, "grid", grid, minimum=1)
    p = B.static_int(op, "patch_size", patch_size, minimum=1)
    Cc = B.static_int(op, "channels", channels, minimum=1)
    if tokens.shape[1] != gh * gw:
        raise ValueError(
            f"jaxbwd.{op}: tokens.shape[1] must equal gh*gw={gh * gw} for grid={(gh, gw)}, got {tokens.shape[1]}"
        )
    if tokens.shape[2] != p * p * Cc:
        raise ValueError(
            f"jaxbwd.{op}: tokens.shape[2] must equal patch_size**2 * channels={p * p * Cc}, got {tokens.shape[2]}"
        )
    impl = B.impl(implementation, op, tokens)
    return S.partitioned("nTK->nPQC", lambda t: _unpatchify_op(t, gh, gw, p, Cc, impl), tokens)



# ---------------------------------------------------------------------------- conv2d
_DN = ("NHWC", "HWIO", "NHWC")


def _conv_forward(x, w, geo: conv_kernels.ConvGeometry, dt):
    """XLA's convolution (cuDNN on GPU) with ``dt`` accumulation, result in dtype dt."""
    return jax.lax.conv_general_dilated(
        x, w, window_strides=(geo.sh, geo.sw), padding=((geo.pt, geo.pb), (geo.pl, geo.pr)),
        rhs_dilation=(geo.dh, geo.dw), dimension_numbers=_DN, feature_group_count=geo.groups,
        preferred_element_type=dt, precision=jax.lax.Precision.HIGHEST,
    )


def _conv_xla(x, w, geo: conv_kernels.ConvGeometry):
    """lax's convolution in the inputs' dtype at the default precision (for its transposes)."""
    return jax.lax.conv_general_dilated(
        x, w, window_strides=(geo.sh, geo.sw), padding=((geo.pt, geo.pb), (geo.pl, geo.pr)),
        rhs_dilation=(geo.dh, geo.dw), dimension_numbers=_DN, feature_group_count=geo.groups,
    )


@functools.partial(custom_op, nondiff_argnums=(2, 3))
def _conv2d(x, w, geo, impl):
    return _conv_forward(x, w, geo, B.acc_dtype(x, w)).astype(x.dtype)


def _conv2d_fwd(x, w, geo, impl):
    return _conv2d.fun(x, w, geo, impl), (x, w)


def _conv2d_bwd(geo, impl, res, dy):
    x, w = res
    dy = dy.astype(x.dtype)
    if impl.pallas and x.size > 0 and dy.size > 0:
        dx = conv_kernels.conv2d_dgrad(dy, w, geo, interpret=impl.interpret)
        dw = conv_kernels.conv2d_wgrad(x, dy, geo, interpret=impl.interpret)
        return dx, dw.astype(w.dtype)
    # XLA: lax's transposed convolutions (cuDNN's dgrad / wgrad on GPU) on the inputs as
    # they are, so that 16-bit inputs run 16-bit tensor-core convolutions: cuDNN accumulates
    # 16-bit convolutions in f32 and rounds each gradient once to the input dtype, as the
    # kernels do. f32 follows jax.default_matmul_precision like the kernels' dots (TF32 by
    # default, 3xTF32/f32 under "highest"). lax's transpose rules keep the forward's
    # preferred_element_type, so a forward with an f32 result would turn both backward
    # convolutions into f32 ones: the primal here has none.
    _, vjp = jax.vjp(lambda a, b: _conv_xla(a, b, geo), x, w)
    dx, dw = vjp(dy)
    return dx.astype(x.dtype), dw.astype(w.dtype)


_conv2d.defvjp(_conv2d_fwd, _conv2d_bwd)
# Bilinear: d conv(x, w) = conv(dx, w) + conv(x, dw).
_conv2d.deftangent(lambda geo, impl, res, dx, dw: _conv2d.fun(dx, res[1], geo, impl) + _conv2d.fun(res[0], dw, geo, impl))


def _conv_padding(op, padding, H, W, eff_h, eff_w, sh, sw):
    """padding (int, pair, ((t, b), (l, r)), "SAME", "VALID"; NumPy integer arrays too) -> ((t, b), (l, r))."""
    if isinstance(padding, np.ndarray) and np.issubdtype(padding.dtype, np.integer):
        padding = padding.tolist()  # 0-d: an int; 1-d: a pair; 2-d: pairs
    if isinstance(padding, str):
        if padding.upper() not in ("SAME", "VALID"):
            raise ValueError(f"jaxbwd.{op}: padding must be 'SAME', 'VALID', an int or pairs of ints, got {padding!r}")
        pads = jax.lax.padtype_to_pads((H, W), (eff_h, eff_w), (sh, sw), padding.upper())
        return tuple((int(lo), int(hi)) for lo, hi in pads)
    if isinstance(padding, (tuple, list)) and len(padding) == 2:
        if all(isinstance(p, (tuple, list)) for p in padding):
            if not all(len(p) == 2 for p in padding):
                raise ValueError(f"jaxbwd.{op}: padding must be ((top, bottom), (left, right)), got {padding!r}")
            pads = tuple(tuple(B.static_int(op, "padding", v, minimum=0) for v in p) for p in padding)
            return pads
        ph, pw = B.static_int_pair(op, "padding", padding, minimum=0)
        return ((ph, ph), (pw, pw))
    if isinstance(padding, (tuple, list)):
        raise ValueError(f"jaxbwd.{op}: padding must be an int, a pair, ((top, bottom), (left, right)), 'SAME' or 'VALID', got {padding!r}")
    p = B.static_int(op, "padding", padding, minimum=0)
    return ((p, p), (p, p))


def conv2d(x, w, *, stride=1, padding=0, dilation=1, groups=1, implementation=None):
    """2-D convolution (cross-correlation), images NHWC and weights HWIO, as ``flax.linen.Conv``.

    ``y[n, p, q, co] = sum_{a, b, ci} x[n, p*sh - pt + a*dh, q*sw - pl + b*dw, g*Cin/G + ci]
    * w[a, b, ci, co]`` with g = co // (Cout/G), zero padding outside the image.

    Args:
      x: [N, H, W, Cin] float32, bfloat16 or float16 (float64 on the XLA path).
      w: [kh, kw, Cin/groups, Cout], x's dtype.
      stride, dilation: int or (sh, sw) / (dh, dw), each >= 1.
      padding: int, (ph, pw), ((top, bottom), (left, right)), "SAME" or "VALID" (as lax),
        non-negative.
      groups: feature groups G dividing Cin and Cout; G == Cin is depthwise.
      implementation: ``None`` (Pallas on GPU, XLA elsewhere), ``"pallas"`` or ``"xla"``.

    Returns:
      [N, Ho, Wo, Cout] in x's dtype, accumulated in f32. The forward is XLA's convolution
      (cuDNN on GPU).

    Residuals: x and w only.

    Backward (Pallas): two implicit-GEMM kernels that never write an im2col buffer:
    ``conv2d_dgrad`` (dx, the transposed convolution of dy with w; stride handled by
    skipping the taps that cannot reach a stride phase, not by dilating dy with zeros) and
    ``conv2d_wgrad`` (dw, reduction over N*Ho*Wo in f32 partials summed in a fixed order:
    deterministic). Grouped and depthwise convolutions are handled in both kernels.

    Raises:
      TypeError: x or w not floating or of different dtypes; stride, dilation, padding or
        groups not ints.
      ValueError: x or w not rank 4; w.shape[2] != Cin/groups; groups not dividing Cin and
        Cout; non-positive stride/dilation/groups; negative padding; a padded x smaller
        than the dilated kernel (no output position). (N = 0 or Cout = 0 give an empty
        result.)
      Also the errors common to every op (``help(jaxbwd)``).

    Source: implicit GEMM as in cuDNN (Chetlur et al., "cuDNN: Efficient Primitives for
    Deep Learning", 2014) and NVIDIA CUTLASS's implicit-GEMM convolutions (Fprop, Dgrad,
    Wgrad; strided dgrad).
    """
    op = "conv2d"
    B.check_float(op, "x", x)
    B.check_float(op, "w", w)
    B.check_ndim(op, "x", x, ndim=4, what="([N, H, W, Cin])")
    B.check_ndim(op, "w", w, ndim=4, what="([kh, kw, Cin/groups, Cout])")
    for a, what in ((0, "kernel height kh"), (1, "kernel width kw"), (2, "input channel axis")):
        B.check_nonempty_axis(op, "w", w, a, what)
    B.check_same_dtype(op, ("x", "w"), (x, w))
    G = B.static_int(op, "groups", groups, minimum=1)
    N, H, W, Cin = x.shape
    KH, KW, Cig, Cout = w.shape
    if Cin % G:
        raise ValueError(f"jaxbwd.{op}: groups must divide x's channel count Cin={Cin}, got groups={G}")
    if Cig != Cin // G:
        raise ValueError(
            f"jaxbwd.{op}: w must have shape [kh, kw, Cin/groups={Cin // G}, Cout], got {tuple(w.shape)}"
        )
    if Cout % G:
        raise ValueError(f"jaxbwd.{op}: groups must divide w's output channels Cout={Cout}, got groups={G}")
    sh, sw = B.static_int_pair(op, "stride", stride, minimum=1)
    dh, dw = B.static_int_pair(op, "dilation", dilation, minimum=1)
    eff_h, eff_w = dh * (KH - 1) + 1, dw * (KW - 1) + 1
    (pt, pb), (pl, pr) = _conv_padding(op, padding, H, W, eff_h, eff_w, sh, sw)
    Ho = (H + pt + pb - eff_h) // sh + 1
    Wo = (W + pl + pr - eff_w) // sw + 1
    if H + pt + pb < eff_h or W + pl + pr < eff_w:
        raise ValueError(
            f"jaxbwd.{op}: x's padded size must be at least the dilated kernel size {(eff_h, eff_w)}, "
            f"got {(H + pt + pb, W + pl + pr)}"
        )
    geo = conv_kernels.ConvGeometry(N, H, W, Cin, Ho, Wo, Cout, KH, KW, sh, sw, dh, dw, pt, pl, G, pb, pr)
    impl = B.impl(implementation, op, x, w)
    # Samples split freely (weights replicated, dw partials summed); the spatial halo and
    # the channel contraction need whole images, so those dims are gathered if sharded.
    # The geometry is per shard: N is the local batch under shard_map.
    return S.partitioned("nHWC,KLIO->nPQO",
                         lambda x, w: _conv2d(x, w, dataclasses.replace(geo, N=x.shape[0]), impl), x, w)
