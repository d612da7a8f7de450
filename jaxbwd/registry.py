"""One ``OpSpec`` per op: the table that drives the tests, the benchmarks and the CLI.

An entry says what the op differentiates, which static parameters it takes, which
Pallas kernels its backward runs (by ``pallas_call`` name, so tests can prove they
ran), its reference, small example inputs for the test contract, realistic shapes for
the GPU lowering checks, bad inputs with the error each must raise, and a residual
budget in bytes.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp

from jaxbwd import reference as ref
from jaxbwd.vjp import linear, norms, shape


@dataclasses.dataclass(frozen=True)
class Example:
    """Inputs for one test case: ``make(key, dtype) -> (args, kwargs)``.

    ``batch_argnums`` are the positional args that get an extra leading axis in the
    vmap/scan tests; the others (weights, integer params) stay unbatched.
    """

    name: str
    make: Callable[[jax.Array, Any], tuple[tuple, dict]]
    batch_argnums: tuple[int, ...] = (0,)


@dataclasses.dataclass(frozen=True)
class BadInput:
    """An invalid call and the error it must raise (``match`` is a regex on the message)."""

    name: str
    make: Callable[[], tuple[tuple, dict]]
    error: type
    match: str


@dataclasses.dataclass(frozen=True)
class OpSpec:
    name: str
    family: str
    fn: Callable[..., Any]
    reference: Callable[..., Any]
    diff_argnums: tuple[int, ...]
    static_params: tuple[str, ...]
    kernels: tuple[str, ...]  # pallas_call names; () means the backward is XLA by design
    backward: str  # one line: what the backward runs
    examples: tuple[Example, ...]
    lowering: tuple[Example, ...] = ()  # realistic shapes; make() returns ShapeDtypeStructs
    bad_inputs: tuple[BadInput, ...] = ()
    # Bytes the forward may save for the backward, given the example's args (None: no check).
    residual_budget: Optional[Callable[..., int]] = None
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    check_grads_order: int = 1  # order of the float64 numerical gradient check (0 = skip)

    @property
    def has_kernels(self) -> bool:
        return bool(self.kernels)


def _normal(key, shape, dtype):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


ROW_SHAPES = ((2, 3, 96), (5, 123), (1, 1, 1023))
# The DESIGN's realistic lowering shapes for row-wise ops: hidden 4096, 5120 and 16384.
ROW_LOWERING = (((8192, 4096), "bfloat16"), ((4096, 5120), "float32"), ((2048, 16384), "bfloat16"))


def _nbytes(*arrays) -> int:
    return sum(a.size * jnp.dtype(a.dtype).itemsize for a in arrays)


def _rows(x) -> int:
    return x.size // x.shape[-1]


def _unary_examples(**kw):
    return tuple(
        Example(f"{'x'.join(map(str, s))}", lambda k, dt, s=s: ((_normal(k, s, dt),), dict(kw)))
        for s in ROW_SHAPES
    )


def _unary_lowering(**kw):
    return tuple(Example(f"{s}-{dt}", lambda k, d, s=s, dt=dt: ((_sds(s, dt),), dict(kw))) for s, dt in ROW_LOWERING)


def _x_w(extra=False, **kw):
    def build(s):
        def make(k, dt):
            k1, k2, k3 = jax.random.split(k, 3)
            args = (_normal(k1, s, dt), 1.0 + 0.1 * _normal(k2, s[-1:], dt))
            if extra:
                args = args + (0.1 * _normal(k3, s[-1:], dt),)
            return args, dict(kw)

        return Example("x".join(map(str, s)), make)

    return tuple(build(s) for s in ROW_SHAPES)


def _x_w_lowering(extra=False, **kw):
    def build(s, dt):
        def make(k, d):
            args = (_sds(s, dt), _sds(s[-1:], dt)) + ((_sds(s[-1:], dt),) if extra else ())
            return args, dict(kw)

        return Example(f"{s}-{dt}", make)

    return tuple(build(s, dt) for s, dt in ROW_LOWERING)


def _norm_bad(fn_args):
    """Bad inputs shared by rms_norm and layer_norm. fn_args(x, w) -> positional args."""
    f32 = jnp.float32
    return (
        BadInput("rank-0 x", lambda: (fn_args(jnp.ones((), f32), jnp.ones((1,), f32)), {}), ValueError, r"x must have rank >= 1.*got shape \(\)"),
        BadInput("weight length", lambda: (fn_args(jnp.ones((4, 8), f32), jnp.ones((7,), f32)), {}), ValueError, r"weight must have shape \(8,\).*got \(7,\)"),
        BadInput("integer x", lambda: (fn_args(jnp.ones((4, 8), jnp.int32), jnp.ones((8,), f32)), {}), TypeError, r"x must have a floating dtype.*got int32"),
        BadInput("eps <= 0", lambda: (fn_args(jnp.ones((4, 8), f32), jnp.ones((8,), f32)), {"eps": 0.0}), ValueError, r"eps must be a positive number, got 0.0"),
        BadInput("implementation", lambda: (fn_args(jnp.ones((4, 8), f32), jnp.ones((8,), f32)), {"implementation": "cuda"}), ValueError, r"implementation must be None, 'pallas' or 'xla', got 'cuda'"),
    )


_SPECS: list[OpSpec] = [
    OpSpec(
        name="rms_norm", family="norms", fn=norms.rms_norm, reference=ref.rms_norm,
        diff_argnums=(0, 1), static_params=("eps", "weight_offset"), kernels=("rms_norm_bwd",),
        backward="Pallas: dx per row block + f32 dweight partials (persistent grid)",
        examples=_x_w() + _x_w(weight_offset=1.0)[:1],
        lowering=_x_w_lowering(),
        bad_inputs=_norm_bad(lambda x, w: (x, w)),
        # x and weight (aliases of live inputs) plus one f32 rstd per row.
        residual_budget=lambda x, w, **_: _nbytes(x, w) + 4 * _rows(x),
    ),
    OpSpec(
        name="layer_norm", family="norms", fn=norms.layer_norm, reference=ref.layer_norm,
        diff_argnums=(0, 1, 2), static_params=("eps",), kernels=("layer_norm_bwd",),
        backward="Pallas: dx per row block + f32 dweight/dbias partials (persistent grid)",
        examples=_x_w(extra=True),
        lowering=_x_w_lowering(extra=True),
        bad_inputs=_norm_bad(lambda x, w: (x, w, w)),
        residual_budget=lambda x, w, b, **_: _nbytes(x, w) + 8 * _rows(x),
    ),
    OpSpec(
        name="bias_add", family="linear", fn=linear.bias_add, reference=ref.bias_add,
        diff_argnums=(0, 1), static_params=(), kernels=("bias_add_dbias",),
        backward="dx = dy (no copy); Pallas column-sum kernel for dbias (f32 partials)",
        examples=tuple(
            Example("x".join(map(str, s)), lambda k, dt, s=s: ((_normal(k, s, dt), _normal(jax.random.fold_in(k, 1), s[-1:], dt)), {}))
            for s in ROW_SHAPES
        ),
        lowering=tuple(
            Example(f"{s}-{dt}", lambda k, d, s=s, dt=dt: ((_sds(s, dt), _sds(s[-1:], dt)), {})) for s, dt in ROW_LOWERING
        ),
        bad_inputs=(
            BadInput("bias length", lambda: ((jnp.ones((4, 8)), jnp.ones((3,))), {}), ValueError, r"bias must have shape \(8,\).*got \(3,\)"),
            BadInput("integer x", lambda: ((jnp.ones((4, 8), jnp.int32), jnp.ones((8,))), {}), TypeError, r"x must have a floating dtype"),
        ),
        residual_budget=lambda x, b, **_: 0,
    ),
    OpSpec(
        name="matmul", family="linear", fn=linear.matmul, reference=ref.matmul,
        diff_argnums=(0, 1), static_params=(), kernels=(),
        backward="XLA dot (cuBLAS); a hand kernel does not beat it",
        examples=(
            Example("2x3x96@96x40", lambda k, dt: ((_normal(k, (2, 3, 96), dt), 0.1 * _normal(jax.random.fold_in(k, 1), (96, 40), dt)), {})),
            Example("5x123@123x7", lambda k, dt: ((_normal(k, (5, 123), dt), 0.1 * _normal(jax.random.fold_in(k, 1), (123, 7), dt)), {})),
        ),
        bad_inputs=(
            BadInput("inner dim", lambda: ((jnp.ones((4, 8)), jnp.ones((7, 3))), {}), ValueError, r"w must have shape \[K=8, M\].*got \(7, 3\)"),
            BadInput("w rank", lambda: ((jnp.ones((4, 8)), jnp.ones((8,))), {}), ValueError, r"w must have rank 2"),
            BadInput("integer w", lambda: ((jnp.ones((4, 8)), jnp.ones((8, 2), jnp.int32)), {}), TypeError, r"w must have a floating dtype"),
        ),
        residual_budget=lambda x, w, **_: _nbytes(x, w),
    ),
    OpSpec(
        name="scale", family="linear", fn=linear.scale, reference=ref.scale,
        diff_argnums=(0,), static_params=("factor",), kernels=(),
        backward="XLA multiply",
        examples=tuple(
            Example("x".join(map(str, s)), lambda k, dt, s=s: ((_normal(k, s, dt), 0.5), {})) for s in ROW_SHAPES[:2]
        ),
        bad_inputs=(
            BadInput("factor type", lambda: ((jnp.ones((4,)), "2"), {}), TypeError, r"factor must be a Python number, got '2'"),
            BadInput("integer x", lambda: ((jnp.ones((4,), jnp.int32), 2.0), {}), TypeError, r"x must have a floating dtype"),
        ),
        residual_budget=lambda x, f, **_: 0,
    ),
    OpSpec(
        name="residual_add", family="linear", fn=linear.residual_add, reference=ref.residual_add,
        diff_argnums=(0, 1), static_params=(), kernels=(),
        backward="XLA: identity, summed over broadcast dims",
        examples=(
            Example("same", lambda k, dt: ((_normal(k, (5, 123), dt), _normal(jax.random.fold_in(k, 1), (5, 123), dt)), {}), (0, 1)),
            Example("broadcast", lambda k, dt: ((_normal(k, (2, 3, 96), dt), _normal(jax.random.fold_in(k, 1), (1, 96), dt)), {})),
        ),
        bad_inputs=(
            BadInput("shapes", lambda: ((jnp.ones((4, 8)), jnp.ones((3, 8))), {}), ValueError, r"broadcastable shapes, got \(4, 8\) and \(3, 8\)"),
            BadInput("integer b", lambda: ((jnp.ones((4, 8)), jnp.ones((4, 8), jnp.int32)), {}), TypeError, r"b must have a floating dtype"),
        ),
        residual_budget=lambda a, b, **_: 0,
    ),
    OpSpec(
        name="reshape", family="shape", fn=shape.reshape, reference=ref.reshape,
        diff_argnums=(0,), static_params=("shape",), kernels=(),
        backward="metadata only",
        examples=(Example("2x3x96->6x96", lambda k, dt: ((_normal(k, (2, 3, 96), dt), (-1, 96)), {})),),
        bad_inputs=(
            BadInput("count", lambda: ((jnp.ones((4, 8)), (5, 7)), {}), ValueError, r"shape must hold 32 elements.*got \(5, 7\)"),
            BadInput("integer x", lambda: ((jnp.ones((4,), jnp.int32), (2, 2)), {}), TypeError, r"x must have a floating dtype"),
        ),
        residual_budget=lambda x, s, **_: 0,
    ),
    OpSpec(
        name="row_slice", family="shape", fn=shape.row_slice, reference=ref.row_slice,
        diff_argnums=(0,), static_params=("size",), kernels=(),
        backward="XLA dynamic_update_slice into zeros",
        examples=(
            Example("13x40[3:8]", lambda k, dt: ((_normal(k, (13, 40), dt), 3, 5), {})),
            Example("13x40[traced 7:13]", lambda k, dt: ((_normal(k, (13, 40), dt), jnp.int32(7), 6), {})),
        ),
        bad_inputs=(
            BadInput("rank", lambda: ((jnp.ones((4,)), 0, 2), {}), ValueError, r"x must have rank 2"),
            BadInput("size", lambda: ((jnp.ones((4, 3)), 0, 5), {}), ValueError, r"size must be in \[0, 4\].*got 5"),
            BadInput("start", lambda: ((jnp.ones((4, 3)), 3, 2), {}), ValueError, r"start must be in \[0, 2\] for size=2, got 3"),
            BadInput("float start", lambda: ((jnp.ones((4, 3)), jnp.float32(1.0), 2), {}), TypeError, r"start must have an integer dtype"),
        ),
        residual_budget=lambda x, s, n, **_: 8,
    ),
]

REGISTRY: dict[str, OpSpec] = {}


def register(spec: OpSpec) -> OpSpec:
    """Adds an op to the registry (names are unique)."""
    if spec.name in REGISTRY:
        raise ValueError(f"jaxbwd.registry: op {spec.name!r} is already registered")
    REGISTRY[spec.name] = spec
    return spec


for _s in _SPECS:
    register(_s)


def get(name: str) -> OpSpec:
    """The spec of op ``name``; raises KeyError listing the known ops."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"jaxbwd: unknown op {name!r}; known: {', '.join(sorted(REGISTRY))}") from None


def ops(names: Optional[Sequence[str]] = None) -> list[OpSpec]:
    """Specs in registry order, optionally restricted to ``names``."""
    if not names:
        return list(REGISTRY.values())
    return [get(n) for n in names]
