"""silu, gelu, relu, leaky_relu, sigmoid, tanh, swiglu, gated_linear_unit, glu and softmax:
custom-derivative ops with fused backward kernels.

Forward (XLA): computed in float32 (float64 stays float64), output in the input's dtype.
Saved for the backward: the inputs only, nothing derived (the activation is recomputed,
which costs no extra memory traffic in a pass that reads the inputs anyway); relu, sigmoid,
tanh and softmax save only their output y, since their gradients need nothing else. The
unary ops (silu, gelu, relu, leaky_relu, sigmoid, tanh) come from the elementwise factory
(``jaxbwd/vjp/elementwise.py``). Backward: the Pallas kernels in
``jaxbwd/pallas/activations.py`` or the same formulas in XLA, both built on that file's
derivative functions.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxbwd.pallas import activations as kernels
from jaxbwd.vjp import _base as B
from jaxbwd.vjp._derivatives import custom_op
from jaxbwd.vjp.elementwise import Elementwise
from jaxbwd import sharding as S


def _cf(x):
    """The compute dtype: float32, or float64 when the input is float64 (numerical checks)."""
    return x.astype(jnp.float64 if x.dtype == jnp.float64 else jnp.float32)


def _act(activation, x):
    if activation == "silu":
        return x * jax.nn.sigmoid(x)
    return jax.nn.gelu(x, approximate=activation == "gelu")


def _clamp(gate, up, limit):
    """``min(gate, limit)``, ``clip(up, -limit, limit)``; a value equal to the limit keeps
    its derivative, as under torch.clamp (gpt-oss's reference): autodiff of
    jnp.minimum/clip would halve it there."""
    if limit is None:
        return gate, up
    # written as "replace where beyond" so that NaN passes through, as through min/clip
    g = jnp.where(gate > limit, limit, gate)
    return g, jnp.where(jnp.abs(up) > limit, jnp.sign(up) * limit, up)


def _check_limit(op, limit):
    if limit is None:
        return None
    B.check_static_number(op, "limit", limit)
    B.check_positive(op, "limit", limit)
    return float(limit)


# ------------------------------------------------- elementwise ops from the factory
_SILU = Elementwise("silu", lambda x: _act("silu", x), lambda x: kernels.silu_and_grad(x)[1],
                    cost=lambda: kernels.BWD_COST["silu"])
_GELU = Elementwise(
    "gelu", lambda x, approximate: jax.nn.gelu(x, approximate=approximate),
    lambda x, approximate: kernels.gelu_and_grad(x, approximate=approximate, erfc=jax.lax.erfc)[1],
    kernel_derivative=lambda x, approximate: kernels.gelu_and_grad(x, approximate=approximate)[1],
    cost=lambda approximate: kernels.BWD_COST["gelu" if approximate else "gelu_exact"])
_RELU = Elementwise("relu", lambda x: jnp.maximum(x, 0), kernels.relu_grad, saves="output",
                    cost=lambda **_: kernels.BWD_COST["relu"])
_LEAKY_RELU = Elementwise("leaky_relu", lambda x, negative_slope: jnp.where(x >= 0, x, negative_slope * x),
                          kernels.leaky_relu_grad, saves="branch", cost=lambda **_: kernels.BWD_COST["leaky_relu"])
_SIGMOID = Elementwise("sigmoid", jax.nn.sigmoid, kernels.sigmoid_grad, saves="output",
                       cost=lambda **_: kernels.BWD_COST["sigmoid"])
_TANH = Elementwise("tanh", jnp.tanh, kernels.tanh_grad, saves="output", cost=lambda **_: kernels.BWD_COST["tanh"])


def silu(x, *, implementation=None):
    """SiLU (swish): ``x * sigmoid(x)``, elementwise.

    Args:
      x: [...] float32, bfloat16 or float16 (float64 on the XLA path); any shape, including scalars.
      implementation: ``None`` (Pallas on GPU, XLA elsewhere), ``"pallas"`` or ``"xla"``.

    Returns:
      [...] in x's dtype, computed in float32.

    Residuals: x. Backward: ``dx = dy * s * (1 + x * (1 - s))``, ``s = sigmoid(x)``, one
    fused elementwise kernel (``silu_bwd``). Finite for every finite x.

    Raises:
      TypeError: x not a floating array.
      ValueError: unknown implementation.
      Also the errors common to every op (``help(jaxbwd)``).

    Source: Elfwing, Uchibe & Doya, "Sigmoid-Weighted Linear Units for Neural Network
    Function Approximation in Reinforcement Learning" (2017); Ramachandran, Zoph & Le,
    "Searching for Activation Functions" (2017).
    """
    op = "silu"
    B.check_float(op, "x", x)
    return _SILU.partitioned(x, B.impl(implementation, op, x))


def gelu(x, *, approximate=True, implementation=None):
    """GELU, ``x * Phi(x)``, elementwise; the tanh approximation when ``approximate``.

    Args:
      x: [...] float32, bfloat16 or float16 (float64 on the XLA path).
      approximate: bool. ``True``: ``x/2 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x**3)))``
        (GPT-2, ``jax.nn.gelu``'s default); ``False``: exact, ``Phi`` the normal CDF.
      implementation: ``None`` (Pallas on GPU, XLA elsewhere), ``"pallas"`` or ``"xla"``.

    Returns:
      [...] in x's dtype, computed in float32.

    Residuals: x. Backward: one fused elementwise kernel (``gelu_bwd``); the exact form's
    ``Phi(x) = erfc(-x / sqrt(2)) / 2`` uses, in the kernel, a Chebyshev fit of erfc
    (Numerical Recipes' ``erfcc``, relative error about 1e-7, 1e-5 in the far tail), since
    Triton has none; relative-accurate for x << 0, where ``(1 + erf) / 2`` would cancel.

    Raises:
      TypeError: x not floating; approximate not a bool.
      ValueError: unknown implementation.
      Also the errors common to every op (``help(jaxbwd)``).

    Source: Hendrycks & Gimpel, "Gaussian Error Linear Units (GELUs)" (2016).
    """
    op = "gelu"
    B.check_float(op, "x", x)
    if not isinstance(approximate, (bool, np.bool_)):
        raise TypeError(f"jaxbwd.gelu: approximate must be a Python bool, got {approximate!r}")
    return _GELU.partitioned(x, B.impl(implementation, op, x), approximate=bool(approximate))


def relu(x, *, implementation=None):
    """ReLU, ``max(x, 0)``, elementwise, as ``jax.nn.relu`` (gradient 0 at x = 0).

    Args:
      x: [...] float32, bfloat16 or float16 (float64 on the XLA path); any shape.
      implementation: ``None`` (Pallas on GPU, XLA elsewhere), ``"pallas"`` or ``"xla"``.

    Returns:
      [...] in x's dtype.

    Residuals: the output y only (``y > 0`` is the derivative; the next layer usually keeps
    y anyway, so the residual is shared). Backward: ``dx = dy * (y > 0)``; the Pallas kernel
    ``relu_bwd`` or the same in XLA. A kernel does not pay here: XLA's backward is one loop
    fusion reading y and dy and writing dx, the minimum bytes; ``relu_bwd`` moves the same.
    It exists because the elementwise factory gives every such op one (one formula, one
    switch); on GPU prefer ``implementation="xla"`` where relu's backward can fuse into a
    neighbour.

    Raises:
      TypeError: x not a floating array.
      ValueError: unknown implementation.
      Also the errors common to every op (``help(jaxbwd)``).

    Source: Nair & Hinton, "Rectified Linear Units Improve Restricted Boltzmann Machines" (2010).
    """
    op = "relu"
    B.check_float(op, "x", x)
    return _RELU.partitioned(x, B.impl(implementation, op, x))


def leaky_relu(x, negative_slope=0.01, *, implementation=None):
    """Leaky ReLU as ``jax.nn.leaky_relu``: ``x`` where ``x >= 0``, else ``negative_slope * x``.

    Args:
      x: [...] float32, bfloat16 or float16 (float64 on the XLA path).
      negative_slope: a static Python number (default 0.01, jax.nn's); any real value.
      implementation: ``None`` (Pallas on GPU, XLA elsewhere), ``"pallas"`` or ``"xla"``.

    Returns:
      [...] in x's dtype, computed in float32.

    Residuals: the branch, one int8 per element (+1 where x >= 0, -1 elsewhere, NaN
    included), as autodiff of ``jnp.where`` keeps a one-byte mask (the output would not
    tell the branch for ``negative_slope <= 0``, nor where ``negative_slope * x``
    underflows to 0). Backward: ``dx = dy * (1 if x >= 0 else negative_slope)``, kernel
    ``leaky_relu_bwd`` or XLA. As for :func:`relu`, the kernel moves the same bytes as XLA's fused backward and
    does not pay in time.

    Raises:
      TypeError: x not floating; negative_slope traced or not a real number.
      ValueError: negative_slope NaN or infinite; unknown implementation.
      Also the errors common to every op (``help(jaxbwd)``).

    Source: Maas, Hannun & Ng, "Rectifier Nonlinearities Improve Neural Network Acoustic
    Models" (2013).
    """
    op = "leaky_relu"
    B.check_float(op, "x", x)
    slope = B.check_static_number(op, "negative_slope", negative_slope)
    return _LEAKY_RELU.partitioned(x, B.impl(implementation, op, x), negative_slope=slope)


def sigmoid(x, *, implementation=None):
    """Logistic sigmoid ``1 / (1 + exp(-x))``, elementwise, as ``jax.nn.sigmoid``.

    Args:
      x: [...] float32, bfloat16 or float16 (float64 on the XLA path).
      implementation: ``None`` (Pallas on GPU, XLA elsewhere), ``"pallas"`` or ``"xla"``.

    Returns:
      [...] in x's dtype, computed in float32.

    Residuals: the output y only. Backward: ``dx = dy * y * (1 - y)``, kernel
    ``sigmoid_bwd`` or XLA; no transcendental in the backward. The kernel moves the same
    bytes as XLA's fused backward (read y, dy; write dx) and does not pay in time.

    Raises:
      TypeError: x not floating.
      ValueError: unknown implementation.
      Also the errors common to every op (``help(jaxbwd)``).

    Source: the logistic function; derivative ``s' = s (1 - s)``.
    """
    op = "sigmoid"
    B.check_float(op, "x", x)
    return _SIGMOID.partitioned(x, B.impl(implementation, op, x))


def tanh(x, *, implementation=None):
    """Hyperbolic tangent, elementwise, as ``jnp.tanh``.

    Args:
      x: [...] float32, bfloat16 or float16 (float64 on the XLA path).
      implementation: ``None`` (Pallas on GPU, XLA elsewhere), ``"pallas"`` or ``"xla"``.

    Returns:
      [...] in x's dtype, computed in float32.

    Residuals: the output y only. Backward: ``dx = dy * (1 - y**2)``, kernel ``tanh_bwd`` or
    XLA. The kernel moves the same bytes as XLA's fused backward and does not pay in time.

    Raises:
      TypeError: x not floating.
      ValueError: unknown implementation.
      Also the errors common to every op (``help(jaxbwd)``).

    Source: derivative ``tanh' = 1 - tanh**2``.
    """
    op = "tanh"
    B.check_float(op, "x", x)
    return _TANH.partitioned(x, B.impl(implementation, op, x))


# ------------------------------------------------------------------------------ swiglu
@functools.partial(custom_op, nondiff_argnums=(2, 3))
def _swiglu(gate, up, limit, impl):
    g, u = _clamp(_cf(gate), _cf(up), limit)
    return (_act("silu", g) * u).astype(gate.dtype)


def _swiglu_fwd(gate, up, limit, impl):
    return _swiglu.fun(gate, up, limit, impl), (gate, up)


def _swiglu_tangent(limit, impl, res, dgate, dup):
    return jax.jvp(lambda g, u: _swiglu.fun(g, u, limit, impl), res, (dgate, dup))[1]


def _swiglu_bwd(limit, impl, res, dy):
    gate, up = res
    if impl.pallas:
        return kernels.swiglu_bwd(gate, up, dy, limit=limit, interpret=impl.interpret)
    dgate, dup = kernels.gated_grads(_cf(gate), _cf(up), _cf(dy), activation="silu", limit=limit)
    return dgate.astype(gate.dtype), dup.astype(up.dtype)


_swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)
_swiglu.deftangent(_swiglu_tangent)


def swiglu(gate, up, *, limit=None, implementation=None):
    """SwiGLU: ``silu(gate) * up``, elementwise, optionally clamped as in gpt-oss.

    Args:
      gate, up: [...] same shape and floating dtype (the two FFN input projections).
      limit: ``None`` or a positive Python number: ``gate = min(gate, limit)`` and
        ``up = clip(up, -limit, limit)`` before the product (gpt-oss uses 7.0). The gradient
        is 0 where a value was beyond the limit; at the limit it passes, as torch.clamp's.
      implementation: ``None`` (Pallas on GPU, XLA elsewhere), ``"pallas"`` or ``"xla"``.

    Returns:
      [...] in gate's dtype, computed in float32.

    Residuals: gate and up. Backward: one fused elementwise kernel (``swiglu_bwd``) that
    reads gate, up and dy once and writes dgate and dup once.

    Raises:
      TypeError: gate or up not floating, or of different dtypes; limit traced or not a number.
      ValueError: gate and up shapes differ; limit <= 0; unknown implementation.
      Also the errors common to every op (``help(jaxbwd)``).

    Source: Shazeer, "GLU Variants Improve Transformer" (2020); the clamp follows OpenAI's
    gpt-oss reference implementation (2025).
    """
    op = "swiglu"
    B.check_float(op, "gate", gate)
    B.check_float(op, "up", up)
    B.check_shape(op, "up", up, gate.shape, what="(gate's shape)")
    B.check_same_dtype(op, ("gate", "up"), (gate, up))
    limit = _check_limit(op, limit)
    impl = B.impl(implementation, op, gate)
    return S.partitioned("...,...->...", lambda g, u: _swiglu(g, u, limit, impl), gate, up)


# ------------------------------------------------------------------- gated_linear_unit
def _halves(x):
    d = x.shape[-1] // 2
    return x[..., :d], x[..., d:]


@functools.partial(custom_op, nondiff_argnums=(1, 2, 3), name="gated_linear_unit")
def _glu(x, activation, limit, impl):
    g, u = _clamp(*_halves(_cf(x)), limit)
    return (_act(activation, g) * u).astype(x.dtype)


def _glu_fwd(x, activation, limit, impl):
    return _glu.fun(x, activation, limit, impl), x


def _glu_tangent(activation, limit, impl, x, dx):
    return jax.jvp(lambda x: _glu.fun(x, activation, limit, impl), (x,), (dx,))[1]


def _glu_bwd(activation, limit, impl, x, dy):
    if impl.pallas:
        x2, _ = B.rows(x)
        dx = kernels.glu_bwd(x2, dy.reshape(-1, dy.shape[-1]), activation=activation, limit=limit,
                             interpret=impl.interpret)
        return (dx.reshape(x.shape),)
    gate, up = _halves(_cf(x))
    dgate, dup = kernels.gated_grads(gate, up, _cf(dy), activation=activation, limit=limit, erfc=jax.lax.erfc)
    return (jnp.concatenate([dgate, dup], axis=-1).astype(x.dtype),)


_glu.defvjp(_glu_fwd, _glu_bwd)
_glu.deftangent(_glu_tangent)


def gated_linear_unit(x, *, activation="silu", limit=None, implementation=None):
    """Gated linear unit on a fused projection: ``act(x[..., :d]) * x[..., d:]``.

    (For ``jax.nn.glu``'s ``x1 * sigmoid(x2)`` see :func:`glu`.)

    Args:
      x: [..., 2d] float32, bfloat16 or float16 (float64 on the XLA path); gate is the first half of the last axis,
        up the second (one GEMM produces both).
      activation: ``"silu"`` (SwiGLU), ``"gelu"`` (GeGLU, tanh form) or ``"gelu_exact"``.
      limit: ``None`` or a positive Python number; clamps as in :func:`swiglu`.
      implementation: ``None`` (Pallas on GPU, XLA elsewhere), ``"pallas"`` or ``"xla"``.

    Returns:
      [..., d] in x's dtype, computed in float32.

    Residuals: x. Backward: one kernel (``glu_bwd``) over [rows, d] tiles that reads both
    halves of x and dy and writes both halves of dx, so no concatenation follows it.

    Raises:
      TypeError: x not floating; limit traced or not a number.
      ValueError: x of rank 0 or with an odd last dimension; unknown activation;
        limit <= 0; unknown implementation.
      Also the errors common to every op (``help(jaxbwd)``).

    Source: Dauphin et al., "Language Modeling with Gated Convolutional Networks" (2017);
    Shazeer, "GLU Variants Improve Transformer" (2020); clamp from gpt-oss (2025).
    """
    op = "gated_linear_unit"
    B.check_float(op, "x", x)
    B.check_ndim(op, "x", x, min_ndim=1, what="([..., 2d])")
    if x.shape[-1] % 2:
        raise ValueError(
            f"jaxbwd.{op}: x must have an even last dimension (gate and up halves, [..., 2d]), "
            f"got shape {tuple(x.shape)}"
        )
    if activation not in kernels.ACTIVATIONS:
        raise ValueError(f"jaxbwd.{op}: activation must be one of {kernels.ACTIVATIONS}, got {activation!r}")
    limit = _check_limit(op, limit)
    impl = B.impl(implementation, op, x)  # gate and up are halves of the last axis: keep it whole
    return S.partitioned("...D->...D", lambda x: _glu(x, activation, limit, impl), x)


# --------------------------------------------------------------------------------- glu
@functools.partial(custom_op, nondiff_argnums=(1, 2), name="glu")
def _sigmoid_glu(x, axis, impl):
    x1, x2 = jnp.split(_cf(x), 2, axis=axis)
    return (x1 * jax.nn.sigmoid(x2)).astype(x.dtype)


def _sigmoid_glu_fwd(x, axis, impl):
    return _sigmoid_glu.fun(x, axis, impl), x


def _sigmoid_glu_tangent(axis, impl, x, dx):
    return jax.jvp(lambda x: _sigmoid_glu.fun(x, axis, impl), (x,), (dx,))[1]


def _sigmoid_glu_bwd(axis, impl, x, dy):
    # d(x1 s)/dx1 = s, d(x1 s)/dx2 = x1 s (1 - s), with s = sigmoid(x2): one elementwise
    # pass over x and dy that XLA fuses (no kernel of its own).
    x1, x2 = jnp.split(_cf(x), 2, axis=axis)
    s, g = jax.nn.sigmoid(x2), _cf(dy)
    return (jnp.concatenate([g * s, g * x1 * s * (1 - s)], axis=axis).astype(x.dtype),)


_sigmoid_glu.defvjp(_sigmoid_glu_fwd, _sigmoid_glu_bwd)
_sigmoid_glu.deftangent(_sigmoid_glu_tangent)


def glu(x, axis=-1, *, implementation=None):
    """``jax.nn.glu``: split ``x`` in halves along ``axis`` and return ``x1 * sigmoid(x2)``.

    (The fused-projection gate ``act(x[..., :d]) * x[..., d:]`` with SiLU/GELU is
    :func:`gated_linear_unit`.)

    Args:
      x: floating, rank >= 1, with an even size along ``axis``.
      axis: int in ``[-x.ndim, x.ndim)``, as ``jax.nn.glu``.
      implementation: accepted for uniformity; both choices run the same XLA formulas
        (an elementwise backward that XLA fuses into one pass).

    Returns:
      x's shape with ``axis`` halved, x's dtype; computed in float32.

    Residuals: x. Backward: ``dx1 = dy * s``, ``dx2 = dy * x1 * s * (1 - s)``.

    Raises:
      TypeError: x not floating; axis not an int.
      ValueError: x of rank 0; axis out of range; odd size along axis; unknown implementation.
      Also the errors common to every op (``help(jaxbwd)``).

    Source: Dauphin et al., "Language Modeling with Gated Convolutional Networks" (2017), eq. 2.
    """
    op = "glu"
    B.check_float(op, "x", x)
    B.check_ndim(op, "x", x, min_ndim=1)
    axis = _axis(op, x, axis)
    if x.shape[axis] % 2:
        raise ValueError(f"jaxbwd.glu: x must have an even size along axis {axis}, got shape {tuple(x.shape)}")
    return _sigmoid_glu(x, axis, B.impl(implementation, op))  # no kernels: float64 runs under any choice


def _axis(op, x, axis) -> int:
    axis = B.static_int(op, "axis", axis)
    if not -x.ndim <= int(axis) < x.ndim:
        raise ValueError(
            f"jaxbwd.{op}: axis must be in [{-x.ndim}, {x.ndim}) for x of shape {tuple(x.shape)}, got {axis}"
        )
    return int(axis) % x.ndim


# ----------------------------------------------------------------------------- softmax
@functools.partial(custom_op, nondiff_argnums=(1, 2))
def _softmax(x, axis, impl):
    xf = _cf(x)
    m = jnp.max(xf, axis=axis, keepdims=True)
    # A fully -inf row has max -inf; shifting by 0 instead gives exp(-inf) = 0, not NaN. A +inf
    # (or NaN) max stays the shift, so such a row is all NaN, as jax.nn.softmax gives.
    e = jnp.exp(xf - jnp.where(m == -jnp.inf, 0.0, m))
    s = jnp.sum(e, axis=axis, keepdims=True)
    return (e / jnp.where(s == 0, 1.0, s)).astype(x.dtype)


def _softmax_fwd(x, axis, impl):
    y = _softmax.fun(x, axis, impl)
    return y, y


def _softmax_tangent(axis, impl, y, dx):
    yf, dxf = _cf(y), _cf(dx)
    return (yf * (dxf - jnp.sum(yf * dxf, axis=axis, keepdims=True))).astype(y.dtype)


def _softmax_bwd(axis, impl, y, dy):
    if impl.pallas:
        ym, dym = jnp.moveaxis(y, axis, -1), jnp.moveaxis(dy, axis, -1)
        y2, _ = B.rows(ym)
        dx = kernels.softmax_bwd(y2, dym.reshape(y2.shape), interpret=impl.interpret)
        return (jnp.moveaxis(dx.reshape(ym.shape), -1, axis),)
    yf, dyf = _cf(y), _cf(dy)
    delta = jnp.sum(yf * dyf, axis=axis, keepdims=True)
    return ((yf * (dyf - delta)).astype(y.dtype),)


_softmax.defvjp(_softmax_fwd, _softmax_bwd)
_softmax.deftangent(_softmax_tangent)


def softmax(x, axis=-1, where=None, *, implementation=None):
    """Softmax over ``axis``, as ``jax.nn.softmax``: ``exp(x - max) / sum(exp(x - max))``.

    Args:
      x: [...] float32, bfloat16 or float16 (float64 on the XLA path), rank >= 1. ``-inf`` entries are masked out;
        a slice that is entirely ``-inf`` gives zeros (not NaN) and zero gradients; a slice
        with a ``+inf`` or NaN entry is all NaN, as ``jax.nn.softmax`` gives.
      axis: an int in ``[-x.ndim, x.ndim)``, a tuple of them (the softmax is taken over
        their joint entries), or ``None`` (all axes), as ``jax.nn.softmax``.
      where: ``None`` or a boolean array broadcastable to x: the entries taking part. As
        ``jax.nn.softmax``, the others give 0 with zero gradient, and a slice with no entry
        taking part gives zeros; in a slice made NaN by a +inf or NaN entry taking part they
        are NaN too (``jax.nn.softmax`` keeps their 0).
      implementation: ``None`` (Pallas on GPU, XLA elsewhere), ``"pallas"`` or ``"xla"``.

    Returns:
      x's shape and dtype; max, exp and sum in float32.

    Residuals: the output y only (the gradient needs nothing else, and y is often kept
    alive by the caller anyway). With ``where``, ``jax.vjp`` also keeps the masked x and
    the mask that the ``-inf`` fill (plain XLA before the op) was built from; inside
    ``lax.scan`` or under ``jit`` only y is stacked or kept. Backward: ``dx = y * (dy - sum(dy * y))`` over the softmax
    entries; the kernel (``softmax_bwd``) works on the last axis: one other axis is moved
    there, several are moved there and flattened into one (a transpose unless they are
    already the trailing axes). ``where`` becomes ``-inf`` in x's masked entries first.

    Raises:
      TypeError: x not floating; axis not an int, a tuple of ints or None; where not boolean.
      ValueError: x of rank 0; an axis out of range or repeated; where not broadcastable
        to x; unknown implementation.
      Also the errors common to every op (``help(jaxbwd)``).

    Source: Bridle, "Probabilistic Interpretation of Feedforward Classification Network
    Outputs" (1990); the backward is the softmax Jacobian ``diag(y) - y y^T`` applied to dy.
    """
    op = "softmax"
    B.check_float(op, "x", x)
    B.check_ndim(op, "x", x, min_ndim=1)
    if axis is None:
        axes = tuple(range(x.ndim))
    elif isinstance(axis, (tuple, list)):
        axes = tuple(_axis(op, x, a) for a in axis)
        if len(set(axes)) != len(axes) or not axes:
            raise ValueError(f"jaxbwd.softmax: axis must name distinct axes, got {axis!r}")
    else:
        axes = (_axis(op, x, axis),)
    for a in axes:
        B.check_nonempty_axis(op, "x", x, a, f"softmax axis {a}")
    impl = B.impl(implementation, op, x)
    if where is not None:
        x = B.apply_where(op, "x", x, where)
    if len(axes) == 1:
        return _softmax_last(x, axes[0], impl)
    axes = tuple(sorted(axes))
    rest = tuple(i for i in range(x.ndim) if i not in axes)
    perm = rest + axes
    xt = x if perm == tuple(range(x.ndim)) else jnp.transpose(x, perm)
    lead = xt.shape[:len(rest)]
    y = _softmax_last(xt.reshape(lead + (-1,)), len(rest), impl).reshape(xt.shape)
    return y if perm == tuple(range(x.ndim)) else jnp.transpose(y, np.argsort(perm))


def _softmax_last(x, axis, impl):
    sig = "".join("A" if i == axis else "abcdefghijklmnopqrstuvwxyz"[i] for i in range(x.ndim))
    return S.partitioned(f"{sig}->{sig}", lambda x: _softmax(x, axis, impl), x)
