"""Shared mechanics of jaxbwd's Pallas kernels: tiling, masked tiles, launch, lowering.

Everything that depends on the Pallas backend or the JAX version lives here, so the
kernel files hold only kernel math. jaxbwd's kernels use Pallas's Triton backend
(``jax.experimental.pallas.triton``). From jax 0.11 that backend is deprecated in
favour of Mosaic GPU; it is still the one that lowers the same source on jax 0.10.2
through 0.12.x, so jaxbwd keeps using it, shows JAX's deprecation warning once per
process instead of once per kernel, and keeps backend-specific code (loads, stores,
compiler parameters) in this file so that a Mosaic GPU variant can sit beside it.
"""
from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import enum
import functools
import inspect
import math
import threading
import types
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxbwd import sharding as S

# Pallas's interpreter imports jax._src.pallas.fuser the first time it lowers a kernel
# (jax 0.12), and that import registers a JAX setting (``pallas_fuser_disable_nested_fuse``)
# that is part of every jit cache key made after it: the second call of any jitted function
# (an op called eagerly, a user's training step) then missed its cache and compiled again.
# Importing it with jaxbwd registers the setting before any such key is made.
try:
    import jax._src.pallas.fuser  # noqa: F401
except ImportError:  # a jax without it registers no such setting
    pass

# JAX warns at every Triton lowering; one notice per process is enough.
warnings.filterwarnings(
    "once", message=r".*Pallas Triton backend is deprecated.*", category=DeprecationWarning
)

# Largest tile (elements) one program holds per operand: 8192 f32 values over up to
# 8 warps is 32 registers per thread per operand, which leaves room for x, dy and w.
MAX_TILE = 8192
GPU_DEVICE_KIND = "NVIDIA H200"
GPU_NUM_CORES = 132


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def least_padded_pow2(n: int, cap: int, floor: int = 32) -> int:
    """The power-of-two block in [min(floor, next_pow2(n)), cap] that pads ``n`` least
    (ties: the larger block). 640 channels take 128-wide blocks (five, no masked lanes)
    instead of one 1024-wide block with 384 masked lanes; ``floor`` keeps rows of at least
    32 elements so loads stay coalesced."""
    hi = min(next_pow2(n), cap)
    b, best = hi, hi
    while b >= min(floor, hi):
        if cdiv(n, b) * b < cdiv(n, best) * best:
            best = b
        b //= 2
    return best


@dataclasses.dataclass(frozen=True)
class RowTiling:
    """How a [rows, cols] problem is cut into power-of-two tiles.

    ``block_cols`` covers the whole row when it fits in ``MAX_TILE`` (one pass over the
    data); otherwise the kernel loops over ``num_col_blocks`` column chunks.
    """

    n_rows: int
    n_cols: int
    block_rows: int
    block_cols: int
    num_warps: int

    @property
    def num_col_blocks(self) -> int:
        return cdiv(self.n_cols, self.block_cols)

    @property
    def num_row_blocks(self) -> int:
        return cdiv(self.n_rows, self.block_rows)


