"""What a user computes without jaxbwd: each op as the jax.nn, optax, lax or flax function it
replaces, on the inputs as given, for ``python -m jaxbwd bench`` to time and measure autodiff of.

``jaxbwd.reference`` computes in float32 and casts back, as the ops do, so that tests compare
against the exact function; autodiff of it keeps float32 values where ``jax.nn.silu`` on a
bfloat16 array keeps bfloat16 ones. A benchmark against it would flatter jaxbwd. These
baselines are the calls a model would make instead: ``jax.nn.dot_product_attention``
(``implementation="xla"``), ``optax.softmax_cross_entropy_with_integer_labels``,
``lax.conv_general_dilated`` as ``flax.linen.Conv`` calls it, and so on, each with the
precision and dtype those functions use by default.

The norms and pools are flax's (``flax.linen.RMSNorm``, ``LayerNorm``, ``GroupNorm``,
``BatchNorm``, ``max_pool``, ``avg_pool``), which compute their statistics in float32 as
flax does by default; without flax installed (the ``flax`` extra) they are unsupported.

Each function takes the op's arguments. An option its library has no counterpart for (a
softcap, swiglu's clamp, Gemma's weight offset, the auxiliary outputs) raises
:class:`Unsupported`, and the bench then measures against the reference for that case and
says so. Ops absent here have no such library function (RoPE, dropout's counter-based mask,
adaptive pooling) or are already plain jnp (reshape, residual_add, bias_add); the reference
is their baseline.

``tests/test_baselines.py`` checks every baseline against the reference in float32, value
and gradients, on the registry's examples, and against the op on the options the examples
leave out (attention's bias, mask and lengths; batch_norm's running statistics).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from jaxbwd.vjp._base import widen_index


class Unsupported(ValueError):
    """The option has no counterpart in the library function the baseline calls."""


def _calls(name):
    """Records the library function a baseline calls, for the bench's report."""
    def deco(fn):
        fn.calls = name
        return fn
    return deco


def _refuse(op, name, value, default):
    """Raises :class:`Unsupported` when option ``name`` is not at its ``default``."""
    if value is default or (default is not None and not hasattr(value, "shape") and value == default):
        return
    shown = f"an array of shape {tuple(value.shape)}" if hasattr(value, "shape") else repr(value)
    raise Unsupported(f"baseline of {op}: {name}={shown} has no counterpart in the library function")


@_calls("jax.nn.softmax")
def softmax(x, *, axis=-1, where=None):
    """``jax.nn.softmax(x, axis=axis, where=where)``: x [...] floating, ``axis`` an int or
    tuple, ``where`` a boolean mask broadcastable to x. Returns x's shape and dtype. Raises
    what jax.nn.softmax raises. Source: the softmax."""
    return jax.nn.softmax(x, axis=axis, where=where)


@_calls("jax.nn.silu")
def silu(x):
    """``jax.nn.silu(x)`` = x * sigmoid(x) (Elfwing et al. 2018): x [...] floating. Returns
    x's shape and dtype. Raises nothing of its own."""
    return jax.nn.silu(x)


@_calls("jax.nn.gelu")
def gelu(x, *, approximate=True):
    """``jax.nn.gelu(x, approximate)`` (Hendrycks & Gimpel 2016; tanh form when approximate):
    x [...] floating. Returns x's shape and dtype. Raises nothing of its own."""
    return jax.nn.gelu(x, approximate=approximate)


@_calls("jax.nn.relu")
def relu(x):
    """``jax.nn.relu(x)``: x [...] floating. Returns x's shape and dtype. Raises nothing of its
    own."""
    return jax.nn.relu(x)


@_calls("jax.nn.leaky_relu")
def leaky_relu(x, negative_slope=0.01):
    """``jax.nn.leaky_relu(x, negative_slope)``: x [...] floating, the slope a Python number.
    Returns x's shape and dtype. Raises nothing of its own."""
    return jax.nn.leaky_relu(x, negative_slope)


@_calls("jax.nn.sigmoid")
def sigmoid(x):
    """``jax.nn.sigmoid(x)``: x [...] floating. Returns x's shape and dtype. Raises nothing of
    its own."""
    return jax.nn.sigmoid(x)


@_calls("jnp.tanh")
def tanh(x):
    """``jnp.tanh(x)``: x [...] floating. Returns x's shape and dtype. Raises nothing of its own."""
    return jnp.tanh(x)


