"""Argument checks and dispatch shared by the custom_vjp ops.

Errors name the op, the argument, what was expected and what came, and are raised at
trace time, before any kernel is built.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable
from typing import Any, Optional, Sequence, overload

import jax
import jax.numpy as jnp
import numpy as np

from jaxbwd import config

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


@dataclasses.dataclass(frozen=True)
class Impl:
    """The resolved implementation, a static (hashable) argument of every custom_vjp."""

    kind: str  # "pallas" or "xla"
    interpret: bool
    backend: str = "triton"  # the Pallas backend: "triton" or "mosaic" (config.MOSAIC_KERNELS)

    @property
    def pallas(self) -> bool:
        return self.kind == "pallas"

    @property
    def mosaic(self) -> bool:
        return self.kind == "pallas" and self.backend == "mosaic"


def impl(implementation: Optional[str], op: str, *arrays, float64_kernels: bool = False) -> Impl:
    """Resolves the implementation at trace time.

    Empty inputs (any of ``arrays`` with a zero-size dimension) take the XLA formulas: their
    outputs and gradients are empty, so there is no work for a kernel to do, and launching
    one with an empty grid is not allowed.

    float64 inputs take the XLA formulas too: jaxbwd's kernels compute in float32, so a
    float64 result from them would carry float32 accuracy. Asking for the kernels by name for
    such inputs (``implementation="pallas"`` in the call) is an error rather than a silent
    fallback. ``arrays`` must hold every floating operand for that; ``float64_kernels=True``
    (user ops, whose kernels are their author's) skips the rule.

    Symbolic shapes (``jax.export`` shape polymorphism) take the XLA formulas as well: a
    kernel's grid and tiles are fixed when it is lowered. Asking for the kernels by name
    with such inputs is an error.

    Raises:
      ValueError: an unknown implementation name; ``implementation="pallas"`` with an input of
        symbolic shape.
      TypeError: ``implementation="pallas"`` (or ``"pallas:<backend>"``) with a float64 input.
    """
    kind = config.resolve(implementation, op)
    if not config.named(implementation):  # "auto" as None in the messages below
        implementation = None
    arrays = [a for a in arrays if a is not None]  # optional operands (a bias, weights)
    symbolic = next((a for a in arrays if not is_static_shape(getattr(a, "shape", ()))), None)
    if kind == "pallas" and symbolic is not None:
        if implementation is not None:
            raise ValueError(
                f"jaxbwd.{op}: implementation={implementation!r} needs static shapes (a kernel's "
                f"grid is fixed when it is lowered), got an input of symbolic shape "
                f"{tuple(symbolic.shape)}; use implementation='xla' (or None) to export with "
                "symbolic shapes"
            )
        kind = "xla"
    if any(getattr(a, "size", 1) == 0 for a in arrays):
        kind = "xla"
    # canonicalised: a NumPy float64 array is float32 to jax unless x64 is on
    f64 = next((a for a in arrays if hasattr(a, "dtype") and jax.dtypes.canonicalize_dtype(a.dtype) == jnp.float64),
               None)
    if kind == "pallas" and f64 is not None and not float64_kernels:
        if implementation is not None:
            raise TypeError(
                f"jaxbwd.{op}: implementation={implementation!r} has no float64 kernels (they "
                f"compute in float32), got a float64 input of shape {tuple(f64.shape)}; use "
                "implementation='xla' (or None) for float64"
            )
        kind = "xla"
    backend = "triton"
    if kind == "pallas":
        from jaxbwd.pallas import _common as C  # the GPU generation the kernels are built for

        first = next((a for a in arrays if hasattr(a, "dtype")), None)
        dtype = None if first is None else first.dtype
        last_dim = first.shape[-1] if first is not None and first.ndim else None
        backend = config.resolve_pallas_backend(implementation, op, dtype, C.sm_version(), last_dim)
    return Impl(kind, config.interpret(), backend)


def is_static_shape(shape: Sequence[Any]) -> bool:
    """False if any dimension is symbolic (``jax.export.symbolic_shape``)."""
    return all(isinstance(d, (int, np.integer)) for d in shape)


def require_static(op: str, what: str, dims: Sequence[Any], why: str) -> None:
    """Raises ValueError naming ``op`` when one of ``dims`` is symbolic."""
    if not is_static_shape(dims):
        raise ValueError(f"jaxbwd.{op}: {what} must be static, got {tuple(dims)} (symbolic); {why}")


def check_nonempty_axis(op: str, name: str, x: Any, axis: int, what: str) -> None:
    if x.shape[axis] == 0:
        raise ValueError(f"jaxbwd.{op}: {name} must have a non-empty {what}, got shape {tuple(x.shape)}")


def _dtype_name(x) -> str:
    return str(jnp.result_type(x)) if hasattr(x, "dtype") else type(x).__name__


def check_array(op: str, name: str, x: Any) -> None:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"jaxbwd.{op}: {name} must be an array, got {type(x).__name__}")


_FLOATS = tuple(jnp.dtype(d) for d in ("float16", "bfloat16", "float32", "float64"))


def is_op_float(dtype) -> bool:
    """A floating dtype the ops take: 16 to 64 bits (not complex, not float8_e4m3fn, ...)."""
    return jnp.dtype(dtype) in _FLOATS


def takes_dtype(dtype) -> bool:
    """False for the dtypes no op takes, whatever the argument: complex, and floats other
    than 16 to 64 bits. Integers and bools are left to each op."""
    return is_op_float(dtype) or not jnp.issubdtype(dtype, jnp.inexact)


def check_float(op: str, name: str, x: Any) -> None:
    check_array(op, name, x)
    # Not every floating dtype: the 8- and 4-bit formats (float8_e4m3fn, ...) would run
    # through kernels and formulas written for 16- and 32-bit inputs and return results and
    # gradients rounded to 8 bits, a training recipe (scaled fp8) that no op implements.
    if not is_op_float(jnp.result_type(x)):
        raise TypeError(
            f"jaxbwd.{op}: {name} must have a floating dtype of 16 to 64 bits (float32, bfloat16, "
            f"float16; float64 runs the XLA implementation), got {_dtype_name(x)}"
        )


def check_int(op: str, name: str, x: Any) -> Any:
    """Checks an integer index array and returns it as the ops use it: a dtype narrower than
    32 bits widened to int32, since indices are compared with sizes and offsets (V, S, an
    ignore_index) that such a dtype cannot hold: uint8 300 is 44, int8 -100 is -100 only by
    luck. Wider dtypes are returned as given."""
    check_array(op, name, x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"jaxbwd.{op}: {name} must have an integer dtype, got {_dtype_name(x)}")
    _check_host_index_fits(op, name, x)
    return widen_index(x)


def _check_host_index_fits(op: str, name: str, x: Any) -> None:
    # Without jax_enable_x64, jnp.asarray narrows a NumPy int64 array to int32 by wrapping,
    # so an id of 2**32 + 1 would silently become 1. Host values are concrete: check them.
    if not isinstance(x, (np.ndarray, np.generic)) or x.size == 0:
        return
    narrow = jax.dtypes.canonicalize_dtype(x.dtype)
    if narrow == x.dtype:
        return
    info, lo, hi = np.iinfo(narrow), int(np.min(x)), int(np.max(x))
    if lo < info.min or hi > info.max:
        raise ValueError(
            f"jaxbwd.{op}: {name} holds values in [{lo}, {hi}], outside {narrow.name}'s range, which JAX "
            f"without jax_enable_x64 would wrap into it (2**32 + 1 becomes 1), changing them; enable "
            f"jax_enable_x64 or pass values within {narrow.name}, got dtype {x.dtype.name}"
        )


def widen_index(x: Any) -> Any:
    """An integer array narrower than 32 bits as int32 (see :func:`check_int`); others as given."""
    x = jnp.asarray(x)
    return x.astype(jnp.int32) if jnp.iinfo(x.dtype).bits < 32 else x


def check_ndim(op: str, name: str, x: Any, *, min_ndim: int = 0, ndim: Optional[int] = None, what: str = "") -> None:
    if ndim is not None and x.ndim != ndim:
        raise ValueError(
            f"jaxbwd.{op}: {name} must have rank {ndim}{' ' + what if what else ''}, "
            f"got shape {tuple(x.shape)}"
        )
    if x.ndim < min_ndim:
        raise ValueError(
            f"jaxbwd.{op}: {name} must have rank >= {min_ndim}{' ' + what if what else ''}, "
            f"got shape {tuple(x.shape)}"
        )


def check_shape(op: str, name: str, x: Any, expected: Sequence[int], what: str = "") -> None:
    if tuple(x.shape) != tuple(expected):
        raise ValueError(
            f"jaxbwd.{op}: {name} must have shape {tuple(expected)}{' ' + what if what else ''}, "
            f"got {tuple(x.shape)}"
        )


def check_axis_name(op: str, axis_name: Any) -> None:
    """``None``, or a named axis (or tuple of them) bound by an enclosing shard_map, pmap or vmap."""
    if axis_name is None:
        return
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    # JAX's collectives read an int as a positional array axis, not as a name
    if any(isinstance(n, (int, np.integer, jax.core.Tracer)) or not isinstance(n, Hashable) for n in names):
        raise TypeError(f"jaxbwd.{op}: axis_name must be None, an axis name (e.g. a str) or a tuple of "
                        f"them, got {axis_name!r} (the feature axis is `axis`)")
    for name in names:
        try:
            jax.lax.axis_size(name)  # static: adds nothing to the jaxpr
        except NameError as e:
            raise ValueError(
                f"jaxbwd.{op}: axis_name must name an axis bound by an enclosing shard_map, pmap or vmap, "
                f"got {name!r}, which is unbound here"
            ) from e


def check_positive(op: str, name: str, value: Any) -> None:
    """A static, finite number > 0 (a TypeError for a string, bool, array or traced value)."""
    v = check_static_number(op, name, value)
    if not (v > 0 and math.isfinite(v)):
        raise ValueError(f"jaxbwd.{op}: {name} must be a positive number, got {value!r}")


def check_static_number(op: str, name: str, value: Any) -> float:
    """A static, finite real number as a float (NaN or inf would poison every result)."""
    if isinstance(value, jax.core.Tracer):
        raise TypeError(f"jaxbwd.{op}: {name} must be a static Python number, got a traced value")
    if not np.isscalar(value) or isinstance(value, (bool, np.bool_, str)) or np.iscomplexobj(value):
        raise TypeError(f"jaxbwd.{op}: {name} must be a real Python number, got {value!r}")
    if not math.isfinite(float(value)):
        raise ValueError(f"jaxbwd.{op}: {name} must be a finite number, got {value!r}")
    return float(value)


def is_static_int(value: Any) -> bool:
    """A Python or NumPy integer, not a bool (nor a traced value)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


@overload
def static_int(op: str, name: str, value: Any, *, minimum: Optional[int] = None) -> int: ...
@overload
def static_int(op: str, name: str, value: Any, *, minimum: Optional[int] = None,
               none_ok: bool) -> Optional[int]: ...


def static_int(op, name, value, *, minimum=None, none_ok=False):
    """A static integer (Python or NumPy, not bool), at least ``minimum`` when given, as a
    Python int (``None`` passes through when ``none_ok``): TypeError for anything else (a
    traced value included), ValueError below the minimum."""
    if none_ok and value is None:
        return None
    want = f"{'None or ' if none_ok else ''}a static Python int"
    if isinstance(value, jax.core.Tracer):
        raise TypeError(f"jaxbwd.{op}: {name} must be {want}, got a traced value")
    if not is_static_int(value):
        raise TypeError(f"jaxbwd.{op}: {name} must be {want}, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"jaxbwd.{op}: {name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def static_int_pair(op: str, name: str, value: Any, *, minimum: int) -> tuple[int, int]:
    """An int, or a pair of ints, each static (Python or NumPy, not bool) and at least
    ``minimum``, as a pair of Python ints (an int ``n`` gives ``(n, n)``): TypeError for a
    non-integer (a traced value included), ValueError for a sequence not of length 2 or a
    value below the minimum."""
    want = f"jaxbwd.{op}: {name} must be an int >= {minimum} or a pair of them, got"
    pair = (value, value) if is_static_int(value) else value
    if not isinstance(pair, (tuple, list)):
        got = "a traced value" if isinstance(value, jax.core.Tracer) else repr(value)
        raise TypeError(f"{want} {got}")
    if len(pair) != 2:
        raise ValueError(f"{want} {value!r}")
    if not all(is_static_int(e) for e in pair):
        got = "a traced value" if any(isinstance(e, jax.core.Tracer) for e in pair) else repr(value)
        raise TypeError(f"{want} {got}")
    if any(e < minimum for e in pair):
        raise ValueError(f"{want} {value!r}")
    return int(pair[0]), int(pair[1])


def check_same_dtype(op: str, names: Sequence[str], arrays: Sequence[Any]) -> None:
    dtypes = [jnp.dtype(a.dtype) for a in arrays]
    if any(d != dtypes[0] for d in dtypes):
        got = ", ".join(f"{n}={d}" for n, d in zip(names, dtypes))
        raise TypeError(f"jaxbwd.{op}: {', '.join(names)} must share one dtype, got {got}")


def apply_where(op: str, x_name: str, x: Any, where: Any) -> Any:
    """``x`` with -inf where the boolean ``where`` is False (jax.nn's and optax's ``where``).

    Raises TypeError for a non-boolean ``where``, ValueError when it does not broadcast to x.
    """
    check_array(op, "where", where)
    if where.dtype != jnp.bool_:
        raise TypeError(f"jaxbwd.{op}: where must be a boolean array, got {where.dtype}")
    try:
        mask = jnp.broadcast_to(where, x.shape)
    except ValueError:
        raise ValueError(f"jaxbwd.{op}: where must broadcast to {x_name}'s shape {tuple(x.shape)}, "
                         f"got {tuple(where.shape)}") from None
    return jnp.where(mask, x, jnp.asarray(-jnp.inf, x.dtype))


def rows(x):
    """[..., D] -> [R, D] (free reshape) and the leading shape to restore."""
    lead = x.shape[:-1]
    return x.reshape(math.prod(lead), x.shape[-1]), lead


def acc_dtype(*xs):
    """Accumulation dtype of arrays (or dtypes): float32 for 16/32-bit inputs, float64 when
    one is float64. Chosen without implicit promotion, which
    ``jax.numpy_dtype_promotion("strict")`` refuses for bfloat16 with float32."""
    wide = any(jnp.dtype(getattr(x, "dtype", x)) == jnp.float64 for x in xs)
    return jnp.dtype(jnp.float64 if wide else jnp.float32)


def dot_16bit(dot, *xs):
    """``dot(*xs)`` for an XLA path's f32-accumulating dot (``preferred_element_type``) of
    operands that may be 16-bit, with the operands as they are on GPU (16-bit tensor-core
    dots) and, where the computation is lowered for CPU, bfloat16 and float16 ones as float32.

    XLA's CPU runtime has no 16-bit x 16-bit -> float32 dot for some operand layouts, and
    ``vmap`` produces them (a batched weight against shared activations fails with
    "Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32"). A product of two
    16-bit floats is exact in float32, so the CPU dot is the same but for the order of its
    sum. The choice is made per lowering platform (``jax.lax.platform_dependent``), not by
    the default backend: a CPU host lowering for CUDA keeps the 16-bit dot, a GPU host
    running on its CPU device gets the float32 one."""
    def is16(y):
        return jnp.issubdtype(y.dtype, jnp.floating) and jnp.dtype(y.dtype).itemsize == 2

    def upcast(*ys):
        return dot(*(y.astype(jnp.float32) if is16(y) else y for y in ys))

    return jax.lax.platform_dependent(*xs, cpu=upcast, default=dot) if any(map(is16, xs)) else dot(*xs)


def centered_stats(xf, axes: Sequence[int], combine=None):
    """Mean and biased variance of ``xf`` over ``axes`` (the reduced axes removed), by the
    corrected two-pass algorithm: a first mean ``m0``, then in one pass over ``d = xf - m0``
    the correction ``c = mean(d)`` and ``mean(d**2)``; mean ``m0 + c``, variance
    ``mean(d**2) - c**2`` (Chan, Golub & LeVeque 1983, "Algorithms for computing the sample
    variance", eq. 1.7).

    ``c`` removes ``m0``'s rounding: a constant slice's mean is exactly its value, so
    ``x - mean`` is exactly 0 and the output exactly the bias (``jnp.mean`` alone gives
    3.0000002 for 1000 threes, which at a small eps is an output of -0.2 where 0 is due); a
    large common offset cancels exactly in ``d``, and an outlier anywhere in the slice costs
    no more than f32 rounding. A constant slice's variance is 0 within the rounding of
    ``mean(d**2) - c**2`` (up to ~7e-13 for values near 1e3 over 1000 elements; flax's
    two-pass variance is ``(x - rounded mean)**2``, ~1e-8 there), which only an eps below
    ~1e-10 lets show, in the scale of that slice's gradient. A variance past the f32 maximum
    is inf (rstd 0: the output is the bias); a slice whose sum overflows gives NaN.

    ``combine`` (e.g. a ``lax.pmean`` over devices holding equal shares) averages the per-slice
    means ``m0`` and then ``(c, mean(d**2))`` across slices held elsewhere: two collectives.
    """
    axes = tuple(a % xf.ndim for a in axes)
    if any(xf.shape[a] == 0 for a in axes):  # empty slices: NaN statistics, a zero-size output follows
        return jnp.mean(xf, axis=axes), jnp.mean(xf, axis=axes)
    combine = combine or (lambda v: v)
    # jnp.mean (sum, then one divide): a multiply per element before the sums made XLA
    # materialise f32 copies of x (2-6x slower on CPU, unfused on GPU).
    m0 = combine(jnp.mean(xf, axis=axes, keepdims=True))
    d = xf - m0
    c, msq = combine((jnp.mean(d, axis=axes, keepdims=True), jnp.mean(jnp.square(d), axis=axes)))
    # c**2 <= mean(d**2): where the latter overflows the variance is inf, not inf - inf.
    var = jnp.where(jnp.isinf(msq), msq, jnp.maximum(msq - jnp.square(jnp.squeeze(c, axis=axes)), 0.0))
    return jnp.squeeze(m0 + c, axis=axes), var