def row_tiling(n_rows: int, n_cols: int, *, max_tile: int = MAX_TILE, max_block_rows: int = 64,
               per_thread: int = 32, max_warps: int = 8, least_padded: bool = False) -> RowTiling:
    """Power-of-two tiles of at most ``max_tile`` elements, ``per_thread`` elements per
    thread (up to ``max_warps`` warps). The column block is the next power of two of the
    row (capped), or with ``least_padded`` the one that pads it least (kernels whose
    per-element work is heavy enough that masked lanes cost)."""
    block_cols = least_padded_pow2(n_cols, max_tile) if least_padded else min(next_pow2(n_cols), max_tile)
    block_rows = max(1, min(max_tile // block_cols, max_block_rows, next_pow2(n_rows)))
    tile = block_rows * block_cols
    num_warps = max(1, min(max_warps, tile // (32 * per_thread)))
    return RowTiling(n_rows, n_cols, block_rows, block_cols, num_warps)


# Kernels index with int32 (Triton's default); Pallas widens each dimension's index to int64
# before multiplying by its stride when an operand passes 4 GiB. So a kernel is safe at any
# size as long as every per-dimension index it builds stays below 2**31: kernels index 2-D
# [rows, cols] views and never form a flat element index.
MAX_DIM = 2**31 - 1


def check_index_range(op: str, *, by: str = "the kernels'", **dims: int) -> None:
    """Raises ValueError naming ``op`` if a dimension a kernel indexes exceeds int32."""
    for name, d in dims.items():
        if d > MAX_DIM:
            raise ValueError(f"jaxbwd.{op}: {name} = {d} exceeds {by} int32 index range "
                             f"(at most {MAX_DIM}); split the input")


def check_gather_range(op: str, **dims: int) -> None:
    """``check_index_range`` for an XLA-path gather (``jnp.take``) along each of ``dims``:
    while x64 is off JAX indexes in int32 and overflows inside its gather past 2**31 - 1."""
    if not jax.config.jax_enable_x64:
        check_index_range(op, by="JAX's", **dims)


def as_2d(op: str, shape: Sequence[int]) -> tuple[int, int]:
    """A [rows, cols] view of an array of ``shape`` for elementwise kernels.

    The last axis when it is wide enough to coalesce (>= 16) and within int32, else the
    largest power-of-two divisor of the size up to 1024, else (an odd size past int32
    elements) the largest divisor up to 1024 that brings the rows within int32; both extents
    within int32 (``check_index_range``: a prime size past int32 has no such view).
    """
    n = math.prod(shape)
    last = shape[-1] if len(shape) else 1
    if 16 <= last <= MAX_DIM:
        rows, cols = n // last, last
    else:
        cols = 1024
        while cols > 1 and n % cols:
            cols //= 2
        if n // cols > MAX_DIM:
            cols = next((c for c in range(1024, cols, -1) if n % c == 0 and n // c <= MAX_DIM), cols)
        rows = n // cols
    check_index_range(op, rows=rows, cols=cols)
    return rows, cols


def tile_index(block_row, block_col, t: RowTiling):
    """Row and column indices and the in-bounds mask of tile (block_row, block_col)."""
    rows = block_row * t.block_rows + jnp.arange(t.block_rows, dtype=jnp.int32)
    cols = block_col * t.block_cols + jnp.arange(t.block_cols, dtype=jnp.int32)
    mask = (rows[:, None] < t.n_rows) & (cols[None, :] < t.n_cols)
    return rows, cols, mask


def load(ref, idx, mask, other=0.0, dtype=jnp.float32):
    """Masked load of ``ref.at[idx]``, out-of-bounds lanes set to ``other``, cast to ``dtype``."""
    _check_bounds("load", ref, idx, mask)
    return plgpu.load(ref.at[idx], mask=mask, other=other).astype(dtype)


def store(ref, idx, value, mask):
    _check_bounds("store", ref, idx, mask)
    plgpu.store(ref.at[idx], value.astype(ref.dtype), mask=mask)


# Instrumentation for tests (jaxbwd.testing.record_out_of_bounds): while set, ``load`` and
# ``store`` also pass ``(kind, ref shape, lanes)`` to it, ``lanes`` the number of elements
# that the mask lets through at an index outside the ref. Interpret mode indexes as NumPy does
# (negative indices wrap; gathers past the end clamp or pad, scatters there are dropped), so
# such a lane can still give a plausible answer; on a GPU it reads or writes another buffer's
# memory, or faults.
BOUNDS_REPORT: contextvars.ContextVar[Callable[[str, tuple, Any], None] | None] = contextvars.ContextVar(
    "jaxbwd_bounds_report", default=None)


def _check_bounds(kind: str, ref, idx, mask) -> None:
    report = BOUNDS_REPORT.get()
    if report is None:
        return
    idx = idx if isinstance(idx, tuple) else (idx,)
    if any(i is Ellipsis for i in idx):  # jaxbwd's kernels index with int arrays and scalars only
        return
    inside = jnp.bool_(True)
    for extent, i in zip(ref.shape, idx):
        if not isinstance(i, (slice, pl.Slice)):
            i = jnp.asarray(i)
            inside = inside & (i >= 0) & (i < extent)
    # Dims past the index are loaded whole: each index lane stands for that many elements.
    trailing = tuple(ref.shape[len(idx):])
    inside = inside.reshape(inside.shape + (1,) * len(trailing))
    outside = ~inside if mask is None else jnp.asarray(mask) & ~inside
    outside = jnp.broadcast_to(outside, jnp.broadcast_shapes(outside.shape, inside.shape[:inside.ndim - len(trailing)]
                                                             + trailing))
    report(kind, tuple(ref.shape), jnp.sum(outside.astype(jnp.int32)))


def load_tile(ref, rows, cols, mask, other=0.0):
    if jnp.issubdtype(ref.dtype, jnp.integer):  # an int8 residual (leaky_relu's branch); typed
        other = int(other)  # as the ref, so that strict dtype promotion accepts the fill
    return load(ref, (rows[:, None], cols[None, :]), mask, other)


def store_tile(ref, rows, cols, value, mask):
    store(ref, (rows[:, None], cols[None, :]), value, mask)


LOG2E = 1.4426950408889634


def exp(x):
    """``exp(x)`` for kernels, as ``exp2(x * log2(e))``.

    Triton lowers ``jnp.exp`` to libdevice ``expf``, a range reduction around MUFU.EX2 of
    about ten instructions (in the compiled SASS: one ``FFMA.RM`` per call site, the column
    ``expf`` of ``python -m jaxbwd compile``); ``exp2`` costs one multiply and the
    ``MUFU.EX2`` itself. Relative error about 2**-22 (PTX ``ex2.approx``) against expf's
    1 ulp, well inside the f32 tolerances of softmax-based gradients. Softmax-type kernels
    call :func:`exp2` instead (folding ``LOG2E`` into a scale they apply anyway, as
    attention does).
    """
    return jnp.exp2(x * LOG2E)


def exp2(x):
    """``2**x`` of an f32 array for the softmax-type kernels (attention, cross-entropy): on a
    GPU the single instruction ``ex2.approx.ftz.f32``; in interpret mode ``jnp.exp2``.

    Triton lowers ``jnp.exp2`` to PTX ``ex2.approx.f32``, which ptxas expands around the
    MUFU.EX2 with a compare and two predicated multiplies so that results below 2**-126 come
    out subnormal; the ``.ftz`` form is the MUFU.EX2 alone (what FlashAttention's CUDA kernels
    get from nvcc's ``--use_fast_math``).
    Same precision (2**-22 relative) for every normal result; results below 2**-126
    (1.2e-38) are 0, and a subnormal ``x`` reads as 0 (2**x = 1 either way). In a softmax,
    a term that small is 2**-126 of the row's largest term (1): it leaves the row sum as it
    is, and moves its share of a gradient by at most 1.2e-38 times its cotangent (a gradient
    summed over rows, as attention's dK and dV, by that times their number). Kernels whose
    small results are themselves outputs (the sigmoid tails of SiLU and GELU) keep :func:`exp`.
    """
    return jnp.exp2(x) if _INTERPRETING.get() else _ptx_f32("ex2.approx.ftz.f32", x)


def rcp(x):
    """``1 / x`` of an f32 array for kernels: on a GPU the single instruction
    ``rcp.approx.ftz.f32`` (at most 1 ulp off; Triton's division is ``div.full.f32``, a
    reciprocal with range checks around it); in interpret mode ``1 / x``. For divisors
    whose subnormal range does not matter (subnormal ``x`` reads as 0, giving inf)."""
    return 1.0 / x if _INTERPRETING.get() else _ptx_f32("rcp.approx.ftz.f32", x)


def _ptx_f32(instruction: str, x):
    """One elementwise PTX instruction on an f32 array (GPU kernels only: interpret mode
    has no inline assembly)."""
    (y,) = plgpu.elementwise_inline_asm(f"{instruction} $0, $1;", args=[x], constraints="=f,f", pack=1,
                                        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])
    return y


def tanh_with_grad(x, scale: float = 1.0, xp=jnp):
    """``(tanh(scale * x), 1 - tanh(scale * x)**2)`` of an f32 array for kernels, from one
    :func:`exp2` and one :func:`rcp` (``scale``: a static Python float, folded into the
    exponent's multiply; ``xp=numpy`` evaluates the same formula in NumPy, for tests).

    Triton lowers ``jnp.tanh`` to libdevice ``tanhf``, which evaluates a polynomial for small
    arguments and an exponential form for large ones and selects between them, per element.
    Here only the exponential form: with ``e = 2**(2 log2(e) |scale x|)`` and
    ``r = 2 / (e + 1) = 1 - tanh|scale x|``, ``tanh = sign(scale x) (1 - r)`` and the
    derivative ``r (2 - r)``, which keeps its relative precision as tanh saturates (where
    ``1 - t * t`` from a rounded t cancels). ``e`` overflows to inf past |scale x| = 44,
    giving r = 0: tanh = +-1 and a zero derivative, as in exact arithmetic; NaN stays NaN.

    Error against float64 (checked in XLA's fused and NumPy's separate f32 roundings, with a
    correctly rounded ``exp2`` and division; ``ex2.approx`` and ``rcp.approx`` add about
    1e-7): tanh within 1.4e-7 absolute (a correctly rounded f32 tanh: 6e-8), so its relative
    error is large below |scale x| ~ 1e-3; the derivative within 1.6e-7 absolute and, up to
    |scale x| = 43, 1e-5 relative. The kernels use it for logit softcaps (``c tanh(z / c)``),
    where the logit's absolute error, ``c`` times tanh's, is what enters the softmax.
    """
    if xp is jnp:
        e = exp2(jnp.abs(x) * (2.0 * LOG2E * abs(scale)))
        r = 2.0 * rcp(e + 1.0)
    else:
        e = xp.exp2(xp.abs(x) * (2.0 * LOG2E * abs(scale)))
        r = 2.0 / (e + 1.0)
    t = 1.0 - r
    return xp.where((x < 0) if scale >= 0 else (x > 0), -t, t), r * (2.0 - r)


# erfc(z) = t * exp(-z**2 + P(t)), t = 1 / (1 + z/2), z >= 0: P's coefficients, constant first.
_ERFC_P = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806, 0.27886807, -1.13520398, 1.48851587,
           -0.82215223, 0.17087277)


def erfc(x):
    """erfc in f32 from the Chebyshev fit of Press et al., *Numerical Recipes* (2nd ed.,
    section 6.2, ``erfcc``: fractional error below 1.2e-7 in exact arithmetic).

    Triton has no erf/erfc that Pallas lowers, so kernels use this form. It is relative-
    accurate in the tail (about 1e-5 in f32 at z = 10, from rounding ``z**2``), where
    ``1 - erf(z)`` cancels to 0: GELU's ``Phi(x) = erfc(-x / sqrt(2)) / 2`` at x << 0.
    """
    z = jnp.abs(x)
    t = 1.0 / (1.0 + 0.5 * z)
    p = _ERFC_P[-1]
    for c in _ERFC_P[-2::-1]:
        p = p * t + c
    y = t * exp(p - z * z)
    return jnp.where(x < 0, 2.0 - y, y)


# pi/2 as a sum of four f32 values, the first three of 12 significant bits each, so that
# their products with a 12-bit integer are exact (Cody & Waite, "Software Manual for the
# Elementary Functions", 1980, ch. 8); the sum is pi/2 to within 2e-21.
_HALF_PI_PARTS = (1.57080078125, -4.453584551811218e-06, -8.706138032721356e-10, 6.223371969669989e-14)
_TWO_OVER_PI = 0.6366197723675814
# Minimax polynomials of sin(r)/r - 1 and cos(r) - 1 + r**2/2 in r**2 on |r| <= pi/4,
# highest power first: the coefficients of Cephes' single-precision sinf/cosf (S. L. Moshier).
_SIN_POLY = (-1.9515295891e-4, 8.3321608736e-3, -1.6666654611e-1)
_COS_POLY = (2.443315711809948e-5, -1.388731625493765e-3, 4.166664568298827e-2)


def sincos(x, xp=jnp):
    """``(sin(x), cos(x))`` of an f32 array for kernels, without libdevice.

    Triton lowers ``jnp.sin``/``jnp.cos`` to libdevice ``sinf``/``cosf``: each reduces its
    argument again, and their Payne-Hanek path for |x| > 105615 brings a 32-byte
    local-memory stack and register pressure (rope_bwd compiled for an H200: 100-109
    registers and about 1460 SASS instructions with them, 64-70 and about 810 with this,
    ``bench/results/2026-12-05-compile-rope-sincos.md``). Here one reduction serves both:
    ``x = q * pi/2 + r`` with the integer ``q`` split into 12-bit pieces so that every
    product with a part of pi/2 is exact, and a correction of ``q`` where ``x * 2/pi``
    rounded to another integer; then the two polynomials on ``|r| <= pi/4`` and the
    quadrant's swap and signs.

    ``xp=numpy`` runs the same steps in NumPy float32, each product and sum rounded on its
    own, as the compiled kernel does (its SASS has FMUL and FADD, no FFMA); XLA on CPU, and
    so interpret mode, contracts them into fused multiply-adds.

    Absolute error against float64, every float32 in [2**-13, 2**36) checked in both
    roundings (below 2**-13, sin x = x and cos x = 1 in float32): below 9.5e-8 (1.6 ulps
    near 1; CUDA documents 2 ulps for libdevice's sinf/cosf). NaN for |x| >= 2**36,
    ``inf`` and ``nan``; ``sin(-0.0)`` is -0.0. RoPE angles are ``position * inv_freq``
    with ``inv_freq <= 1``: 2**24 radians is 16.7 million positions, and past it a float32
    angle is itself an integer rounded to 2 radians or more.
    """
    ax = xp.abs(x)
    p1, p2, p3, p4 = _HALF_PI_PARTS
    q = xp.floor(ax * _TWO_OVER_PI + 0.5)
    # Past 2**24, x * 2/pi rounds to a neighbour of the right integer (3807 away at most
    # below 2**36): f below is that correction, a fourth piece of q.
    q24 = xp.floor(q * 2.0**-24) * 2.0**24
    q12 = xp.floor(q * 2.0**-12) * 2.0**12
    a, b, c = q24, q12 - q24, q - q12
    # Terms in decreasing size: the partial sum stays on a grid fine enough to hold it
    # exactly down to the terms below 2**-5, which are summed on their own and subtracted
    # once (r rounds once at its own ulp, not once per term).
    r = ((ax - a * p1) - b * p1 - a * p2) - c * p1
    f = xp.floor((r - (b + c) * p2 - q * p3) * _TWO_OVER_PI + 0.5)
    r = ((r - f * p1) - b * p2) - a * p3
    tail = (f + c) * p2 + (b + f + c) * p3 + (a + b + f + c) * p4
    r = r - tail
    # Only q mod 4 matters: c is below 4096 and |f| below 2**12, so an int32 carries c + f.
    quadrant = (c + f).astype(xp.int32)
    # NaN from 2**36, where f would soon outgrow its 12 bits: not a wrong value.
    r = xp.where(ax < 2.0**36, r, xp.nan)
    z = r * r
    sin_r = r + r * z * ((_SIN_POLY[0] * z + _SIN_POLY[1]) * z + _SIN_POLY[2])
    cos_r = 1.0 - 0.5 * z + z * z * ((_COS_POLY[0] * z + _COS_POLY[1]) * z + _COS_POLY[2])
    odd = (quadrant & 1) == 1
    sin = xp.where(odd, cos_r, sin_r)
    cos = xp.where(odd, sin_r, cos_r)
    sin = xp.where(((quadrant & 2) == 2) != (x < 0), -sin, sin)
    sin = xp.where(ax == 0, x, sin)  # keeps -0.0
    cos = xp.where(((quadrant + 1) & 2) == 2, -cos, cos)
    return sin, cos


def _has_abstract_gpu() -> bool:
    try:
        mesh = jax.sharding.get_abstract_mesh()
    except Exception:  # pragma: no cover - older API
        return False
    dev = getattr(mesh, "abstract_device", None)
    return dev is not None and getattr(dev, "platform", None) in ("cuda", "rocm", "gpu")


_SM_BY_KIND = (("B200", 100), ("B100", 100), ("H100", 90), ("H200", 90), ("H800", 90), ("H20", 90),
               ("A100", 80), ("A800", 80), ("A30", 80))


def sm_version() -> int:
    """Compute capability (major * 10 + minor) of the GPU the kernels are built for.

    The abstract device when lowering for a GPU from a CPU machine, else the default
    device; 90 (Hopper) when neither names a GPU (interpret mode), since block sizes only
    change coverage there, not results.
    """
    try:
        dev = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    except Exception:  # pragma: no cover - older API
        dev = None
    kind = getattr(dev, "device_kind", None) if dev is not None and getattr(dev, "platform", None) == "cuda" else None
    if kind is None and jax.default_backend() == "gpu":
        cc = getattr(jax.devices()[0], "compute_capability", None)
        if cc:
            major, _, minor = str(cc).partition(".")
            return int(major) * 10 + int(minor or 0)
        kind = jax.devices()[0].device_kind
    for name, sm in _SM_BY_KIND:
        if kind and name in kind:
            return sm
    return 90


def num_sms() -> int:
    """Streaming multiprocessors of the GPU the kernels are built for: the abstract device's
    core count when lowering from a CPU machine, else the default GPU's; ``GPU_NUM_CORES``
    (an H200) in interpret mode, where it only changes how work is split, not results."""
    try:
        dev = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    except Exception:  # pragma: no cover - older API
        dev = None
    n = getattr(dev, "num_cores", None) if dev is not None and getattr(dev, "platform", None) == "cuda" else None
    if not n and jax.default_backend() == "gpu":
        n = getattr(jax.devices()[0], "core_count", None)
    return int(n) if n else GPU_NUM_CORES


def _check_can_run(name: str, interpret: bool) -> None:
    """Raises ValueError naming kernel ``name`` and the ops that launch it where Pallas GPU
    kernels cannot run: not in interpret mode, no abstract GPU to lower for
    (:func:`abstract_gpu`), and a CPU backend. Checked at the launch, not when an op resolves
    its implementation: many ops asked for ``"pallas"`` launch no kernel (an XLA forward, an
    op or input that takes XLA), and Mosaic kernels lower for CUDA from a CPU machine."""
    if interpret or _has_abstract_gpu():
        return
    if jax.default_backend() == "cpu":
        from jaxbwd import registry  # the op table, for the message only

        ops = [s.name for s in registry.ops()
               if name in (*s.kernels, *s.jvp_kernels, *s.primal_kernels)]
        of = f" (of {', '.join('jaxbwd.' + o for o in ops)})" if ops else ""
        raise ValueError(
            f"jaxbwd: kernel {name!r}{of} was asked to run as a Pallas GPU kernel, but the default "
            "backend is CPU. Use implementation='xla', turn on interpret mode "
            "(jaxbwd.config.use(interpret=True) or JAXBWD_INTERPRET=1), or lower for a GPU "
            "with jaxbwd.pallas.lower_for_gpu."
        )


def call(
    kernel: Callable[..., None],
    *,
    name: str,
    grid: Sequence[int],
    out_shape: Any,
    interpret: bool,
    num_warps: int = 4,
    num_stages: int | None = None,
    flops: int = 0,
    transcendentals: int = 0,
    bytes_accessed: int = 0,
    input_output_aliases: dict[int, int] | None = None,
    metadata: dict[str, str] | None = None,
) -> Callable[..., Any]:
    """``pl.pallas_call`` with jaxbwd's conventions: whole-array refs (kernels index and
    mask their own tiles), a name, a cost estimate and Triton compiler parameters; inside
    a vma-checked shard_map the outputs declare the manual axes they vary over.

    ``input_output_aliases`` ({input index: output index}): the output is written in the
    input's buffer (XLA copies the input first where it is still needed elsewhere), so a
    kernel may leave parts of it untouched.

    ``metadata`` (string pairs, e.g. an attention kernel's score tile) is stored with the
    call where this jax's ``pallas_call`` takes it, for ``python -m jaxbwd compile``."""
    _check_can_run(name, interpret)
    key = _launch_key(kernel, name, grid, out_shape, interpret, num_warps, num_stages, flops, transcendentals,
                      bytes_accessed, input_output_aliases, metadata)

    def launch(*args):
        wrap = LAUNCH_WRAPPER.get()  # at launch: a ``call`` made once (a user op's) is instrumented too
        args, out = _vary_together(args, out_shape)
        token = _INTERPRETING.set(bool(interpret))
        try:
            return run_cached(None if wrap else key, lambda *a: _launch(a, out, wrap), args)
        finally:
            _INTERPRETING.reset(token)

    extra = {"metadata": dict(metadata)} if metadata and _PALLAS_CALL_HAS_METADATA else {}

    def _launch(args, out, wrap):
        return (wrap or (lambda f: f))(pl.pallas_call)(
            kernel,
            out_shape=out,
            grid=tuple(int(g) for g in grid),
            interpret=interpret,
            name=name,
            input_output_aliases=dict(input_output_aliases or {}),
            compiler_params=plgpu.CompilerParams(num_warps=int(num_warps), num_stages=num_stages),
            cost_estimate=pl.CostEstimate(
                flops=int(flops), transcendentals=int(transcendentals), bytes_accessed=int(bytes_accessed)
            ),
            **extra,
        )(*args)

    return launch


_PALLAS_CALL_HAS_METADATA = "metadata" in inspect.signature(pl.pallas_call).parameters

# Instrumentation for tests (jaxbwd.testing.record_program_writes): while set, a launch goes
# through ``wrapper(pl.pallas_call)`` and bypasses the eager launch cache, so no launcher
# cached before the block runs uninstrumented inside it and none instrumented is cached for
# later.
LAUNCH_WRAPPER: contextvars.ContextVar[Callable[[Callable], Callable] | None] = contextvars.ContextVar(
    "jaxbwd_launch_wrapper", default=None)

# Eager (un-jitted) launches: ``pl.pallas_call`` traces its kernel anew on every call, and the
# new kernel jaxpr misses JAX's primitive cache, so each eager call (a backward run outside
# ``jax.jit``) lowered and compiled the kernel again (0.26-1.9 s per call in interpret mode,
# bench/results/2026-12-05-eager-calls.md). A launch whose kernel and settings have a static
# key (below) runs through a ``jax.jit`` kept per key, whose own cache adds the operands'
# shapes and dtypes and JAX's trace-time settings (matmul precision, x64). Only jaxbwd's own
# kernel functions are keyed (module globals they read are constants). Bounded: least
# recently used first out.
_LAUNCHERS: "collections.OrderedDict[Any, Callable]" = collections.OrderedDict()
_LAUNCHERS_MAX = 128
_LAUNCHERS_LOCK = threading.Lock()


def clear_launch_cache() -> None:
    """Forgets every cached eager launcher (for code that changes a constant a kernel body
    reads, such as ``jaxbwd.testing.small_tiles``)."""
    with _LAUNCHERS_LOCK:
        _LAUNCHERS.clear()


class _Unkeyable(Exception):
    pass


def _static(x, depth: int = 0):
    """A hashable stand-in for ``x`` equal for two values exactly when they build the same
    kernel: scalars and dtypes by type and repr, containers and dataclasses by their items,
    jaxbwd's own functions by code, defaults and closure contents. Raises _Unkeyable for
    anything else: arrays, other objects, and functions from outside jaxbwd (a user's
    ``define_elementwise`` derivative may read globals that change between calls), whose
    launches then compile per eager call as a bare ``pl.pallas_call``'s do."""
    if depth > 24:
        raise _Unkeyable
    rec = lambda v: _static(v, depth + 1)  # noqa: E731
    if isinstance(x, (float, complex, np.generic)):
        return (type(x), repr(x))  # -0.0 apart from 0.0, nan equal to nan
    if x is None or isinstance(x, (bool, int, str, bytes)):
        return (type(x), x)
    if isinstance(x, (type, enum.Enum, jnp.dtype)):
        return x
    if isinstance(x, (tuple, list)):
        return (type(x), tuple(rec(v) for v in x))
    if isinstance(x, dict):
        return (dict, tuple(sorted(((rec(k), rec(v)) for k, v in x.items()), key=repr)))
    if isinstance(x, functools.partial):
        return (functools.partial, rec(x.func), rec(x.args), rec(x.keywords))
    if isinstance(x, types.FunctionType):
        if not (x.__module__ or "").startswith("jaxbwd."):
            raise _Unkeyable  # user code (define_elementwise's derivative): its globals may change
        try:
            cells = tuple(rec(c.cell_contents) for c in x.__closure__ or ())
        except ValueError:  # an empty cell: a closure variable not assigned yet
            raise _Unkeyable from None
        return (types.FunctionType, x.__module__, x.__qualname__, x.__code__, rec(x.__defaults__),
                rec(x.__kwdefaults__), cells)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return (type(x), tuple(rec(getattr(x, f.name)) for f in dataclasses.fields(x)))
    if isinstance(x, jax.core.ShapedArray):  # an aval (Mosaic's scratch types hold them): immutable
        return (jax.core.ShapedArray, x)
    if isinstance(x, jax.ShapeDtypeStruct):
        return (jax.ShapeDtypeStruct, tuple(x.shape), jnp.dtype(x.dtype), bool(getattr(x, "weak_type", False)),
                getattr(x, "sharding", None))
    raise _Unkeyable


def _launch_key(*parts):
    """The cache key of a launch, or None where a part has none (the launch then compiles per
    call, as before)."""
    try:
        key = _static(parts)
        hash(key)
    except (_Unkeyable, TypeError):
        return None
    return key


def run_cached(key, fn: Callable, args: Sequence[Any]):
    """``fn(*args)``; with concrete ``args`` and a ``key`` (:func:`_launch_key`) through the
    ``jax.jit`` of ``fn`` kept under it. Traced args call ``fn`` directly: the enclosing jit
    compiles it once."""
    if key is None or any(isinstance(a, jax.core.Tracer) for a in jax.tree_util.tree_leaves(args)):
        return fn(*args)
    return _cached_launcher(key, lambda: jax.jit(fn))(*args)


def _cached_launcher(key, make: Callable[[], Callable]) -> Callable:
    """The launcher kept under ``key`` (``make()`` the first time), most recently used last."""
    with _LAUNCHERS_LOCK:  # eager calls may come from several threads
        f = _LAUNCHERS.get(key)
        if f is None:
            f = _LAUNCHERS[key] = make()
            while len(_LAUNCHERS) > _LAUNCHERS_MAX:
                _LAUNCHERS.popitem(last=False)
        else:
            _LAUNCHERS.move_to_end(key)
        return f


def _vary_together(args, out_shape):
    """Inside a vma-checked shard_map (a user's, with ``check_vma=True``), a kernel's
    operands must agree over which manual mesh axes they vary, and its outputs must say
    so: all vary over the union of the operands' axes (a kernel mixes all its inputs).
    Elsewhere nothing varies and nothing changes."""
    args, mat = S.vary_together(args)
    if mat is None:
        return args, out_shape
    out_shape = jax.tree_util.tree_map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, manual_axis_type=mat), out_shape,
        is_leaf=lambda s: isinstance(s, jax.ShapeDtypeStruct))
    return args, out_shape


def nbytes(*arrays) -> int:
    return int(sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in arrays))


@contextlib.contextmanager
def abstract_gpu(device_kind: str = GPU_DEVICE_KIND, num_cores: int = GPU_NUM_CORES):
    """Lets Pallas's Triton lowering run on a machine without a GPU.

    From jax 0.12 the lowering asks for GPU info; an abstract mesh with an abstract CUDA
    device supplies it. On older jax the mesh is accepted and does no harm.
    """
    mesh = jax.sharding.AbstractMesh(
        (1,), ("x",),
        abstract_device=jax.sharding.AbstractDevice(
            device_kind=device_kind, num_cores=num_cores, platform="cuda"
        ),
    )
    with jax.sharding.use_abstract_mesh(mesh):
        yield mesh


def lower_for_gpu(fn: Callable[..., Any], *args, **kwargs) -> str:
    """Lowers ``jax.jit(fn)(*args, **kwargs)`` for CUDA from any machine; returns StableHLO text.

    ``args`` may be arrays or ``jax.ShapeDtypeStruct`` (nothing is allocated). Pallas kernels
    appear as ``__gpu$xla.gpu.triton`` custom calls that carry the kernel's name.
    """
    with abstract_gpu():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            lowered = jax.jit(fn).trace(*args, **kwargs).lower(lowering_platforms=("cuda",))
        return lowered.as_text()


def triton_kernel_names(hlo_text: str) -> list[str]:
    """Names of the Pallas Triton kernels in a lowered module (one per custom call)."""
    import re

    names = []
    for line in hlo_text.splitlines():
        if "xla.gpu.triton" in line:
            m = re.search(r'name = "([^"]+)"', line)
            names.append(m.group(1) if m else "?")
    return names


def triton_ir(hlo_text: str) -> dict[str, str]:
    """The Triton IR (TTIR text) of each Pallas kernel in a lowered module, by kernel name.

    Pallas stores each kernel as MLIR bytecode in its custom call; this decodes it with jax's
    own MLIR bindings, so tests can check what a kernel computes (e.g. its index widths).
    """
    import re

    from jax._src.interpreters import mlir
    from jax._src.lib import triton
    from jax._src.lib.mlir import ir

    out = {}
    for line in hlo_text.splitlines():
        if "xla.gpu.triton" not in line:
            continue
        name = re.search(r'name = "([^"]+)"', line)
        raw = re.search(r'ir = "((?:[^"\\]|\\.)*)"', line)
        if not (name and raw):
            continue
        text, data, i = raw.group(1), bytearray(), 0
        while i < len(text):  # MLIR string escapes: \\, \", \XX (hex)
            if text[i] == "\\":
                if text[i + 1] in '\\"':
                    data.append(ord(text[i + 1]))
                    i += 2
                else:
                    data.append(int(text[i + 1:i + 3], 16))
                    i += 3
            else:
                data += text[i].encode()
                i += 1
        ctx = mlir.make_ir_context()
        triton.dialect.register_dialect(ctx)
        with ctx:
            out[name.group(1)] = str(ir.Module.parse(bytes(data)))
    return out


def row_reduce_then_write(t: RowTiling, load_chunk, row_sums, write_chunk):
    """The two-phase shape of every row-wise backward (norms, softmax).

    ``load_chunk(j)`` loads column chunk ``j`` of the current row block, ``row_sums(tiles)``
    returns a tuple of [block_rows] f32 partial sums over that chunk, ``write_chunk(j, tiles,
    sums)`` uses the full-row sums to write outputs. When the row fits in one chunk the
    tiles are loaded once and stay in registers; otherwise the chunks are read twice (the
    second read mostly hits L2). Returns ``write_chunk``'s result for the single-chunk case,
    ``None`` otherwise.
    """
    if t.num_col_blocks == 1:
        tiles = load_chunk(0)
        return write_chunk(0, tiles, row_sums(tiles))

    def acc_body(j, acc):
        return tuple(a + s for a, s in zip(acc, row_sums(load_chunk(j))))

    first = row_sums(load_chunk(0))
    sums = jax.lax.fori_loop(1, t.num_col_blocks, acc_body, first)

    def write_body(j, carry):
        write_chunk(j, load_chunk(j), sums)
        return carry

    jax.lax.fori_loop(0, t.num_col_blocks, write_body, 0)
    return None


# Set while a kernel body is traced for interpret mode: its dots then run as plain f32 on
# the CPU, which has no TF32 algorithms.
_INTERPRETING: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxbwd_interpreting", default=False)

# jax.default_matmul_precision -> the f32 dot algorithm: TF32 (one tensor-core pass, 10-bit
# mantissa inputs) by default, as XLA's own f32 dots on Ampere and later; 3xTF32 (split
# inputs, about f32 accuracy, still tensor cores) for "float32"/"highest".
_F32_EXACT = ("highest", "float32", "tensorfloat32_3x", "bfloat16_3x")


def f32_dot_precision():
    """The dot algorithm f32 kernel tiles use under the current ``jax.default_matmul_precision``
    (``None``, plain f32, while tracing for interpret mode)."""
    if _INTERPRETING.get():
        return None  # plain f32 on the CPU
    name = str(jax.config.jax_default_matmul_precision or "default").lower()
    if name in _F32_EXACT:
        return lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    return lax.DotAlgorithmPreset.TF32_TF32_F32


def dot(a, b, *, trans_a: bool = False, trans_b: bool = False):
    """Tile matmul with f32 accumulation (Triton ``tl.dot``).

    16-bit inputs run the tensor cores directly. f32 inputs follow
    ``jax.default_matmul_precision`` as XLA's dots do (``f32_dot_precision``): TF32 by default,
    3xTF32 for ``"float32"``/``"highest"``; both use the tensor cores (an IEEE f32 dot is an
    FMA loop that spills at attention's tile sizes). Interpret mode computes exact f32.
    Tiles must have every dimension >= 16 when lowered for a GPU (interpret mode accepts any).
    """
    precision = f32_dot_precision() if a.dtype == jnp.float32 else None
    return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b, precision=precision).astype(jnp.float32)