@_calls("jax.nn.silu(gate) * up")
def swiglu(gate, up, *, limit=None):
    """``jax.nn.silu(gate) * up`` (Shazeer 2020): gate, up [...] of one floating dtype. Returns
    their shape and dtype. Raises Unsupported for a ``limit`` (gpt-oss's clamp, which no
    library function has)."""
    _refuse("swiglu", "limit", limit, None)
    return jax.nn.silu(gate) * up


_ACTIVATIONS = {"silu": jax.nn.silu, "gelu": functools.partial(jax.nn.gelu, approximate=True),
                "gelu_exact": functools.partial(jax.nn.gelu, approximate=False)}


@_calls("jax.nn.silu or jax.nn.gelu of x1, times x2")
def gated_linear_unit(x, *, activation="silu", limit=None):
    """``act(x1) * x2`` over the halves of x's last axis, act ``jax.nn.silu`` or
    ``jax.nn.gelu`` (tanh or exact form): x [..., 2d] floating. Returns [..., d] in x's dtype.
    Raises Unsupported for a ``limit``."""
    _refuse("gated_linear_unit", "limit", limit, None)
    g, u = jnp.split(x, 2, axis=-1)
    return _ACTIVATIONS[activation](g) * u


@_calls("jax.nn.glu")
def glu(x, axis=-1):
    """``jax.nn.glu(x, axis)`` = x1 * sigmoid(x2) (Dauphin et al. 2017): x with an even
    ``axis``. Returns x's shape with that axis halved, x's dtype. Raises what jax.nn.glu raises."""
    return jax.nn.glu(x, axis=axis)


@_calls("jnp.matmul")
def matmul(x, w):
    """``jnp.matmul(x, w)`` at the default precision: x [..., K], w [K, M]. Returns [..., M] in
    ``result_type(x, w)``. Raises what jnp.matmul raises."""
    return jnp.matmul(x, w)


@_calls("optax.softmax_cross_entropy_with_integer_labels")
def cross_entropy(logits, labels, *, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, reduction="mean",
                  axis=-1, where=None, weights=None):
    """``optax.softmax_cross_entropy_with_integer_labels`` per row (with label smoothing:
    ``optax.softmax_cross_entropy`` of ``optax.smooth_labels`` of the one-hot labels), plus
    PaLM's z-loss ``z_loss * logsumexp(logits)**2``; rows whose label is ``ignore_index`` or
    outside [0, V) give 0 and are left out of the mean. logits [..., V] floating, labels [...]
    integer. Returns a scalar (reduction "mean"/"sum") or [...] ("none"), logits' dtype.
    Raises Unsupported for a class ``axis`` other than the last, or ``where``. ``weights``
    ([...], the fused head's per-token weights) multiplies each row's loss and the mean's
    denominator."""
    # ``weights`` serves linear_cross_entropy's per-token weights; the op has none.
    if axis not in (-1, logits.ndim - 1):
        _refuse("cross_entropy", "axis", axis, -1)
    _refuse("cross_entropy", "where", where, None)
    V = logits.shape[-1]
    labels = widen_index(labels)
    valid = (labels >= 0) & (labels < V) & (labels != ignore_index)
    safe = jnp.where(valid, labels, 0)
    if label_smoothing:  # optax's way: smoothed one-hot targets
        targets = optax.smooth_labels(jax.nn.one_hot(safe, V, dtype=logits.dtype), label_smoothing)
        loss = optax.softmax_cross_entropy(logits, targets)
    else:
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, safe)
    if z_loss:  # PaLM's z-loss; optax has none
        loss = loss + z_loss * jnp.square(jax.nn.logsumexp(logits, axis=-1))
    if weights is not None:
        loss = loss * weights
    loss = jnp.where(valid, loss, 0)
    if reduction == "none":
        return loss
    total = jnp.sum(loss)
    if reduction == "sum":
        return total
    den = jnp.sum(jnp.where(valid, 1 if weights is None else weights, 0))
    return jnp.where(den == 0, 0, total / jnp.where(den == 0, 1, den)).astype(total.dtype)


@_calls("x @ w, then optax.softmax_cross_entropy_with_integer_labels")
def linear_cross_entropy(x, w, labels, *, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, logit_softcap=None,
                         weights=None, reduction="mean", return_aux=False, transpose_w=False):
    """The unfused LM head: logits ``x @ w`` (``x @ w.T`` with
    ``transpose_w``) in the inputs' dtype, the softcap ``c * tanh(z / c)``, then
    :func:`cross_entropy`: x [..., D], w [D, V] ([V, D] with transpose_w), labels [...]
    integer, weights [...] or None. Returns a scalar or [...] in the inputs' dtype. Raises
    Unsupported for ``return_aux=True``."""
    _refuse("linear_cross_entropy", "return_aux", return_aux, False)
    logits = x @ (w.T if transpose_w else w)
    if logit_softcap is not None:
        logits = logit_softcap * jnp.tanh(logits / logit_softcap)
    return cross_entropy(logits, labels, ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss,
                         reduction=reduction, weights=weights)


