"""One ``OpSpec`` per op: the table that drives the tests, the benchmarks and the CLI.

An entry says what the op differentiates, which static parameters it takes, which
Pallas kernels its backward runs (by ``pallas_call`` name, so tests can prove they
ran), its reference, small example inputs for the test contract, realistic shapes for
the GPU lowering checks, bad inputs with the error each must raise, and a residual
budget in bytes.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxbwd import baselines as bl
from jaxbwd import reference as ref
from jaxbwd.vjp import activations, linear, norms, shape
from jaxbwd.vjp import embedding, losses, rope
from jaxbwd.vjp import linear_cross_entropy as lce
from jaxbwd.vjp import attention
from jaxbwd.vjp import group_norm as group_norm_ops, vision
from jaxbwd.vjp import regression
from jaxbwd.vjp import dropout as dropout_ops
from jaxbwd.vjp import batch_norm as batch_norm_ops
from jaxbwd.vjp import pooling


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
    """The registry entry of one op (see the module docstring); ``bind`` fixes its
    non-differentiable arguments for tests, benchmarks and the CLI."""

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
    # Benchmark inputs by size ("small", "llm"): make(key, dtype) -> concrete (args, kwargs).
    # Without an entry the bench uses the first test example ("small") or materialises the
    # first lowering shape with normal floats ("llm").
    bench: tuple[tuple[str, Example], ...] = ()
    # FLOPs of forward + backward for compute-bound ops (attention, conv): f(*args, **kwargs).
    flops: Optional[Callable[..., float]] = None
    # FLOPs of forward + tangent (bench --mode jvp), as ``flops``.
    jvp_flops: Optional[Callable[..., float]] = None
    # Forward mode (jax.jvp/linearize/jacfwd): the Pallas kernels the tangent rule runs on the
    # kernel path (() when it is an XLA formula on both), and, for ops whose autodiff JVP
    # would hold a large intermediate, (inputs as ShapeDtypeStructs, budget(*args, **kwargs)):
    # compiled temp bytes of jit(jvp) on the XLA path (CPU) may not exceed the budget.
    jvp_kernels: tuple[str, ...] = ()
    # The Pallas kernels that run when the op is evaluated without being differentiated, where
    # they are not the forward's of ``kernels`` (cross_entropy's loss alone: its statistics
    # kernel, no gradient written): lowered and compiled as the op's "primal" cases.
    primal_kernels: tuple[str, ...] = ()
    jvp_memory: Optional[tuple[Example, Callable[..., int]]] = None
    # False for an op without forward mode (a define_op with a fwd and no tangent): the
    # contract then checks that jax.jvp raises NotImplementedError naming it, and
    # ``bench --mode jvp`` refuses it.
    forward_mode: bool = True
    # What a user calls instead (``jaxbwd.baselines``: jax.nn/optax/lax in the input dtype),
    # which the bench measures autodiff of; None: the reference.
    baseline: Optional[Callable[..., Any]] = None

    @property
    def has_kernels(self) -> bool:
        return bool(self.kernels)

    def bind(self, args: Sequence[Any], kwargs: dict, fn: Optional[Callable[..., Any]] = None, **extra) -> Callable:
        """``f(*diff_args)``: ``fn`` (default: the op) with the non-differentiable args fixed.

        ``extra`` keyword arguments (e.g. ``implementation``) are passed to every call.
        """
        fn = self.fn if fn is None else fn
        args = list(args)

        def f(*diff):
            full = list(args)
            for i, v in zip(self.diff_argnums, diff):
                full[i] = v
            return fn(*full, **kwargs, **extra)

        return f


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


def _attention_flops(q, k, v, is_causal=False, **_):
    return 3.5 * 4 * q.shape[0] * q.shape[2] * q.shape[1] * k.shape[1] * q.shape[3] / (2 if is_causal else 1)


def _conv2d_flops(x, w, **kw):
    return 3 * 2 * w.shape[0] * w.shape[1] * w.shape[2] * math.prod(
        jax.eval_shape(lambda a, b: ref.conv2d(a, b, **kw), x, w).shape)


def _norm_bad(fn_args):
    """Bad inputs shared by rms_norm and layer_norm. fn_args(x, w) -> positional args."""
    f32 = jnp.float32
    return (
        BadInput("rank-0 x", lambda: (fn_args(jnp.ones((), f32), jnp.ones((1,), f32)), {}), ValueError, r"x must have rank >= 1.*got shape \(\)"),
        BadInput("weight length", lambda: (fn_args(jnp.ones((4, 8), f32), jnp.ones((7,), f32)), {}), ValueError, r"weight must have shape \(8,\).*got \(7,\)"),
        BadInput("integer x", lambda: (fn_args(jnp.ones((4, 8), jnp.int32), jnp.ones((8,), f32)), {}), TypeError, r"x must have a floating dtype.*got int32"),
        BadInput("eps <= 0", lambda: (fn_args(jnp.ones((4, 8), f32), jnp.ones((8,), f32)), {"eps": 0.0}), ValueError, r"eps must be a positive number, got 0.0"),
        BadInput("string eps", lambda: (fn_args(jnp.ones((4, 8), f32), jnp.ones((8,), f32)), {"eps": "1e-6"}), TypeError, r"eps must be a real Python number, got '1e-6'"),
        BadInput("implementation", lambda: (fn_args(jnp.ones((4, 8), f32), jnp.ones((8,), f32)), {"implementation": "cuda"}), ValueError, r"implementation must be None, 'auto', 'pallas', 'xla', 'pallas:triton' or 'pallas:mosaic', got 'cuda'"),
    )


_SPECS: list[OpSpec] = [
    OpSpec(
        name="rms_norm", family="norms", fn=norms.rms_norm, reference=ref.rms_norm, baseline=bl.rms_norm,
        diff_argnums=(0, 1), static_params=("eps", "weight_offset"), kernels=("rms_norm_bwd",),
        backward="Pallas: dx per row block + f32 dweight partials (persistent grid)",
        examples=_x_w() + _x_w(weight_offset=1.0)[:1],
        lowering=_x_w_lowering(),
        bad_inputs=_norm_bad(lambda x, w: (x, w)),
        # x and weight (aliases of live inputs) plus one f32 rstd per row.
        residual_budget=lambda x, w, **_: _nbytes(x, w) + 4 * _rows(x),
    ),
    OpSpec(
        name="layer_norm", family="norms", fn=norms.layer_norm, reference=ref.layer_norm, baseline=bl.layer_norm,
        diff_argnums=(0, 1, 2), static_params=("eps",), kernels=("layer_norm_bwd",),
        backward="Pallas: dx per row block + f32 dweight/dbias partials (persistent grid)",
        examples=_x_w(extra=True),
        lowering=_x_w_lowering(extra=True),
        bad_inputs=_norm_bad(lambda x, w: (x, w, w)),
        residual_budget=lambda x, w, b, **_: _nbytes(x, w) + 8 * _rows(x),
    ),
    OpSpec(
        name="softmax", family="activations", fn=activations.softmax, reference=ref.softmax, baseline=bl.softmax,
        diff_argnums=(0,), static_params=("axis", "where"), kernels=("softmax_bwd",),
        backward="Pallas: dx = y * (dy - sum(dy * y)) per row block; saves only y",
        examples=_unary_examples() + (
            Example("axis0-5x7x9", lambda k, dt: ((_normal(k, (5, 7, 9), dt),), {"axis": 0})),
            Example("axes(0,2)-5x7x9", lambda k, dt: ((_normal(k, (5, 7, 9), dt),), {"axis": (0, 2)})),
            Example("where-7x9", lambda k, dt: ((_normal(k, (7, 9), dt),),
                                                {"where": jnp.arange(9) % 3 != 1})),
        ),
        lowering=_unary_lowering(),
        bad_inputs=(
            BadInput("axis", lambda: ((jnp.ones((4, 8)),), {"axis": 2}), ValueError, r"axis"),
            BadInput("empty axis", lambda: ((jnp.ones((4, 0)),), {}), ValueError, r"x must have a non-empty softmax axis 1, got shape \(4, 0\)"),
            BadInput("integer x", lambda: ((jnp.ones((4, 8), jnp.int32),), {}), TypeError, r"x must have a floating dtype"),
        ),
        residual_budget=lambda x, **_: _nbytes(x),  # y only
    ),
    OpSpec(
        name="silu", family="activations", fn=activations.silu, reference=ref.silu, baseline=bl.silu,
        diff_argnums=(0,), static_params=(), kernels=("silu_bwd",),
        backward="Pallas: fused elementwise dx = dy * s * (1 + x * (1 - s))",
        examples=_unary_examples(), lowering=_unary_lowering(),
        bad_inputs=(BadInput("integer x", lambda: ((jnp.ones((4,), jnp.int32),), {}), TypeError, r"x must have a floating dtype"),),
        residual_budget=lambda x, **_: _nbytes(x),
    ),
    OpSpec(
        name="gelu", family="activations", fn=activations.gelu, reference=ref.gelu, baseline=bl.gelu,
        diff_argnums=(0,), static_params=("approximate",), kernels=("gelu_bwd",),
        backward="Pallas: fused elementwise GELU derivative (tanh form or exact via erf)",
        examples=_unary_examples() + _unary_examples(approximate=False)[:1],
        lowering=_unary_lowering() + _unary_lowering(approximate=False)[:1],
        bad_inputs=(BadInput("integer x", lambda: ((jnp.ones((4,), jnp.int32),), {}), TypeError, r"x must have a floating dtype"),),
        residual_budget=lambda x, **_: _nbytes(x),
    ),
    OpSpec(
        name="relu", family="activations", fn=activations.relu, reference=ref.relu, baseline=bl.relu,
        diff_argnums=(0,), static_params=(), kernels=("relu_bwd",),
        backward="dx = dy * (y > 0) from the saved output; the Pallas kernel moves the same bytes as XLA's fusion (no gain)",
        examples=_unary_examples(), lowering=_unary_lowering()[:1],
        bad_inputs=(BadInput("integer x", lambda: ((jnp.ones((4,), jnp.int32),), {}), TypeError, r"x must have a floating dtype"),),
        residual_budget=lambda x, **_: _nbytes(x),  # y only
    ),
    OpSpec(
        name="leaky_relu", family="activations", fn=activations.leaky_relu, reference=ref.leaky_relu,
        baseline=bl.leaky_relu,
        diff_argnums=(0,), static_params=("negative_slope",), kernels=("leaky_relu_bwd",),
        backward="dx = dy * (x >= 0 ? 1 : slope) from the saved branch (int8); the kernel moves the same bytes as XLA's fusion (no gain)",
        examples=_unary_examples() + (
            Example("5x123-slope0.2", lambda k, dt: ((_normal(k, (5, 123), dt), 0.2), {})),
            Example("5x123-slope-0.5", lambda k, dt: ((_normal(k, (5, 123), dt),), {"negative_slope": -0.5})),
        ),
        lowering=_unary_lowering()[:1],
        bad_inputs=(
            BadInput("integer x", lambda: ((jnp.ones((4,), jnp.int32),), {}), TypeError, r"x must have a floating dtype"),
            BadInput("negative_slope", lambda: ((jnp.ones((4,)),), {"negative_slope": "0.1"}), TypeError, r"negative_slope must be a real Python number, got '0.1'"),
        ),
        residual_budget=lambda x, *a, **_: x.size,  # one int8 per element
    ),
    OpSpec(
        name="sigmoid", family="activations", fn=activations.sigmoid, reference=ref.sigmoid, baseline=bl.sigmoid,
        diff_argnums=(0,), static_params=(), kernels=("sigmoid_bwd",),
        backward="dx = dy * y * (1 - y) from the saved output; the kernel moves the same bytes as XLA's fusion (no gain)",
        examples=_unary_examples(), lowering=_unary_lowering()[:1],
        bad_inputs=(BadInput("integer x", lambda: ((jnp.ones((4,), jnp.int32),), {}), TypeError, r"x must have a floating dtype"),),
        residual_budget=lambda x, **_: _nbytes(x),  # y only
    ),
    OpSpec(
        name="tanh", family="activations", fn=activations.tanh, reference=ref.tanh, baseline=bl.tanh,
        diff_argnums=(0,), static_params=(), kernels=("tanh_bwd",),
        backward="dx = dy * (1 - y**2) from the saved output; the kernel moves the same bytes as XLA's fusion (no gain)",
        examples=_unary_examples(), lowering=_unary_lowering()[:1],
        bad_inputs=(BadInput("integer x", lambda: ((jnp.ones((4,), jnp.int32),), {}), TypeError, r"x must have a floating dtype"),),
        residual_budget=lambda x, **_: _nbytes(x),  # y only
    ),
    OpSpec(
        name="swiglu", family="activations", fn=activations.swiglu, reference=ref.swiglu, baseline=bl.swiglu,
        diff_argnums=(0, 1), static_params=("limit",), kernels=("swiglu_bwd",),
        backward="Pallas: fused elementwise dgate, dup (clamped lanes get 0)",
        examples=tuple(
            Example("x".join(map(str, s)) + (f"-limit{lim}" if lim else ""),
                    lambda k, dt, s=s, lim=lim: ((_normal(k, s, dt), _normal(jax.random.fold_in(k, 1), s, dt)), {"limit": lim}),
                    (0, 1))
            for s, lim in ((ROW_SHAPES[0], None), (ROW_SHAPES[1], None), (ROW_SHAPES[2], None), (ROW_SHAPES[1], 0.7))
        ),
        lowering=tuple(
            Example(f"{s}-{dt}", lambda k, d, s=s, dt=dt: ((_sds(s, dt), _sds(s, dt)), {})) for s, dt in ROW_LOWERING
        ),
        bad_inputs=(
            BadInput("shapes", lambda: ((jnp.ones((4, 8)), jnp.ones((4, 7))), {}), ValueError, r"up"),
            BadInput("limit", lambda: ((jnp.ones((4, 8)), jnp.ones((4, 8))), {"limit": 0.0}), ValueError, r"limit"),
            BadInput("integer gate", lambda: ((jnp.ones((4, 8), jnp.int32), jnp.ones((4, 8))), {}), TypeError, r"gate must have a floating dtype"),
        ),
        residual_budget=lambda g, u, **_: _nbytes(g, u),
    ),
    OpSpec(
        name="gated_linear_unit", family="activations", fn=activations.gated_linear_unit,
        reference=ref.gated_linear_unit, baseline=bl.gated_linear_unit,
        diff_argnums=(0,), static_params=("activation", "limit"), kernels=("glu_bwd",),
        backward="Pallas: one kernel reads both halves of x and dy, writes both halves of dx",
        examples=(
            Example("5x246-silu", lambda k, dt: ((_normal(k, (5, 246), dt),), {})),
            Example("2x3x96-gelu", lambda k, dt: ((_normal(k, (2, 3, 96), dt),), {"activation": "gelu"})),
            Example("1x1x2046-gelu_exact-limit", lambda k, dt: ((_normal(k, (1, 1, 2046), dt),), {"activation": "gelu_exact", "limit": 0.7})),
        ),
        lowering=(
            Example("(8192, 10240)-bfloat16", lambda k, d: ((_sds((8192, 2 * 5120), "bfloat16"),), {})),
            Example("(4096, 8192)-float32-gelu", lambda k, d: ((_sds((4096, 8192), "float32"),), {"activation": "gelu"})),
        ),
        bad_inputs=(
            BadInput("odd last dim", lambda: ((jnp.ones((4, 7)),), {}), ValueError, r"even"),
            BadInput("activation", lambda: ((jnp.ones((4, 8)),), {"activation": "relu"}), ValueError, r"activation"),
        ),
        residual_budget=lambda x, **_: _nbytes(x),
    ),
    OpSpec(
        name="glu", family="activations", fn=activations.glu, reference=ref.glu, baseline=bl.glu,
        diff_argnums=(0,), static_params=("axis",), kernels=(),
        backward="XLA by design: elementwise dx1 = dy*s, dx2 = dy*x1*s*(1-s), fused by XLA",
        examples=(
            Example("5x246", lambda k, dt: ((_normal(k, (5, 246), dt),), {})),
            Example("6x3x5-axis0", lambda k, dt: ((_normal(k, (6, 3, 5), dt),), {"axis": 0})),
        ),
        bad_inputs=(
            BadInput("odd axis", lambda: ((jnp.ones((4, 7)),), {}), ValueError, r"even"),
            BadInput("axis", lambda: ((jnp.ones((4, 8)),), {"axis": 2}), ValueError, r"axis"),
        ),
        residual_budget=lambda x, **_: _nbytes(x),
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
        name="matmul", family="linear", fn=linear.matmul, reference=ref.matmul, baseline=bl.matmul,
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
            BadInput("factor type", lambda: ((jnp.ones((4,)), "2"), {}), TypeError, r"factor must be a real Python number, got '2'"),
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
            BadInput("float start", lambda: ((jnp.ones((4, 3)), jnp.float32(1.0), 2), {}), TypeError, r"start must be a Python int or an integer scalar array"),
        ),
        residual_budget=lambda x, s, n, **_: 8,
    ),
    OpSpec(
        name="cross_entropy", family="losses", fn=losses.cross_entropy, reference=ref.cross_entropy,
        baseline=bl.cross_entropy,
        diff_argnums=(0,), static_params=("ignore_index", "label_smoothing", "z_loss", "reduction", "axis", "where"),
        kernels=("cross_entropy_fwd", "cross_entropy_bwd"), primal_kernels=("cross_entropy_stats",),
        backward="Pallas: forward writes the unit-cotangent gradient from the row max/sum (online softmax) while the logits are on chip; backward scales it in place, skipping rows whose cotangent is 1 (a loss not differentiated runs `cross_entropy_stats` alone; vocab-sharded logits, `cross_entropy_stats` then `cross_entropy_grad` per shard)",
        examples=(
            Example("6x37-mean", lambda k, dt: ((2.0 * _normal(k, (6, 37), dt), jax.random.randint(jax.random.fold_in(k, 1), (6,), 0, 37).at[2].set(-100)), {})),
            Example("2x3x50-smooth-z-sum", lambda k, dt: ((2.0 * _normal(k, (2, 3, 50), dt), jax.random.randint(jax.random.fold_in(k, 1), (2, 3), 0, 50)), {"label_smoothing": 0.1, "z_loss": 1e-3, "reduction": "sum"})),
            Example("5x33-none-oob", lambda k, dt: ((2.0 * _normal(k, (5, 33), dt), jax.random.randint(jax.random.fold_in(k, 1), (5,), 0, 33).at[4].set(33)), {"reduction": "none", "z_loss": 1e-2})),
        ),
        lowering=(
            Example("8192x128256-bf16", lambda k, d: ((_sds((8192, 128256), "bfloat16"), _sds((8192,), "int32")), {"label_smoothing": 0.1, "z_loss": 1e-4})),
            Example("4096x50257-f32-none", lambda k, d: ((_sds((4096, 50257), "float32"), _sds((4096,), "int32")), {"reduction": "none"})),
            Example("2x1023x32000-bf16", lambda k, d: ((_sds((2, 1023, 32000), "bfloat16"), _sds((2, 1023), "int32")), {})),
            Example("1024x151936-bf16", lambda k, d: ((_sds((1024, 151936), "bfloat16"), _sds((1024,), "int32")), {"reduction": "sum"})),
        ),
        bad_inputs=(
            BadInput("labels shape", lambda: ((jnp.ones((4, 8)), jnp.zeros((3,), jnp.int32)), {}), ValueError, r"labels must have shape \(4,\).*got \(3,\)"),
            BadInput("float labels", lambda: ((jnp.ones((4, 8)), jnp.zeros((4,))), {}), TypeError, r"labels must have an integer dtype.*got float32"),
            BadInput("integer logits", lambda: ((jnp.ones((4, 8), jnp.int32), jnp.zeros((4,), jnp.int32)), {}), TypeError, r"logits must have a floating dtype.*got int32"),
            BadInput("rank-0 logits", lambda: ((jnp.ones(()), jnp.zeros((), jnp.int32)), {}), ValueError, r"logits must have rank >= 1.*got shape \(\)"),
            BadInput("reduction", lambda: ((jnp.ones((4, 8)), jnp.zeros((4,), jnp.int32)), {"reduction": "avg"}), ValueError, r"reduction must be one of 'mean', 'sum', 'none', got 'avg'"),
            BadInput("label_smoothing", lambda: ((jnp.ones((4, 8)), jnp.zeros((4,), jnp.int32)), {"label_smoothing": 1.5}), ValueError, r"label_smoothing must be in \[0, 1\], got 1.5"),
            BadInput("z_loss", lambda: ((jnp.ones((4, 8)), jnp.zeros((4,), jnp.int32)), {"z_loss": -1.0}), ValueError, r"z_loss must be >= 0, got -1.0"),
        ),
        bench=(("llm", Example("8192x128256-bf16", lambda k, dt: (
            (_normal(k, (8192, 128256), "bfloat16"), jax.random.randint(jax.random.fold_in(k, 1), (8192,), 0, 128256)), {}))),),
        # The unit-cotangent gradient in logits' dtype (float32 for float16), in place of the
        # logits (not kept).
        residual_budget=lambda logits, labels, **_: (2 if logits.dtype == jnp.float16 else 1) * _nbytes(logits)
        + 12 * _rows(logits),
    ),
    OpSpec(
        name="embed", family="embedding", fn=embedding.embed, reference=ref.embed, baseline=bl.embed,
        diff_argnums=(1,), static_params=("padding_idx",), kernels=("embed_bwd", "embed_bwd_hot"),
        backward="Pallas: stable argsort of ids (XLA), programs only over the ids present sum 64-token chunks of dy in f32 into the zero-filled gradient; hot ids' chunks added in a fixed order",
        examples=(
            Example("5x7@13x24", lambda k, dt: ((jax.random.randint(jax.random.fold_in(k, 1), (5, 7), -1, 14), _normal(k, (13, 24), dt)), {}), (1,)),
            Example("40@9x33-pad0", lambda k, dt: ((jax.random.randint(jax.random.fold_in(k, 1), (40,), 0, 9), _normal(k, (9, 33), dt)), {"padding_idx": 0}), (1,)),
        ),
        bench=(("llm", Example("8192@32000x4096-bf16", lambda k, dt: (
            (jax.random.randint(jax.random.fold_in(k, 1), (8192,), 0, 32000), _normal(k, (32000, 4096), "bfloat16")), {}), (1,))),),
        lowering=(
            Example("8192@32000x4096-bf16", lambda k, d: ((_sds((8192,), "int32"), _sds((32000, 4096), "bfloat16")), {})),
            Example("4x2048@50257x5120-f32", lambda k, d: ((_sds((4, 2048), "int32"), _sds((50257, 5120), "float32")), {"padding_idx": 0})),
        ),
        bad_inputs=(
            BadInput("float ids", lambda: ((jnp.zeros((4,)), jnp.ones((8, 3))), {}), TypeError, r"ids must have an integer dtype.*got float32"),
            # Only without x64 (the tests' default): JAX would wrap the id to 1.
            BadInput("NumPy int64 id past int32", lambda: ((np.array([2**33 + 1], np.int64), jnp.ones((8, 3))), {}), ValueError, r"ids holds values in \[8589934593, 8589934593\], outside int32's range"),
            BadInput("integer table", lambda: ((jnp.zeros((4,), jnp.int32), jnp.ones((8, 3), jnp.int32)), {}), TypeError, r"table must have a floating dtype.*got int32"),
            BadInput("table rank", lambda: ((jnp.zeros((4,), jnp.int32), jnp.ones((8,))), {}), ValueError, r"table must have rank 2 \(\[V, D\]\), got shape \(8,\)"),
            BadInput("empty D", lambda: ((jnp.zeros((4,), jnp.int32), jnp.ones((8, 0))), {}), ValueError, r"table must have a non-empty feature axis D, got shape \(8, 0\)"),
            BadInput("padding_idx", lambda: ((jnp.zeros((4,), jnp.int32), jnp.ones((8, 3))), {"padding_idx": 8}), ValueError, r"padding_idx must be in \[-8, 8\).*got 8"),
        ),
        residual_budget=lambda ids, table, **_: _nbytes(ids),
    ),
    OpSpec(
        name="rope", family="rope", fn=rope.rope, reference=ref.rope,
        diff_argnums=(0,), static_params=("theta", "interleaved", "scale_factor", "frequency_scaling"),
        kernels=("rope_bwd",),
        backward=("Pallas: dy rotated by the negative angle, cos/sin computed in f32 registers once per (position, pair), "
                  "with one range reduction and no libdevice call (within 9.5e-8 of float64 for angles below 2**36 "
                  "radians, NaN from there), and reused across the heads"),
        examples=(
            Example("2x5x3x8", lambda k, dt: ((_normal(k, (2, 5, 3, 8), dt),), {})),
            Example("1x6x2x16-interleaved-pos[T]", lambda k, dt: ((_normal(k, (1, 6, 2, 16), dt),), {"positions": jnp.array([3, 4, 5, 9, 10, 11]), "interleaved": True})),
            Example("2x4x4x6-pos[B,T]", lambda k, dt: ((_normal(k, (2, 4, 4, 6), dt),), {"positions": jnp.array([[0, 1, 2, 3], [5, 6, 0, 1]]), "theta": 500000.0})),
            Example("2x5x3x8-scale8", lambda k, dt: ((_normal(k, (2, 5, 3, 8), dt),), {"scale_factor": 8.0, "start_pos": 3})),
            Example("1x4x2x16-float-pos", lambda k, dt: ((_normal(k, (1, 4, 2, 16), dt),), {"positions": jnp.array([0.5, 1.25, 7.0, 100.75])})),
            Example("2x6x2x32-llama3", lambda k, dt: ((_normal(k, (2, 6, 2, 32), dt),), {
                "positions": jnp.array([0, 1, 2, 900, 4000, 9000]), "theta": 500000.0, "frequency_scaling": {
                    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64}})),
        ),
        lowering=(
            Example("2x8192x32x128-bf16", lambda k, d: ((_sds((2, 8192, 32, 128), "bfloat16"),), {})),
            Example("1x4097x8x64-f32-interleaved", lambda k, d: ((_sds((1, 4097, 8, 64), "float32"),), {"interleaved": True})),
            Example("2x1023x40x80-bf16", lambda k, d: ((_sds((2, 1023, 40, 80), "bfloat16"),), {"start_pos": 17})),
            Example("1x2048x8x128-bf16-llama3-scale4", lambda k, d: ((_sds((1, 2048, 8, 128), "bfloat16"),), {
                "theta": 500000.0, "scale_factor": 4.0, "frequency_scaling": {
                    "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192}})),
        ),
        bad_inputs=(
            BadInput("rank", lambda: ((jnp.ones((2, 3, 8)),), {}), ValueError, r"x must have rank 4 \(\[B, T, N, H\]\), got shape \(2, 3, 8\)"),
            BadInput("odd H", lambda: ((jnp.ones((1, 3, 2, 7)),), {}), ValueError, r"head dimension H must be even, got shape \(1, 3, 2, 7\)"),
            BadInput("empty H", lambda: ((jnp.ones((1, 3, 2, 0)),), {}), ValueError, r"x must have a non-empty head dim H, got shape \(1, 3, 2, 0\)"),
            BadInput("string theta", lambda: ((jnp.ones((1, 3, 2, 8)),), {"theta": "1e4"}), TypeError, r"theta must be a real Python number, got '1e4'"),
            BadInput("positions shape", lambda: ((jnp.ones((2, 3, 1, 8)),), {"positions": jnp.zeros((4,), jnp.int32)}), ValueError, r"positions must have shape \(3,\) or \(2, 3\).*got \(4,\)"),
            BadInput("bool positions", lambda: ((jnp.ones((2, 3, 1, 8)),), {"positions": jnp.zeros((3,), bool)}), TypeError, r"positions must have an integer or floating dtype, got bool"),
            BadInput("scale_factor", lambda: ((jnp.ones((2, 3, 1, 8)),), {"scale_factor": -2.0}), ValueError, r"scale_factor must be a positive number, got -2.0"),
            BadInput("frequency_scaling", lambda: ((jnp.ones((2, 3, 1, 8)),), {"frequency_scaling": {"factor": 8.0}}), ValueError, r"frequency_scaling needs exactly the keys"),
            BadInput("theta", lambda: ((jnp.ones((2, 3, 1, 8)),), {"theta": 0.0}), ValueError, r"theta must be a positive number, got 0.0"),
            BadInput("integer x", lambda: ((jnp.ones((2, 3, 1, 8), jnp.int32),), {}), TypeError, r"x must have a floating dtype.*got int32"),
        ),
        # int32 (or float32) positions [B, T] only.
        residual_budget=lambda x, **_: 4 * x.shape[0] * x.shape[1],
    ),
    OpSpec(
        name="dot_product_attention", family="attention", fn=attention.dot_product_attention,
        reference=ref.dot_product_attention, baseline=bl.dot_product_attention, diff_argnums=(0, 1, 2),
        static_params=("scale", "is_causal", "local_window_size", "sliding_window", "logit_softcap"),
        kernels=("attention_fwd", "attention_bwd_dkdv", "attention_bwd_dq"),
        backward="Pallas FlashAttention-2: flash fwd emits f32 lse; dk/dv kernel (GQA group summed in-kernel) + dq kernel recompute P from lse",
        examples=tuple(
            Example(
                name,
                lambda k, dt, sh=sh, kw=kw: (
                    tuple(_normal(jax.random.fold_in(k, i), s, dt) for i, s in enumerate(sh)), dict(kw)
                ),
                (0, 1, 2),
            )
            for name, sh, kw in (
                ("1x12x4:2x16-causal", ((1, 12, 4, 16), (1, 12, 2, 16), (1, 12, 2, 16)), {"is_causal": True}),
                ("2x8:24x4:2x32", ((2, 8, 4, 32), (2, 24, 2, 32), (2, 24, 2, 32)), {}),
                ("1x16x4:1x16-seg3-win4-cap30", ((1, 16, 4, 16), (1, 16, 1, 16), (1, 16, 1, 16)),
                 {"is_causal": True, "segment_ids": jnp.array([[0] * 6 + [1] * 7 + [2] * 3], jnp.int32),
                  "sliding_window": 4, "logit_softcap": 30.0}),
            )
        ),
        lowering=(
            Example("1x8192x32:8x128-bf16-causal", lambda k, d: ((_sds((1, 8192, 32, 128), "bfloat16"), _sds((1, 8192, 8, 128), "bfloat16"), _sds((1, 8192, 8, 128), "bfloat16")), {"is_causal": True})),
            Example("1x4096x32:8x80-bf16-causal", lambda k, d: ((_sds((1, 4096, 32, 80), "bfloat16"), _sds((1, 4096, 8, 80), "bfloat16"), _sds((1, 4096, 8, 80), "bfloat16")), {"is_causal": True})),
            # Gemma 2's attention: head_dim 256, local window, logit softcap 50.
            Example("1x4096x16:8x256-bf16-causal-window-softcap", lambda k, d: ((_sds((1, 4096, 16, 256), "bfloat16"), _sds((1, 4096, 8, 256), "bfloat16"), _sds((1, 4096, 8, 256), "bfloat16")), {"is_causal": True, "sliding_window": 1024, "logit_softcap": 50.0})),
            Example("2x1000x8x64-f32-window-softcap", lambda k, d: ((_sds((2, 1000, 8, 64), "float32"), _sds((2, 1000, 8, 64), "float32"), _sds((2, 1000, 8, 64), "float32")), {"sliding_window": 256, "logit_softcap": 50.0})),
        ),
        bad_inputs=(
            BadInput("head dim", lambda: ((jnp.ones((1, 8, 4, 16)), jnp.ones((1, 8, 2, 32)), jnp.ones((1, 8, 2, 32))), {}), ValueError, r"key must have shape \[B=1, S, K, H=16\].*got \(1, 8, 2, 32\)"),
            BadInput("N % K", lambda: ((jnp.ones((1, 8, 4, 16)), jnp.ones((1, 8, 3, 16)), jnp.ones((1, 8, 3, 16))), {}), ValueError, r"N % K == 0.*got N=4, K=3"),
            BadInput("segment_ids shape", lambda: ((jnp.ones((1, 8, 4, 16)), jnp.ones((1, 8, 2, 16)), jnp.ones((1, 8, 2, 16))), {"segment_ids": jnp.zeros((1, 7), jnp.int32)}), ValueError, r"segment_ids must have shape \(1, 8\).*got \(1, 7\)"),
            BadInput("window <= 0", lambda: ((jnp.ones((1, 8, 4, 16)), jnp.ones((1, 8, 2, 16)), jnp.ones((1, 8, 2, 16))), {"sliding_window": 0}), ValueError, r"sliding_window must be an int >= 1, got 0"),
            BadInput("integer q", lambda: ((jnp.ones((1, 8, 4, 16), jnp.int32), jnp.ones((1, 8, 2, 16)), jnp.ones((1, 8, 2, 16))), {}), TypeError, r"query must have a floating dtype.*got int32"),
        ),
        # fwd 4*B*N*T*S*H (QK^T and PV), bwd 2.5x fwd; causal halves both.
        flops=_attention_flops,
        # The tangent kernel's five products (q k^T again, dq k^T, q dk^T, P dv, (P * dS) v):
        # 2.5x the forward, so forward + tangent is 3.5x as forward + backward.
        jvp_flops=_attention_flops,
        # q, k, v and out (out is q-sized) + f32 lse [B, N, T] + the segment ids (q and kv):
        # O(B*N*T) beyond the arrays, no T x S array.
        residual_budget=lambda q, k, v, segment_ids=None, **_: (
            _nbytes(q, k, v, q) + 4 * q.shape[0] * q.shape[1] * q.shape[2]
            + (2 * _nbytes(segment_ids) if segment_ids is not None else 0)
        ),
        # The tangent pass recomputes P from the saved lse per key block: a few f32
        # [B, N, T, 512] blocks and input-sized arrays, never a [B, N, T, S] array
        # (autodiff of the reference holds several: 641 MB at these shapes, the budget 124 MB).
        jvp_kernels=("attention_jvp",),
        jvp_memory=(
            Example("1x4096x2x32-f32-causal", lambda k, d: (tuple(_sds((1, 4096, 2, 32), "float32") for _ in range(3)), {"is_causal": True})),
            lambda q, k, v, **_: 6 * 4 * q.shape[0] * q.shape[2] * q.shape[1] * min(k.shape[1], 512) + 8 * _nbytes(q, k, v),
        ),
    ),
    OpSpec(
        name="group_norm", family="norms", fn=group_norm_ops.group_norm, reference=ref.group_norm,
        baseline=bl.group_norm,
        diff_argnums=(0, 1, 2), static_params=("num_groups", "eps", "activation"), kernels=("group_norm_bwd_sums", "group_norm_bwd"),
        backward="Pallas: per (sample, spatial chunk) programs over whole-channel pixel rows: f32 partial sums (XLA reduces them in a fixed order), then dx",
        examples=tuple(
            Example(
                f"{'x'.join(map(str, s))}-g{g}-{act}",
                lambda k, dt, s=s, g=g, act=act: (
                    (_normal(k, s, dt), 1.0 + 0.1 * _normal(jax.random.fold_in(k, 1), s[-1:], dt),
                     0.1 * _normal(jax.random.fold_in(k, 2), s[-1:], dt)),
                    {"num_groups": g, "activation": act},
                ),
            )
            # More cases (3-D spatial, several spatial chunks, one group) in tests/test_vision.py.
            for s, g, act in (((2, 5, 7, 24), 4, "silu"), ((3, 11, 12), 3, None))
        ),
        # UNet shapes: [8, 64, 64, 320] with 32 groups (+SiLU), 128x128x256 and 64x64x512 per sample.
        lowering=tuple(
            Example(f"{s}-{dt}-{act}", lambda k, d, s=s, dt=dt, act=act: (
                (_sds(s, dt), _sds(s[-1:], dt), _sds(s[-1:], dt)), {"num_groups": 32, "activation": act}))
            for s, dt, act in (((8, 64, 64, 320), "bfloat16", "silu"), ((2, 128, 128, 256), "float32", None), ((4, 64, 64, 512), "bfloat16", None))
        ),
        bad_inputs=(
            BadInput("groups", lambda: ((jnp.ones((2, 4, 6)), jnp.ones((6,)), jnp.ones((6,))), {"num_groups": 4}), ValueError, r"num_groups must be a positive divisor of x's channel count C=6, got 4"),
            BadInput("weight length", lambda: ((jnp.ones((2, 4, 6)), jnp.ones((5,)), jnp.ones((6,))), {"num_groups": 2}), ValueError, r"weight must have shape \(6,\).*got \(5,\)"),
            BadInput("rank-1 x", lambda: ((jnp.ones((6,)), jnp.ones((6,)), jnp.ones((6,))), {"num_groups": 2}), ValueError, r"x must have rank >= 2.*got shape \(6,\)"),
            BadInput("integer x", lambda: ((jnp.ones((2, 4, 6), jnp.int32), jnp.ones((6,)), jnp.ones((6,))), {"num_groups": 2}), TypeError, r"x must have a floating dtype.*got int32"),
            BadInput("activation", lambda: ((jnp.ones((2, 4, 6)), jnp.ones((6,)), jnp.ones((6,))), {"num_groups": 2, "activation": "gelu"}), ValueError, r"activation must be None or 'silu', got 'gelu'"),
        ),
        # x, weight, bias (aliases of live inputs) plus f32 mean and rstd per (sample, group).
        residual_budget=lambda x, w, b, num_groups, **_: _nbytes(x, w, b) + 8 * x.shape[0] * num_groups,
    ),
    OpSpec(
        name="upsample2d", family="vision", fn=vision.upsample2d, reference=ref.upsample2d, baseline=bl.upsample2d,
        diff_argnums=(0,), static_params=("scale", "method"), kernels=("upsample2d_bwd",),
        backward="Pallas gather form: each dx pixel sums (bilinear: weights x) the dy pixels it feeds, f32, no atomics",
        examples=(
            Example("1x5x7x3-x2-nearest", lambda k, dt: ((_normal(k, (1, 5, 7, 3), dt), 2), {"method": "nearest"})),
            Example("2x5x7x3-x(2,3)-bilinear", lambda k, dt: ((_normal(k, (2, 5, 7, 3), dt), (2, 3)), {"method": "bilinear"})),
            # 96 channels: three 32-wide column blocks; 162 pixels: ragged row blocks.
            Example("2x9x9x96-x2-bilinear", lambda k, dt: ((_normal(k, (2, 9, 9, 96), dt), 2), {"method": "bilinear"})),
        ),
        lowering=tuple(
            Example(f"8x32x32x640-x2-{m}", lambda k, d, m=m: ((_sds((8, 32, 32, 640), "bfloat16"),), {"scale": 2, "method": m}))
            for m in ("nearest", "bilinear")
        ),
        bad_inputs=(
            BadInput("rank", lambda: ((jnp.ones((2, 4, 6)), 2), {}), ValueError, r"x must have rank 4.*got shape \(2, 4, 6\)"),
            BadInput("scale", lambda: ((jnp.ones((1, 2, 2, 1)), 0), {}), ValueError, r"scale must be an int >= 1 or a pair of them, got 0"),
            BadInput("method", lambda: ((jnp.ones((1, 2, 2, 1)), 2), {"method": "bicubic"}), ValueError, r"method must be 'nearest' or 'bilinear', got 'bicubic'"),
            BadInput("integer x", lambda: ((jnp.ones((1, 2, 2, 1), jnp.int32), 2), {}), TypeError, r"x must have a floating dtype"),
        ),
        residual_budget=lambda x, s, **_: 0,
    ),
    OpSpec(
        name="pixel_shuffle", family="vision", fn=vision.pixel_shuffle, reference=ref.pixel_shuffle,
        diff_argnums=(0,), static_params=("upscale_factor",), kernels=("pixel_shuffle_bwd",),
        backward="Pallas: pixel_unshuffle of dy (the inverse permutation), one read and one write; r = 2 interleaves four contiguous channel runs in registers",
        examples=(
            Example("1x2x3x27-r3", lambda k, dt: ((_normal(k, (1, 2, 3, 27), dt), 3), {})),
            Example("2x3x4x40-r2", lambda k, dt: ((_normal(k, (2, 3, 4, 40), dt), 2), {})),
        ),
        lowering=(Example("8x64x64x256-r2", lambda k, d: ((_sds((8, 64, 64, 256), "bfloat16"),), {"upscale_factor": 2})),),
        bad_inputs=(
            BadInput("channels", lambda: ((jnp.ones((1, 2, 2, 6)), 2), {}), ValueError, r"channel count must be divisible by upscale_factor\*\*2=4, got 6"),
            BadInput("factor", lambda: ((jnp.ones((1, 2, 2, 4)), 0), {}), ValueError, r"upscale_factor must be an int >= 1, got 0"),
            BadInput("integer x", lambda: ((jnp.ones((1, 2, 2, 4), jnp.int32), 2), {}), TypeError, r"x must have a floating dtype"),
        ),
        residual_budget=lambda x, r, **_: 0,
    ),
    OpSpec(
        name="unpatchify", family="vision", fn=vision.unpatchify, reference=ref.unpatchify,
        diff_argnums=(0,), static_params=("grid", "patch_size", "channels"), kernels=("unpatchify_bwd",),
        backward="Pallas: patchify of dy (the inverse permutation) as copies of contiguous patch-row runs, one read and one write",
        examples=(
            Example("2x6x12-grid2x3-p2-c3", lambda k, dt: ((_normal(k, (2, 6, 12), dt),), {"grid": (2, 3), "patch_size": 2, "channels": 3})),
        ),
        lowering=tuple(
            Example(f"8x256x16-grid16-p2-c4-{dt}", lambda k, d, dt=dt: ((_sds((8, 256, 16), dt),), {"grid": 16, "patch_size": 2, "channels": 4}))
            for dt in ("float32", "bfloat16")
        ),
        bad_inputs=(
            BadInput("tokens", lambda: ((jnp.ones((1, 5, 12)),), {"grid": 2, "patch_size": 2, "channels": 3}), ValueError, r"tokens.shape\[1\] must equal gh\*gw=4 for grid=\(2, 2\), got 5"),
            BadInput("channels", lambda: ((jnp.ones((1, 4, 8)),), {"grid": 2, "patch_size": 2, "channels": 3}), ValueError, r"tokens.shape\[2\] must equal patch_size\*\*2 \* channels=12, got 8"),
            BadInput("patch_size", lambda: ((jnp.ones((1, 4, 12)),), {"grid": 2, "patch_size": 2.0, "channels": 3}), TypeError, r"patch_size must be a static Python int, got 2.0"),
        ),
        residual_budget=lambda t, **_: 0,
    ),
    OpSpec(
        name="conv2d", family="vision", fn=vision.conv2d, reference=ref.conv2d, baseline=bl.conv2d,
        diff_argnums=(0, 1), static_params=("stride", "padding", "dilation", "groups"),
        kernels=("conv2d_dgrad", "conv2d_wgrad"),
        backward="Pallas implicit GEMMs: dgrad (stride by skipping taps per phase) and wgrad (f32 split-K partials)",
        examples=(
            Example("2x9x11x4*3x3x4x8-pad1", lambda k, dt: (
                (_normal(k, (2, 9, 11, 4), dt), 0.3 * _normal(jax.random.fold_in(k, 1), (3, 3, 4, 8), dt)), {"padding": 1})),
            Example("2x10x9x20*3x3x20x8-s2", lambda k, dt: (
                (_normal(k, (2, 10, 9, 20), dt), 0.3 * _normal(jax.random.fold_in(k, 1), (3, 3, 20, 8), dt)),
                {"padding": 1, "stride": 2})),
            Example("2x8x8x8*1x1x8x12", lambda k, dt: (
                (_normal(k, (2, 8, 8, 8), dt), 0.3 * _normal(jax.random.fold_in(k, 1), (1, 1, 8, 12), dt)), {})),
        ),
        # UNet: 3x3 [8, 64, 64, 320] -> 320 (bf16), its stride-2 downsampler, a 1x1 projection.
        lowering=(
            Example("8x64x64x320*3x3x320x320-bf16", lambda k, d: ((_sds((8, 64, 64, 320), "bfloat16"), _sds((3, 3, 320, 320), "bfloat16")), {"padding": 1})),
            Example("8x64x64x320*3x3x320x320-s2-bf16", lambda k, d: ((_sds((8, 64, 64, 320), "bfloat16"), _sds((3, 3, 320, 320), "bfloat16")), {"padding": 1, "stride": 2})),
            Example("8x32x32x640*1x1x640x320-f32", lambda k, d: ((_sds((8, 32, 32, 640), "float32"), _sds((1, 1, 640, 320), "float32")), {})),
        ),
        bad_inputs=(
            BadInput("w channels", lambda: ((jnp.ones((1, 8, 8, 4)), jnp.ones((3, 3, 4, 8))), {"groups": 2}), ValueError, r"w must have shape \[kh, kw, Cin/groups=2, Cout\], got \(3, 3, 4, 8\)"),
            BadInput("groups", lambda: ((jnp.ones((1, 8, 8, 4)), jnp.ones((3, 3, 1, 6))), {"groups": 3}), ValueError, r"groups must divide x's channel count Cin=4, got groups=3"),
            BadInput("stride", lambda: ((jnp.ones((1, 8, 8, 4)), jnp.ones((3, 3, 4, 8))), {"stride": 0}), ValueError, r"stride must be an int >= 1 or a pair of them, got 0"),
            BadInput("empty kernel", lambda: ((jnp.ones((1, 8, 8, 4)), jnp.ones((0, 3, 4, 8))), {}), ValueError, r"w must have a non-empty kernel height kh, got shape \(0, 3, 4, 8\)"),
            BadInput("padding", lambda: ((jnp.ones((1, 8, 8, 4)), jnp.ones((3, 3, 4, 8))), {"padding": "FULL"}), ValueError, r"padding must be 'SAME', 'VALID'.*got 'FULL'"),
            BadInput("x rank", lambda: ((jnp.ones((8, 8, 4)), jnp.ones((3, 3, 4, 8))), {}), ValueError, r"x must have rank 4.*got shape \(8, 8, 4\)"),
            BadInput("integer x", lambda: ((jnp.ones((1, 8, 8, 4), jnp.int32), jnp.ones((3, 3, 4, 8))), {}), TypeError, r"x must have a floating dtype"),
        ),
        # forward 2*N*Ho*Wo*Cout*kh*kw*Cin/groups, dgrad and wgrad the same each.
        flops=_conv2d_flops,
        # bilinear tangent conv(dx, w) + conv(x, dw): two forwards, so 3 with the forward too.
        jvp_flops=_conv2d_flops,
        # x and w only (aliases of live inputs).
        residual_budget=lambda x, w, **_: _nbytes(x, w),
    ),
]


def _mse_example(shape, reduction, weighted):
    def make(k, dt):
        ks = jax.random.split(k, 3)
        args = (_normal(ks[0], shape, dt), _normal(ks[1], shape, dt))
        if weighted:
            args = args + (jax.random.uniform(ks[2], shape, jnp.float32).astype(dt),)
        return args, {"reduction": reduction}

    return Example(f"{'x'.join(map(str, shape))}-{reduction}{'-weighted' if weighted else ''}", make,
                   (0, 1, 2) if weighted else (0, 1))


# The seed engine's remaining training ops (losses, regularisation, normalisation, pooling).
_SPECS += [
    OpSpec(
        name="mse_loss", family="losses", fn=regression.mse_loss, reference=ref.mse_loss, baseline=bl.mse_loss,
        diff_argnums=(0, 1), static_params=("reduction",), kernels=(),
        backward="XLA by design: one fused pass reads p, t (w), writes dp = 2 c w (p - t), dt = -dp (minimum bytes)",
        examples=(_mse_example((5, 123), "mean", False), _mse_example((2, 3, 96), "sum", True),
                  _mse_example((1, 1, 1023), "none", True)),
        bad_inputs=(
            BadInput("targets shape", lambda: ((jnp.ones((4, 8)), jnp.ones((4, 7))), {}), ValueError, r"targets must have shape \(4, 8\).*got \(4, 7\)"),
            BadInput("weights shape", lambda: ((jnp.ones((4, 8)), jnp.ones((4, 8)), jnp.ones((8,))), {}), ValueError, r"weights must have shape \(4, 8\).*got \(8,\)"),
            BadInput("reduction", lambda: ((jnp.ones((4, 8)), jnp.ones((4, 8))), {"reduction": "avg"}), ValueError, r"reduction must be one of \('mean', 'sum', 'none'\), got 'avg'"),
            BadInput("integer targets", lambda: ((jnp.ones((4, 8)), jnp.ones((4, 8), jnp.int32)), {}), TypeError, r"targets must have a floating dtype.*got int32"),
            BadInput("dtypes", lambda: ((jnp.ones((4, 8)), jnp.ones((4, 8), jnp.bfloat16)), {}), TypeError, r"predictions, targets must share one dtype"),
        ),
        # the inputs only (aliases of live arrays)
        residual_budget=lambda p, t, w=None, **_: _nbytes(p, t) + (0 if w is None else _nbytes(w)),
    ),
    OpSpec(
        name="dropout", family="regularization", fn=dropout_ops.dropout, reference=ref.dropout,
        diff_argnums=(0,), static_params=("rate", "deterministic"), kernels=("dropout_bwd",),
        backward="Pallas: regenerates the mask from the key (counter-based hash of key, row, col) while scaling dy; saves the key only",
        examples=tuple(
            Example(f"{'x'.join(map(str, s))}-rate{r}",
                    lambda k, dt, s=s, r=r: ((_normal(k, s, dt), r), {"rng": jax.random.PRNGKey(7)}))
            for s, r in ((ROW_SHAPES[1], 0.1), (ROW_SHAPES[0], 0.5), (ROW_SHAPES[2], 0.9))
        ),
        lowering=tuple(
            Example(f"{s}-{dt}", lambda k, d, s=s, dt=dt: ((_sds(s, dt),), {"rate": 0.1, "rng": jax.random.PRNGKey(0)}))
            for s, dt in ROW_LOWERING[:2]
        ),
        bad_inputs=(
            BadInput("rate", lambda: ((jnp.ones((4, 8)), 1.5), {"rng": jax.random.PRNGKey(0)}), ValueError, r"rate must be in \[0, 1\], got 1.5"),
            BadInput("no rng", lambda: ((jnp.ones((4, 8)), 0.5), {}), ValueError, r"rng must be a jax.random key when deterministic is False, got None"),
            BadInput("rng shape", lambda: ((jnp.ones((4, 8)), 0.5), {"rng": jnp.zeros((4,), jnp.uint32)}), ValueError, r"rng must be a threefry key \(key data uint32 \[2\]\), got key data uint32 \(4,\)"),
            BadInput("deterministic", lambda: ((jnp.ones((4, 8)), 0.5), {"deterministic": 1}), TypeError, r"deterministic must be a Python bool, got 1"),
            BadInput("integer x", lambda: ((jnp.ones((4, 8), jnp.int32), 0.5), {"rng": jax.random.PRNGKey(0)}), TypeError, r"x must have a floating dtype"),
        ),
        residual_budget=lambda x, rate, **_: 8,  # the key's two uint32 words
    ),
    OpSpec(
        name="bias_dropout_add", family="regularization", fn=dropout_ops.bias_dropout_add,
        reference=ref.bias_dropout_add, diff_argnums=(0, 1, 2), static_params=("rate", "deterministic"),
        kernels=("bias_dropout_add_bwd",),
        backward=("Pallas: `residual + dropout(x + bias)`; one pass over dy regenerates the mask, writes dx and sums "
                  "dbias in f32 (2 passes of x's bytes where `dropout` then `bias_add` take 3); dresidual = dy; "
                  "saves the key only"),
        examples=tuple(
            Example(f"{'x'.join(map(str, s))}-rate{r}",
                    lambda k, dt, s=s, r=r: ((_normal(k, s, dt), _normal(jax.random.fold_in(k, 1), s[-1:], dt),
                                             _normal(jax.random.fold_in(k, 2), s, dt), r), {"rng": jax.random.PRNGKey(7)}))
            for s, r in ((ROW_SHAPES[1], 0.1), (ROW_SHAPES[0], 0.5), (ROW_SHAPES[2], 0.9))
        ),
        lowering=tuple(
            Example(f"{s}-{dt}", lambda k, d, s=s, dt=dt: ((_sds(s, dt), _sds(s[-1:], dt), _sds(s, dt)),
                                                          {"rate": 0.1, "rng": jax.random.PRNGKey(0)}))
            for s, dt in ROW_LOWERING[:2]
        ),
        bad_inputs=(
            BadInput("rate", lambda: ((jnp.ones((4, 8)), jnp.ones((8,)), jnp.ones((4, 8)), 1.5), {"rng": jax.random.PRNGKey(0)}), ValueError, r"rate must be in \[0, 1\], got 1.5"),
            BadInput("no rng", lambda: ((jnp.ones((4, 8)), jnp.ones((8,)), jnp.ones((4, 8)), 0.5), {}), ValueError, r"rng must be a jax.random key when deterministic is False, got None"),
            BadInput("bias length", lambda: ((jnp.ones((4, 8)), jnp.ones((3,)), jnp.ones((4, 8)), 0.5), {"rng": jax.random.PRNGKey(0)}), ValueError, r"bias must have shape \(8,\).*got \(3,\)"),
            BadInput("residual shape", lambda: ((jnp.ones((4, 8)), jnp.ones((8,)), jnp.ones((8,)), 0.5), {"rng": jax.random.PRNGKey(0)}), ValueError, r"residual must have shape \(4, 8\).*got \(8,\)"),
            BadInput("residual dtype", lambda: ((jnp.ones((4, 8)), jnp.ones((8,)), jnp.ones((4, 8), jnp.bfloat16), 0.5), {"rng": jax.random.PRNGKey(0)}), TypeError, r"x, residual must share one dtype"),
            BadInput("integer x", lambda: ((jnp.ones((4, 8), jnp.int32), jnp.ones((8,)), jnp.ones((4, 8)), 0.5), {"rng": jax.random.PRNGKey(0)}), TypeError, r"x must have a floating dtype"),
        ),
        residual_budget=lambda *a, **_: 8,  # the key's two uint32 words
    ),
    OpSpec(
        name="batch_norm", family="norms", fn=batch_norm_ops.batch_norm, reference=ref.batch_norm,
        baseline=bl.batch_norm,
        diff_argnums=(0, 1, 2), static_params=("eps", "momentum", "training", "axis", "axis_name"),
        kernels=("batch_norm_bwd_reduce", "batch_norm_bwd_dx"),
        backward="Pallas: f32 per-channel sums of dy, dy*x_hat from saved mean/rstd (dbias, dweight; partials, no atomics), then dx",
        examples=tuple(
            Example(f"{'x'.join(map(str, s))}-axis{ax}",
                    lambda k, dt, s=s, ax=ax: (
                        (_normal(k, s, dt), 1.0 + 0.1 * _normal(jax.random.fold_in(k, 1), s[ax:][:1], dt),
                         0.1 * _normal(jax.random.fold_in(k, 2), s[ax:][:1], dt)), {"axis": ax}))
            for s, ax in (((4, 5, 6, 24), -1), ((3, 7, 130), -1), ((2, 6, 5, 5), 1))
        ),
        # ResNet-50 activations: 64 channels at 112x112, 256 at 56x56, 2048 at 7x7 (batch 32).
        lowering=tuple(
            Example(f"{s}-{dt}", lambda k, d, s=s, dt=dt: ((_sds(s, dt), _sds(s[-1:], dt), _sds(s[-1:], dt)), {}))
            for s, dt in (((32, 112, 112, 64), "bfloat16"), ((32, 56, 56, 256), "float32"), ((32, 7, 7, 2048), "bfloat16"))
        ),
        bad_inputs=(
            BadInput("weight length", lambda: ((jnp.ones((2, 4, 6)), jnp.ones((5,)), jnp.ones((6,))), {}), ValueError, r"weight must have shape \(6,\).*got \(5,\)"),
            BadInput("rank-1 x", lambda: ((jnp.ones((6,)), jnp.ones((6,)), jnp.ones((6,))), {}), ValueError, r"x must have rank >= 2.*got shape \(6,\)"),
            BadInput("one running stat", lambda: ((jnp.ones((2, 6)), jnp.ones((6,)), jnp.ones((6,))), {"running_mean": jnp.zeros((6,))}), ValueError, r"give both running_mean and running_var or neither"),
            BadInput("unbound axis_name", lambda: ((jnp.ones((2, 6)), jnp.ones((6,)), jnp.ones((6,))), {"axis_name": "batch"}), ValueError, r"axis_name must name an axis bound by an enclosing shard_map, pmap or vmap, got 'batch'"),
            BadInput("empty batch", lambda: ((jnp.ones((0, 6)), jnp.ones((6,)), jnp.ones((6,))), {}), ValueError, r"training=True needs at least one element per channel.*got x of shape \(0, 6\)"),
            BadInput("no channels", lambda: ((jnp.ones((2, 0)), jnp.ones((0,)), jnp.ones((0,))), {}), ValueError, r"x must have a non-empty channel axis 1, got shape \(2, 0\)"),
            BadInput("eval without stats", lambda: ((jnp.ones((2, 6)), jnp.ones((6,)), jnp.ones((6,))), {"training": False}), ValueError, r"training=False normalises with running_mean and running_var; got None"),
            BadInput("momentum", lambda: ((jnp.ones((2, 6)), jnp.ones((6,)), jnp.ones((6,))), {"momentum": 1.5}), ValueError, r"momentum must be in \[0, 1\], got 1.5"),
            BadInput("eps", lambda: ((jnp.ones((2, 6)), jnp.ones((6,)), jnp.ones((6,))), {"eps": 0.0}), ValueError, r"eps must be a positive number, got 0.0"),
            BadInput("integer x", lambda: ((jnp.ones((2, 6), jnp.int32), jnp.ones((6,)), jnp.ones((6,))), {}), TypeError, r"x must have a floating dtype.*got int32"),
        ),
        # x, weight (aliases of live inputs) plus f32 mean and rstd per channel.
        residual_budget=lambda x, w, b, axis=-1, **_: _nbytes(x, w) + 8 * x.shape[axis],
    ),
    OpSpec(
        name="max_pool2d", family="vision", fn=pooling.max_pool2d, reference=ref.max_pool2d, baseline=bl.max_pool2d,
        diff_argnums=(0,), static_params=("window_shape", "strides", "padding"), kernels=("max_pool2d_bwd",),
        backward="Pallas gather form: each dx element sums the dy of the windows whose saved int8 first-max offset names it (no atomics)",
        examples=(
            Example("2x9x11x3-w3-s2-SAME", lambda k, dt: ((_normal(k, (2, 9, 11, 3), dt), 3, 2, "SAME"), {})),
            Example("1x8x8x5-w(2,3)-s(2,1)", lambda k, dt: ((_normal(k, (1, 8, 8, 5), dt), (2, 3), (2, 1)), {})),
            Example("1x7x6x2-w3-s2-pad", lambda k, dt: ((_normal(k, (1, 7, 6, 2), dt), 3, 2, ((1, 0), (2, 1))), {})),
        ),
        bad_inputs=(
            BadInput("rank", lambda: ((jnp.ones((4, 4, 3)), 2), {}), ValueError, r"x must have rank 4 \(\[N, H, W, C\]\), got shape \(4, 4, 3\)"),
            BadInput("window", lambda: ((jnp.ones((1, 4, 4, 3)), 0), {}), ValueError, r"window_shape must be an int >= 1 or a pair of them, got 0"),
            BadInput("padding", lambda: ((jnp.ones((1, 4, 4, 3)), 2, 1, "FULL"), {}), ValueError, r"padding must be 'SAME', 'VALID'"),
            BadInput("window too big", lambda: ((jnp.ones((1, 2, 2, 3)), 3), {}), ValueError, r"window_shape \(3, 3\) is larger than the padded input \(2, 2\)"),
            BadInput("integer x", lambda: ((jnp.ones((1, 4, 4, 3), jnp.int32), 2), {}), TypeError, r"x must have a floating dtype"),
        ),
        # ResNet's stem pool (3x3, stride 2, SAME at 112x112x64) and a VGG-style 2x2 pool.
        lowering=(
            Example("32x112x112x64-w3-s2-SAME-bf16", lambda k, d: ((_sds((32, 112, 112, 64), "bfloat16"),), {"window_shape": 3, "strides": 2, "padding": "SAME"})),
            Example("16x56x56x256-w2-s2-f32", lambda k, d: ((_sds((16, 56, 56, 256), "float32"),), {"window_shape": 2, "strides": 2})),
        ),
        # one int8 offset per output element (x and y are not kept)
        residual_budget=lambda x, w, strides=None, padding="VALID", **_: ref.max_pool2d(x, w, strides, padding).size,
    ),
    OpSpec(
        name="avg_pool2d", family="vision", fn=pooling.avg_pool2d, reference=ref.avg_pool2d, baseline=bl.avg_pool2d,
        diff_argnums=(0,), static_params=("window_shape", "strides", "padding", "count_include_pad"), kernels=(),
        backward="XLA gather form: dy / count spread over each window by interior-padded pads, summed (no scatter, no atomics)",
        examples=(
            Example("2x9x11x3-w3-s2-SAME", lambda k, dt: ((_normal(k, (2, 9, 11, 3), dt), 3, 2, "SAME"), {})),
            Example("1x7x6x2-w3-s2-pad-exclude", lambda k, dt: ((_normal(k, (1, 7, 6, 2), dt), 3, 2, ((1, 0), (2, 1)), False), {})),
        ),
        bad_inputs=(
            BadInput("strides", lambda: ((jnp.ones((1, 4, 4, 3)), 2, (1, 0)), {}), ValueError, r"strides must be an int >= 1 or a pair of them, got \(1, 0\)"),
            BadInput("count_include_pad", lambda: ((jnp.ones((1, 4, 4, 3)), 2), {"count_include_pad": 1}), TypeError, r"count_include_pad must be a Python bool, got 1"),
        ),
        residual_budget=lambda x, *a, **_: 0,
    ),
    OpSpec(
        name="adaptive_avg_pool2d", family="vision", fn=pooling.adaptive_avg_pool2d, reference=ref.adaptive_avg_pool2d,
        diff_argnums=(0,), static_params=("output_size",), kernels=(),
        backward="XLA dots: dx = A_h^T dy A_w with the constant averaging matrices",
        examples=(
            Example("2x9x11x3-to(4,3)", lambda k, dt: ((_normal(k, (2, 9, 11, 3), dt), (4, 3)), {})),
            Example("1x5x5x4-to1", lambda k, dt: ((_normal(k, (1, 5, 5, 4), dt), 1), {})),
        ),
        bad_inputs=(
            BadInput("output_size", lambda: ((jnp.ones((1, 4, 4, 3)), (2, 0)), {}), ValueError, r"output_size must be an int >= 1 or a pair of them, got \(2, 0\)"),
            BadInput("rank", lambda: ((jnp.ones((4, 4, 3)), 2), {}), ValueError, r"x must have rank 4"),
            BadInput("empty H", lambda: ((jnp.ones((1, 0, 4, 3)), 2), {}), ValueError, r"x must have a non-empty height H, got shape \(1, 0, 4, 3\)"),
            BadInput("no output_size", lambda: ((jnp.ones((1, 4, 4, 3)), None), {}), ValueError, r"output_size must be an int >= 1 or a pair of them, got None"),
        ),
        # the two f32 averaging matrices (constants the op's einsum keeps under jax.vjp)
        residual_budget=lambda x, size, **_: 4 * (x.shape[1] + x.shape[2]) * 8,
    ),
]

def _lce_example(name, lead, D, V, transpose_w=False, weights=False, **kw):
    """x [*lead, D], w [D, V] (or [V, D]), labels with an ignored and an out-of-range token."""
    def make(k, dt):
        kx, kw_, kl, kwt = jax.random.split(k, 4)
        x = _normal(kx, lead + (D,), dt)
        w = (D ** -0.5 * 3.0 * _normal(kw_, (V, D) if transpose_w else (D, V), jnp.float32)).astype(dt)
        labels = jax.random.randint(kl, lead, 0, V).reshape(-1).at[1].set(-100).at[-1].set(V).reshape(lead)
        extra = {"weights": jax.random.uniform(kwt, lead, jnp.float32, 0.0, 2.0)} if weights else {}
        return (x, w, labels), dict(kw, transpose_w=transpose_w, **extra)

    return Example(name, make, (0,))


def _lce_lowering(T, D, V, dt, **kw):
    transpose_w = kw.get("transpose_w", False)
    return Example(f"{T}x{D}@{V}-{dt}" + ("-tied" if transpose_w else ""), lambda k, d: (
        (_sds((T, D), dt), _sds((V, D) if transpose_w else (D, V), dt), _sds((T,), "int32")), dict(kw)))


_SPECS.append(OpSpec(
    name="linear_cross_entropy", family="losses", fn=lce.linear_cross_entropy, reference=ref.linear_cross_entropy,
    baseline=bl.linear_cross_entropy,
    diff_argnums=(0, 1),
    static_params=("ignore_index", "label_smoothing", "z_loss", "logit_softcap", "weights", "reduction",
                   "return_aux", "transpose_w"),
    kernels=("linear_cross_entropy_fwd", "linear_cross_entropy_bwd_dx", "linear_cross_entropy_bwd_dw"),
    backward="Pallas: fwd lse over (token block, vocab split) tiles; dx kernel over token blocks, dw kernel over "
             "vocab blocks (a persistent grid), both recompute the logit tiles from x, w and the saved max/sum "
             "(no [tokens, V] array)",
    examples=(
        _lce_example("6x24@24x37-mean", (6,), 24, 37),
        _lce_example("2x3x32@32x50-smooth-z-cap-weights-sum", (2, 3), 32, 50, weights=True,
                     label_smoothing=0.1, z_loss=1e-3, logit_softcap=3.0, reduction="sum"),
        _lce_example("19x16@37x16-tied-weights-none", (19,), 16, 37, transpose_w=True, weights=True,
                     reduction="none", z_loss=1e-2),
        _lce_example("4x16@16x130-mean", (4,), 16, 130),
    ),
    lowering=(
        _lce_lowering(8192, 2048, 128256, "bfloat16"),
        _lce_lowering(8192, 4096, 32000, "bfloat16", transpose_w=True),
        _lce_lowering(8192, 4096, 151936, "bfloat16", label_smoothing=0.1, z_loss=1e-4),
        _lce_lowering(8192, 2048, 256000, "bfloat16", logit_softcap=30.0, reduction="sum"),
        _lce_lowering(4093, 2048, 32000, "float32"),
    ),
    bad_inputs=(
        BadInput("labels shape", lambda: ((jnp.ones((4, 8)), jnp.ones((8, 5)), jnp.zeros((3,), jnp.int32)), {}), ValueError, r"labels must have shape \(4,\).*got \(3,\)"),
        BadInput("float labels", lambda: ((jnp.ones((4, 8)), jnp.ones((8, 5)), jnp.zeros((4,))), {}), TypeError, r"labels must have an integer dtype.*got float32"),
        BadInput("integer x", lambda: ((jnp.ones((4, 8), jnp.int32), jnp.ones((8, 5)), jnp.zeros((4,), jnp.int32)), {}), TypeError, r"x must have a floating dtype.*got int32"),
        BadInput("w inner dim", lambda: ((jnp.ones((4, 8)), jnp.ones((7, 5)), jnp.zeros((4,), jnp.int32)), {}), ValueError, r"w must have shape \[D=8, V\] to match x's last dim, got \(7, 5\)"),
        BadInput("tied w inner dim", lambda: ((jnp.ones((4, 8)), jnp.ones((8, 5)), jnp.zeros((4,), jnp.int32)), {"transpose_w": True}), ValueError, r"w must have shape \[V, D=8\] to match x's last dim, got \(8, 5\)"),
        BadInput("w rank", lambda: ((jnp.ones((4, 8)), jnp.ones((8,)), jnp.zeros((4,), jnp.int32)), {}), ValueError, r"w must have rank 2"),
        BadInput("reduction", lambda: ((jnp.ones((4, 8)), jnp.ones((8, 5)), jnp.zeros((4,), jnp.int32)), {"reduction": "avg"}), ValueError, r"reduction must be one of 'mean', 'sum', 'none', got 'avg'"),
        BadInput("label_smoothing", lambda: ((jnp.ones((4, 8)), jnp.ones((8, 5)), jnp.zeros((4,), jnp.int32)), {"label_smoothing": 1.5}), ValueError, r"label_smoothing must be in \[0, 1\], got 1.5"),
        BadInput("z_loss", lambda: ((jnp.ones((4, 8)), jnp.ones((8, 5)), jnp.zeros((4,), jnp.int32)), {"z_loss": -1.0}), ValueError, r"z_loss must be >= 0, got -1.0"),
        BadInput("logit_softcap", lambda: ((jnp.ones((4, 8)), jnp.ones((8, 5)), jnp.zeros((4,), jnp.int32)), {"logit_softcap": 0.0}), ValueError, r"logit_softcap must be None or > 0, got 0.0"),
        BadInput("weights shape", lambda: ((jnp.ones((4, 8)), jnp.ones((8, 5)), jnp.zeros((4,), jnp.int32)), {"weights": jnp.ones((5,))}), ValueError, r"weights must have shape \(4,\).*got \(5,\)"),
        BadInput("integer weights", lambda: ((jnp.ones((4, 8)), jnp.ones((8, 5)), jnp.zeros((4,), jnp.int32)), {"weights": jnp.ones((4,), jnp.int32)}), TypeError, r"weights must have a floating dtype.*got int32"),
        BadInput("ignore_index", lambda: ((jnp.ones((4, 8)), jnp.ones((8, 5)), jnp.zeros((4,), jnp.int32)), {"ignore_index": 1.0}), TypeError, r"ignore_index must be a static Python int, got 1.0"),
        BadInput("transpose_w", lambda: ((jnp.ones((4, 8)), jnp.ones((8, 5)), jnp.zeros((4,), jnp.int32)), {"transpose_w": "yes"}), TypeError, r"transpose_w must be a bool, got 'yes'"),
    ),
    # Pallas: forward 2RDV, backward two logit recomputations (2 x 2RDV) and dx, dw (2 x 2RDV).
    flops=lambda x, w, labels, **_: 10.0 * x.size * (w.size // x.shape[-1]),
    # forward 2RDV; tangent: the logits recomputed, dx w and x dw (3 x 2RDV).
    jvp_flops=lambda x, w, labels, **_: 8.0 * x.size * (w.size // x.shape[-1]),
    # x and w (aliases of live inputs), int32 labels and the f32 max and sum per token, plus
    # [tokens] vectors of the weighting and reduction outside the primitive: O(tokens).
    residual_budget=lambda x, w, labels, **_: _nbytes(x, w) + 32 * _rows(x),
))

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
        import difflib

        lower = {n.lower(): n for n in REGISTRY}
        close = difflib.get_close_matches(name.lower(), list(lower), n=1)
        hint = (f" (did you mean {lower[close[0]]!r}?)" if close else
                " (a user op is named module:ATTR or path/file.py:ATTR)" if "/" in name or name.endswith(".py") else "")
        raise KeyError(f"jaxbwd: unknown op {name!r}{hint}; known: {', '.join(sorted(REGISTRY))}") from None


def ops(names: Optional[Sequence[str]] = None) -> list[OpSpec]:
    """Specs in registry order, optionally restricted to ``names`` (in their order, each op
    once); a name ``module:ATTR`` (or ``path/file.py:ATTR``) loads and registers the user's
    spec(s) there (see :func:`load`)."""
    if not names:
        return list(REGISTRY.values())
    chosen = [n for name in names for n in (load(name) if ":" in name else [name])]
    return [get(n) for n in dict.fromkeys(chosen)]


# Import paths loaded so far; compile workers (other processes) load them again from here.
LOADED_ENV = "JAXBWD_LOADED_OPS"
_LOADED_FROM: dict[str, str] = {}  # user op name -> the import path that registered it


def load(path: str) -> list[str]:
    """Registers the OpSpec (or sequence of OpSpecs) at ``module:ATTR`` or ``file.py:ATTR``.

    Returns the op names. Loading the same spec again is a no-op; the path is remembered in
    the environment (``JAXBWD_LOADED_OPS``) so that worker processes can load it too.

    Raises:
      KeyError: the module or attribute cannot be found, or it holds no OpSpec.
      ValueError: the op's name is one of jaxbwd's own ops or of a user op loaded from
        another attribute, two ops at ``path`` share a name, the module has a syntax error or
        calls ``sys.exit`` when imported, or raised ValueError while importing (its message,
        then the path). Any other exception raised importing the module propagates, with a
        note naming the path.
    """
    import importlib
    import importlib.util
    import os

    mod_name, _, attr = path.rpartition(":")
    try:
        if mod_name.endswith(".py"):
            mspec = importlib.util.spec_from_file_location(os.path.basename(mod_name)[:-3], mod_name)
            if mspec is None or not os.path.exists(mod_name):
                raise ImportError(f"no file {mod_name}")
            module = importlib.util.module_from_spec(mspec)
            mspec.loader.exec_module(module)
        else:
            module = importlib.import_module(mod_name)
    except ImportError as e:
        raise KeyError(f"jaxbwd: cannot import {mod_name!r} for --ops {path}: {e}") from None
    except SyntaxError as e:
        raise ValueError(f"jaxbwd: importing {mod_name!r} for --ops {path}: syntax error: {e}") from None
    except SystemExit as e:  # else `check` would end silently with the module's status, 0 a pass
        code = "" if e.code is None else repr(e.code)
        raise ValueError(f"jaxbwd: importing {mod_name!r} for --ops {path} called sys.exit({code})") from None
    except ValueError as e:  # shown as one line by the CLI: say where it came from
        raise ValueError(f"{e} (raised importing {mod_name!r} for --ops {path})") from e
    except Exception as e:  # the user's own code failed: its traceback, with where it was loaded
        e.add_note(f"(raised importing {mod_name!r} for --ops {path})")
        raise
    if not hasattr(module, attr):
        raise KeyError(f"jaxbwd: {mod_name} has no attribute {attr!r} (--ops {path})")
    value = getattr(module, attr)
    specs = [value] if isinstance(value, OpSpec) else list(value) if isinstance(value, (list, tuple)) else []
    if isinstance(value, (list, tuple)) and not value:
        raise KeyError(f"jaxbwd: {path} is an empty {type(value).__name__}: it must hold at least one OpSpec")
    if not specs or not all(isinstance(s, OpSpec) for s in specs):
        raise KeyError(f"jaxbwd: {path} must be a jaxbwd.registry.OpSpec or a sequence of them, "
                       f"got {type(value).__name__}")
    names = [s.name for s in specs]
    for s in specs:
        if names.count(s.name) > 1:
            raise ValueError(f"jaxbwd.registry: {path} holds {names.count(s.name)} ops named {s.name!r}; "
                             "each op needs its own name")
        if REGISTRY.get(s.name) is not s:
            # A module loaded twice (as a file and as a module) makes equal specs, not the same
            # object: the same attribute may register a name again, another one may not.
            if s.name in REGISTRY and REGISTRY[s.name].family != "user":
                raise ValueError(f"jaxbwd.registry: op {s.name!r} from {path} clashes with jaxbwd's own op")
            earlier = _LOADED_FROM.get(s.name)
            if earlier is not None and earlier.rpartition(":")[2] != attr:
                raise ValueError(f"jaxbwd.registry: op {s.name!r} from {path} has the name of the op "
                                 f"loaded from {earlier}; each op needs its own name")
            REGISTRY[s.name] = s
            _LOADED_FROM[s.name] = path
    loaded = [p for p in os.environ.get(LOADED_ENV, "").split(",") if p]
    if path not in loaded:
        os.environ[LOADED_ENV] = ",".join(loaded + [path])
    return [s.name for s in specs]


def load_from_env() -> None:
    """Loads every import path recorded by :func:`load` (in a worker process)."""
    import os

    for path in os.environ.get(LOADED_ENV, "").split(","):
        if path:
            load(path)