def finite_or_zero(m):
    """``m`` where finite, else 0: the safe shift for exp(x - m) when a row's max is -inf."""
    return jnp.where(jnp.isfinite(m), m, 0.0)


def online_lse_update(m, s, x):
    """One step of the online (streaming) logsumexp over the last axis of ``x``.

    ``m`` [rows] is the running max, ``s`` [rows] the running sum of ``exp(x - m)``; masked
    lanes of ``x`` must hold -inf. Rows that are entirely -inf so far keep ``m = -inf`` and
    ``s = 0`` without NaN. ``logsumexp = finite_or_zero(m) + log(s)`` at the end (``-inf``
    for an all -inf row). Milakov & Gimelshein, "Online normalizer calculation for softmax" (2018).
    """
    m_new = jnp.maximum(m, jnp.max(x, axis=-1))
    shift = finite_or_zero(m_new)
    s_new = s * exp2((m - shift) * LOG2E) + jnp.sum(exp2((x - shift[..., None]) * LOG2E), axis=-1)
    return m_new, s_new


def idiv(x, k: int):
    """``x // k`` for non-negative int32 ``x`` and a static positive int ``k``.

    Written with ``lax.div`` (truncation equals floor for x >= 0) rather than jnp's
    ``//``/``%``, whose sign-fixing selects fail Triton's lowering when ``x`` is a scalar
    loop index (and for the literal divisor 1).
    """
    return x if k == 1 else jax.lax.div(x, jnp.full_like(x, k))


def imod(x, k: int):
    """``x % k`` for non-negative int32 ``x`` and a static positive int ``k`` (see ``idiv``)."""
    return jnp.zeros_like(x) if k == 1 else jax.lax.rem(x, jnp.full_like(x, k))