@_calls("jax.nn.dot_product_attention(implementation='xla')")
def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                          query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
                          segment_ids=None, sliding_window=None, logit_softcap=None):
    """``jax.nn.dot_product_attention(..., implementation="xla")``: query [B, T, N, H] (or
    [T, N, H]), key/value [B, S, K, H] with N % K == 0; bias, mask, scale, is_causal, the
    sequence lengths and local_window_size passed through. jaxbwd's segment_ids become a
    boolean mask, and ``sliding_window=w`` becomes ``local_window_size=(w - 1, 0)`` (causal) or
    ``(w - 1, w - 1)``. Returns query's shape and dtype. Raises Unsupported for a
    ``logit_softcap``, or for both sliding_window and local_window_size."""
    _refuse("dot_product_attention", "logit_softcap", logit_softcap, None)
    if segment_ids is not None:  # as a boolean mask, the way jax.nn takes packed sequences
        qs, ks = segment_ids if isinstance(segment_ids, (tuple, list)) else (segment_ids, segment_ids)
        same = qs[..., :, None] == ks[..., None, :]  # [B, T, S] or [T, S]
        same = same[:, None] if same.ndim == 3 else same
        mask = same if mask is None else mask & same
    if sliding_window is not None:  # jaxbwd's window w sees i - w < j; jax.nn's (left, right) are inclusive
        _refuse("dot_product_attention", "local_window_size (with sliding_window)", local_window_size, None)
        local_window_size = (sliding_window - 1, 0 if is_causal else sliding_window - 1)
    return jax.nn.dot_product_attention(query, key, value, bias, mask, scale=scale, is_causal=is_causal,
                                        query_seq_lengths=query_seq_lengths,
                                        key_value_seq_lengths=key_value_seq_lengths,
                                        local_window_size=local_window_size, implementation="xla")


@_calls("jax.image.resize")
def upsample2d(x, scale, *, method="nearest"):
    """``jax.image.resize`` of x [N, H, W, C] to [N, H * sh, W * sw, C] ("nearest" or
    "bilinear", half-pixel centres), x's dtype. Raises what jax.image.resize raises."""
    sh, sw = (scale, scale) if isinstance(scale, int) else tuple(scale)
    N, H, W, C = x.shape
    return jax.image.resize(x, (N, H * sh, W * sw, C), method=method)


def _pair(v):
    return None if v is None else ((v, v) if isinstance(v, int) else tuple(v))


@_calls("lax.conv_general_dilated (as flax.linen.Conv)")
def conv2d(x, w, *, stride=1, padding=0, dilation=1, groups=1):
    """``lax.conv_general_dilated`` as ``flax.linen.Conv`` calls it: x NHWC, w HWIO
    [kh, kw, C / groups, O], default precision, the inputs' dtype. Returns NHWC [N, H', W', O].
    Raises what lax.conv_general_dilated raises."""
    if isinstance(padding, str):
        pad = padding.upper()
    else:
        pad = tuple((p, p) if isinstance(p, int) else tuple(p) for p in _pair(padding))
    return jax.lax.conv_general_dilated(x, w, window_strides=_pair(stride), padding=pad, rhs_dilation=_pair(dilation),
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=groups)


@_calls("optax.squared_error")
def mse_loss(predictions, targets, weights=None, *, reduction="mean"):
    """``optax.squared_error(predictions, targets)``, times ``weights`` when given, then the
    mean, the sum or none: arrays of one shape. Returns a scalar or that shape, predictions'
    dtype. Raises what optax raises."""
    sq = optax.squared_error(predictions, targets)
    if weights is not None:
        sq = sq * weights
    if reduction == "none":
        return sq
    return jnp.mean(sq) if reduction == "mean" else jnp.sum(sq)


@_calls("jnp.take (as flax.linen.Embed)")
def embed(ids, table, *, padding_idx=None):
    """``jnp.take(table, ids, axis=0)`` as ``flax.linen.Embed`` does, ids outside [0, V) giving
    zero rows as the op's do: ids [...] integer, table [V, D]. Returns [..., D] in table's
    dtype. Raises Unsupported for a ``padding_idx``."""
    _refuse("embed", "padding_idx", padding_idx, None)
    # jnp.take would wrap negative ids; the op gives every id outside [0, V) a zero row
    ids = jnp.where(ids < 0, table.shape[0], ids)
    return jnp.take(table, ids, axis=0, mode="fill", fill_value=0)


