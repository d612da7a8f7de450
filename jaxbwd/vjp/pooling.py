"""max_pool2d, avg_pool2d and adaptive_avg_pool2d (NHWC), with deterministic gather-form backwards.

The windowed pools follow ``flax.linen.max_pool`` / ``avg_pool``: ``window_shape``
(kh, kw), ``strides`` (default 1), ``padding`` ``"VALID"``, ``"SAME"`` or ((lo, hi), (lo,
hi)); max pooling pads with -inf, average pooling with zeros (``count_include_pad``
as flax). Window offsets ``d = (di, dj)`` are visited in row-major order.

Backward, gather form (no scatter, no atomics, bitwise reproducible). max_pool2d: the
forward saves, per output element, the row-major offset of the window element it selected
(int8), not x or y; ties go to the first maximal element in row-major order (what XLA's
``select_and_scatter`` selects). The Pallas kernel ``max_pool2d_bwd``
(``jaxbwd/pallas/pooling.py``) writes each dx element once from the candidate windows'
offsets and dy; the XLA formula places ``dy`` (where the offset is d) at the input
positions ``o * s + d`` with an interior-padded ``lax.pad`` and adds the kh*kw
placements, which XLA fuses into one pass. avg_pool2d: the same placement of
``dy / count`` with nothing saved; an XLA fusion that reads dy and writes dx, the minimum,
so no kernel. adaptive_avg_pool2d: two small averaging matrices applied by ``einsum``
(XLA dots); its backward is their transposes.
"""
from __future__ import annotations

import functools
import operator

import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxbwd import sharding as S
from jaxbwd.pallas import pooling as kernels
from jaxbwd.vjp import _base as B
from jaxbwd.vjp._derivatives import custom_op


def _cf(x):
    return x.astype(jnp.float64 if x.dtype == jnp.float64 else jnp.float32)


def _pair(op, name, v, default=None):
    if v is None:
        return default
    return B.static_int_pair(op, name, v, minimum=1)


def _index(v) -> int:
    if isinstance(v, (bool, np.bool_)) or getattr(v, "dtype", None) == np.bool_:
        raise TypeError(v)
    return operator.index(v)


def _pads(op, padding, hw, window, strides):
    if isinstance(padding, str):
        if padding.upper() not in ("SAME", "VALID"):
            raise ValueError(f"jaxbwd.{op}: padding must be 'SAME', 'VALID' or ((lo, hi), (lo, hi)), got {padding!r}")
        return tuple(tuple(p) for p in lax.padtype_to_pads(hw, window, strides, padding.upper()))
    what = (f"jaxbwd.{op}: padding must be 'SAME', 'VALID' or ((lo, hi), (lo, hi)) with non-negative "
            f"ints, got {padding!r}")
    try:
        pairs = [tuple(p) for p in padding]
    except TypeError:
        pairs = []
    if len(pairs) != 2 or any(len(p) != 2 for p in pairs):
        raise ValueError(what)
    try:  # ints, NumPy ints or concrete integer scalars; not floats (1.7 is not 1) nor bools
        pads = tuple(tuple(_index(v) for v in p) for p in pairs)
    except TypeError:
        raise TypeError(what) from None
    if any(v < 0 for p in pads for v in p):
        raise ValueError(what)
    return pads