def _flax_linen(op):
    try:
        import flax.linen as nn
    except ImportError:
        raise Unsupported(f"baseline of {op}: flax is not installed (pip install 'jaxbwd[flax]')") from None
    return nn


@_calls("flax.linen.RMSNorm")
def rms_norm(x, weight, *, eps=1e-6, weight_offset=0.0):
    """``flax.linen.RMSNorm(epsilon=eps)`` with ``weight`` as its scale (Zhang & Sennrich 2019;
    statistics in float32, flax's default): x [..., D], weight [D]. Returns x's shape, the
    promoted dtype of x and weight as flax gives. Raises Unsupported for a ``weight_offset``
    other than 0, or without flax."""
    _refuse("rms_norm", "weight_offset", weight_offset, 0.0)
    return _flax_linen("rms_norm").RMSNorm(epsilon=eps).apply({"params": {"scale": weight}}, x)


@_calls("flax.linen.LayerNorm")
def layer_norm(x, weight, bias, *, eps=1e-5):
    """``flax.linen.LayerNorm(epsilon=eps)`` with weight and bias as its scale and bias (Ba
    et al. 2016): x [..., D], weight and bias [D]. Returns x's shape, flax's result dtype.
    Raises Unsupported without flax."""
    return _flax_linen("layer_norm").LayerNorm(epsilon=eps).apply({"params": {"scale": weight, "bias": bias}}, x)


@_calls("flax.linen.GroupNorm (and jax.nn.silu for activation='silu')")
def group_norm(x, weight, bias, *, num_groups, eps=1e-5, activation=None):
    """``flax.linen.GroupNorm(num_groups, epsilon=eps)`` (Wu & He 2018), then
    ``jax.nn.silu`` for ``activation="silu"``: x [N, ..., C] channels-last, weight and bias
    [C]. Returns x's shape, flax's result dtype. Raises Unsupported without flax."""
    nn = _flax_linen("group_norm")
    y = nn.GroupNorm(num_groups=num_groups, epsilon=eps).apply({"params": {"scale": weight, "bias": bias}}, x)
    return jax.nn.silu(y) if activation == "silu" else y


@_calls("flax.linen.BatchNorm")
def batch_norm(x, weight, bias, *, running_mean=None, running_var=None, momentum=0.99, eps=1e-5, training=True,
               axis=-1, axis_name=None):
    """``flax.linen.BatchNorm`` (Ioffe & Szegedy 2015) with ``use_running_average=not
    training``, momentum, axis and axis_name passed through: x [..., C, ...] (C at ``axis``),
    weight, bias and the running statistics [C]. Returns y in x's shape, or ``(y, {"mean",
    "var"})`` in training with running statistics given, as the op does. Raises Unsupported
    without flax."""
    nn = _flax_linen("batch_norm")
    C = x.shape[axis]
    stats = ({"mean": jnp.zeros((C,), jnp.float32), "var": jnp.ones((C,), jnp.float32)} if running_mean is None
             else {"mean": running_mean, "var": running_var})
    module = nn.BatchNorm(use_running_average=not training, axis=axis, momentum=momentum, epsilon=eps,
                          axis_name=axis_name)
    y, updates = module.apply({"params": {"scale": weight, "bias": bias}, "batch_stats": stats}, x,
                              mutable=["batch_stats"])
    if training and running_mean is not None:  # the op's return in that case: y and the new statistics
        return y, dict(updates["batch_stats"])
    return y


@_calls("flax.linen.max_pool")
def max_pool2d(x, window_shape, strides=None, padding="VALID"):
    """``flax.linen.max_pool`` of x NHWC with the window and strides as pairs, padding
    "SAME"/"VALID" or explicit pairs. Returns NHWC, x's dtype. Raises Unsupported without flax."""
    return _flax_linen("max_pool2d").max_pool(x, _pair(window_shape), _pair(strides), padding)


@_calls("flax.linen.avg_pool")
def avg_pool2d(x, window_shape, strides=None, padding="VALID", count_include_pad=True):
    """``flax.linen.avg_pool`` of x NHWC (``count_include_pad`` passed through), as
    :func:`max_pool2d`. Returns NHWC, x's dtype. Raises Unsupported without flax."""
    return _flax_linen("avg_pool2d").avg_pool(x, _pair(window_shape), _pair(strides), padding, count_include_pad)