def _geometry(op, x, window_shape, strides, padding):
    B.check_float(op, "x", x)
    B.check_ndim(op, "x", x, ndim=4, what="([N, H, W, C])")
    window = B.static_int_pair(op, "window_shape", window_shape, minimum=1)
    strides = _pair(op, "strides", strides, (1, 1))
    pads = _pads(op, padding, x.shape[1:3], window, strides)
    out = tuple((x.shape[1 + i] + sum(pads[i]) - window[i]) // strides[i] + 1 for i in range(2))
    if min(out) < 1:
        raise ValueError(f"jaxbwd.{op}: window_shape {window} is larger than the padded input "
                         f"{tuple(x.shape[1 + i] + sum(pads[i]) for i in range(2))}")
    return window, strides, pads, out, tuple(x.shape[1:3])


def _taps(xp, window, strides, out):
    """(d, xp[:, d + o*s, :]) for every window offset d in row-major order."""
    for di in range(window[0]):
        for dj in range(window[1]):
            yield (di, dj), lax.slice(
                xp, (0, di, dj, 0),
                (xp.shape[0], di + strides[0] * (out[0] - 1) + 1, dj + strides[1] * (out[1] - 1) + 1, xp.shape[3]),
                (1, strides[0], strides[1], 1))


def _place(v, d, strides, padded_hw):
    """v [N, Ho, Wo, C] at positions o*s + d of a zero [N, Hp, Wp, C] array (interior padding)."""
    cfg = [(0, 0, 0)]
    for i in range(2):
        span = d[i] + strides[i] * (v.shape[1 + i] - 1) + 1
        cfg.append((d[i], padded_hw[i] - span, strides[i] - 1))
    return lax.pad(v, jnp.zeros((), v.dtype), cfg + [(0, 0, 0)])


def _crop(xp, pads, hw):
    return xp[:, pads[0][0]:pads[0][0] + hw[0], pads[1][0]:pads[1][0] + hw[1], :]


def _pad(x, pads, value):
    return lax.pad(x, jnp.asarray(value, x.dtype), [(0, 0, 0), (*pads[0], 0), (*pads[1], 0), (0, 0, 0)])


# ---------------------------------------------------------------------------- max_pool2d
@functools.partial(custom_op, nondiff_argnums=(1, 2), name="max_pool2d")
def _max_pool(x, geom, impl):
    window, strides, pads, out, hw = geom
    xp = _pad(x, pads, -jnp.inf)
    y = None
    for _, v in _taps(xp, window, strides, out):
        y = v if y is None else jnp.maximum(y, v)
    return y


def _max_fwd(x, geom, impl):
    y = _max_pool.fun(x, geom, impl)
    return y, _selected(x, geom)


def _selected(x, geom):
    """The row-major offset of each window's first maximal element, [N, Ho, Wo, C] (int8 for
    windows of up to 127 elements, else int32); with NaNs in a window, the element XLA's
    ``select_and_scatter`` (jax's autodiff of ``lax.reduce_window`` max) selects."""
    window, strides, pads, out, hw = geom
    dt = jnp.int8 if window[0] * window[1] <= 127 else jnp.int32
    taps = [v for _, v in _taps(_pad(x, pads, -jnp.inf), window, strides, out)]
    sel, cur = jnp.zeros(taps[0].shape, dt), taps[0]
    for k, v in enumerate(taps[1:], start=1):
        # XLA's select_and_scatter rule: move to v unless cur >= v. Without NaNs that is the
        # first maximum; a NaN is taken when reached and left for the element after it.
        take = ~(cur >= v)
        sel, cur = jnp.where(take, jnp.asarray(k, dt), sel), jnp.where(take, v, cur)
    return sel


def _max_bwd(geom, impl, sel, dy):
    window, strides, pads, out, hw = geom
    if impl.pallas:
        return (kernels.max_pool2d_bwd(sel, dy, in_hw=hw, window=window, strides=strides,
                                       pad_lo=(pads[0][0], pads[1][0]), interpret=impl.interpret),)
    padded = tuple(hw[i] + sum(pads[i]) for i in range(2))
    acc = jnp.zeros((dy.shape[0], *padded, dy.shape[3]), B.acc_dtype(dy))
    for k, d in enumerate(np.ndindex(*window)):
        acc = acc + _place(jnp.where(sel == k, _cf(dy), 0.0), d, strides, padded)
    return (_crop(acc, pads, hw).astype(dy.dtype),)


def _max_tangent(geom, impl, sel, dx):
    window, strides, pads, out, hw = geom
    t = jnp.zeros(sel.shape, dx.dtype)
    for k, (_, v) in enumerate(_taps(_pad(dx, pads, 0.0), window, strides, out)):
        t = jnp.where(sel == k, v, t)
    return t


_max_pool.defvjp(_max_fwd, _max_bwd)
_max_pool.deftangent(_max_tangent)


def max_pool2d(x, window_shape, strides=None, padding="VALID", *, implementation=None):
    """Max pooling over NHWC windows, as ``flax.linen.max_pool`` on 4-D inputs.

    Args:
      x: [N, H, W, C] float32, bfloat16 or float16 (float64 on the XLA path).
      window_shape: int or (kh, kw). strides: None (1), int or (sh, sw).
      padding: ``"VALID"``, ``"SAME"`` or ((top, bottom), (left, right)); padded cells are -inf.
      implementation: ``None`` (Pallas on GPU, XLA elsewhere), ``"pallas"`` or ``"xla"``.

    Returns:
      [N, Ho, Wo, C] in x's dtype, ``Ho = (H + pads - kh) // sh + 1``.

    Residuals: the selected offset per output element (int8 for windows up to 127
    elements; int32 beyond). Backward: Pallas ``max_pool2d_bwd`` or the XLA formula, both
    gather form (module docstring); ties go to the first maximal element of the window in
    row-major order, as XLA's own gradient, which it also follows in windows with NaNs.

    Raises:
      TypeError: x not floating; window_shape, strides or padding amounts not ints.
      ValueError: x not rank 4; window_shape/strides not one int or two, or below 1; bad
      padding; a window larger than the padded input; unknown implementation.
      Also the errors common to every op (``help(jaxbwd)``).

    Source: max pooling as in ``flax.linen.max_pool`` / ``lax.reduce_window``.
    """
    op = "max_pool2d"
    geom = _geometry(op, x, window_shape, strides, padding)
    impl = B.impl(implementation, op, x)
    # Windows never cross samples or channels: those may stay sharded.
    return S.partitioned("nHWc->nPQc", lambda x: _max_pool(x, geom, impl), x)


# ---------------------------------------------------------------------------- avg_pool2d
@functools.partial(custom_op, nondiff_argnums=(1, 2, 3), name="avg_pool2d")
def _avg_pool(x, geom, count_include_pad, impl):
    window, strides, pads, out, hw = geom
    s = None
    for _, v in _taps(_pad(_cf(x), pads, 0.0), window, strides, out):
        s = v if s is None else s + v
    return (s / _counts(geom, count_include_pad)).astype(x.dtype)


def _counts(geom, count_include_pad):
    """Elements per window: kh*kw, or (count_include_pad=False) the unpadded ones, [1, Ho, Wo, 1]."""
    window, strides, pads, out, hw = geom
    if count_include_pad:
        return float(window[0] * window[1])
    ones = np.zeros((1, hw[0] + sum(pads[0]), hw[1] + sum(pads[1]), 1), np.float32)
    ones[:, pads[0][0]:pads[0][0] + hw[0], pads[1][0]:pads[1][0] + hw[1]] = 1
    c = sum(ones[:, di:di + strides[0] * (out[0] - 1) + 1:strides[0], dj:dj + strides[1] * (out[1] - 1) + 1:strides[1]]
            for di in range(window[0]) for dj in range(window[1]))
    return np.maximum(c, 1.0)  # a constant: numpy, folded into the program


def _avg_fwd(x, geom, count_include_pad, impl):
    return _avg_pool.fun(x, geom, count_include_pad, impl), None


def _avg_spread(dy, geom, count_include_pad):
    window, strides, pads, out, hw = geom
    padded = tuple(hw[i] + sum(pads[i]) for i in range(2))
    g = _cf(dy) / _counts(geom, count_include_pad)
    acc = None
    for d in np.ndindex(*window):
        p = _place(g, d, strides, padded)
        acc = p if acc is None else acc + p
    return _crop(acc, pads, hw).astype(dy.dtype)


def _avg_bwd(geom, count_include_pad, impl, res, dy):
    return (_avg_spread(dy, geom, count_include_pad),)


def _avg_tangent(geom, count_include_pad, impl, res, dx):
    return _avg_pool.fun(dx, geom, count_include_pad, impl)


_avg_pool.defvjp(_avg_fwd, _avg_bwd)
_avg_pool.deftangent(_avg_tangent)


def avg_pool2d(x, window_shape, strides=None, padding="VALID", count_include_pad=True, *, implementation=None):
    """Average pooling over NHWC windows, as ``flax.linen.avg_pool`` on 4-D inputs.

    Args:
      x: [N, H, W, C] float32, bfloat16 or float16 (float64 on the XLA path).
      window_shape, strides, padding: as :func:`max_pool2d` (padded cells are zeros).
      count_include_pad: static bool; True divides by kh*kw (flax's default), False by the
        number of unpadded cells in each window.
      implementation: accepted for uniformity; both run the XLA gather-form backward.

    Returns:
      [N, Ho, Wo, C] in x's dtype, computed in float32 (float64 for float64 x). With
      ``count_include_pad=False``, a window of padding only (padding at least the window)
      averages to 0, where flax's 0 / 0 gives NaN.

    Residuals: none (the backward needs only shapes). Backward: dy / count spread over
    each window in gather form (module docstring).

    Raises:
      TypeError: x not floating; count_include_pad not a bool. ValueError: as max_pool2d.
      Also the errors common to every op (``help(jaxbwd)``).

    Source: average pooling as in ``flax.linen.avg_pool``.
    """
    op = "avg_pool2d"
    geom = _geometry(op, x, window_shape, strides, padding)
    if not isinstance(count_include_pad, (bool, np.bool_)):
        raise TypeError(f"jaxbwd.{op}: count_include_pad must be a Python bool, got {count_include_pad!r}")
    # no kernels: float64 runs under any implementation
    return _avg_pool(x, geom, bool(count_include_pad), B.impl(implementation, op))


# ------------------------------------------------------------------- adaptive_avg_pool2d
def _bins(n_in: int, n_out: int) -> np.ndarray:
    """[n_out, n_in] averaging matrix: bin i covers [floor(i n_in / n_out), ceil((i+1) n_in / n_out))."""
    m = np.zeros((n_out, n_in), np.float64)  # cast to the compute dtype at use: exact 1/n in float64
    for i in range(n_out):
        lo, hi = (i * n_in) // n_out, -(-((i + 1) * n_in) // n_out)
        m[i, lo:hi] = 1.0 / (hi - lo)
    return m


def adaptive_avg_pool2d(x, output_size, *, implementation=None):
    """Adaptive average pooling to a fixed output size (torch's ``AdaptiveAvgPool2d`` bins), NHWC.

    Args:
      x: [N, H, W, C] floating. output_size: int or (oh, ow), each >= 1.
      implementation: accepted for uniformity; XLA by design (see Backward).

    Returns:
      [N, oh, ow, C] in x's dtype, computed in float32 (float64 for float64 x). Output row
      i averages input rows ``floor(i H / oh)`` to ``ceil((i + 1) H / oh) - 1`` (likewise
      for columns).

    Residuals: the two constant averaging matrices ([oh, H] and [ow, W], in the compute
    dtype) and, at some shapes, a small partial product that XLA's contraction order of the
    einsum keeps (autodiff of the einsum). Backward: ``dx = A_h^T dy A_w``, XLA dots:
    linear, deterministic, and with windows that may overlap and differ in size a kernel
    would not beat two small GEMMs.

    Raises:
      TypeError: x not floating; output_size not ints. ValueError: x not rank 4; no
      output_size; output_size not one int or two, or below 1.
      Also the errors common to every op (``help(jaxbwd)``).

    Source: PyTorch's ``AdaptiveAvgPool2d`` bin convention; ``output_size=1`` is global
    average pooling.
    """
    op = "adaptive_avg_pool2d"
    B.check_float(op, "x", x)
    B.check_ndim(op, "x", x, ndim=4, what="([N, H, W, C])")
    if output_size is None:
        raise ValueError(f"jaxbwd.{op}: output_size must be an int >= 1 or a pair of them, got None")
    oh, ow = _pair(op, "output_size", output_size)
    B.check_nonempty_axis(op, "x", x, 1, "height H")
    B.check_nonempty_axis(op, "x", x, 2, "width W")
    B.impl(implementation, op)  # checks the name; no kernels: float64 runs under any choice
    ah, aw = _bins(x.shape[1], oh), _bins(x.shape[2], ow)
    cf = B.acc_dtype(x)
    y = jnp.einsum("ih,nhwc,jw->nijc", ah.astype(cf), x.astype(cf), aw.astype(cf),
                   precision=lax.Precision.HIGHEST)
    return y.astype(x.dtype)
