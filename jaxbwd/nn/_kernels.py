"""What the linen and NNX modules share: which flax configurations jaxbwd's ops cover, and
the computation through those ops once flax's dtype promotion has been applied.

Each function here takes arrays already promoted the way the calling flax module promotes
them (its ``promote_dtype``), so the result has flax's dtype. A configuration these
functions do not cover is recognised by the ``*_covered`` predicates, and the module then
runs flax's own ``__call__`` instead.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
from flax.linen.linear import canonicalize_padding

import jaxbwd
from jaxbwd.vjp import _base as B


def _axes(ndim: int, axes) -> tuple:
    axes = axes if isinstance(axes, Sequence) else (axes,)
    return tuple(sorted({a % ndim for a in axes}))


def last_axis_only(ndim: int, *axes) -> bool:
    """True when each of ``axes`` (flax's reduction/feature axes) is exactly the last axis."""
    return ndim >= 1 and all(_axes(ndim, a) == (ndim - 1,) for a in axes)


def static_real(value) -> bool:
    """Whether the ops take ``value`` as a static hyperparameter (``epsilon``, ``momentum``,
    ``rate``; the ops' own rule, ``_base.check_static_number``). flax's modules also take jax
    arrays (traced under jit), and such a module runs flax's code."""
    try:
        B.check_static_number("nn", "value", value)
    except (TypeError, ValueError):
        return False
    return True


def plain_stats(mod, mask) -> bool:
    """A norm module's statistics as the kernels compute them: unmasked, on one device, in
    float32 (flax versions and NNX modules without ``force_float32_reductions`` always reduce
    in float32), with a static ``epsilon > 0``."""
    return (mask is None and mod.axis_name is None and getattr(mod, "force_float32_reductions", True)
            and static_real(mod.epsilon) and mod.epsilon > 0)


def last_axis_stats(mod, x, mask, *dtypes) -> bool:
    """RMSNorm / LayerNorm on the kernel path: :func:`plain_stats` over the last axis of x,
    and x and ``dtypes`` (the module's dtypes or parameters) real. A last axis of size 0 runs
    flax's code, which returns the empty array (the op refuses an empty reduction axis)."""
    return (plain_stats(mod, mask) and last_axis_only(x.ndim, mod.reduction_axes, mod.feature_axes)
            and x.shape[-1] > 0 and takes_dtypes(x, *dtypes))


def refuse_weight_offset(module: str, mod, x, mask) -> None:
    """RMSNorm's ``weight_offset`` off the kernel path (flax's code has none): a ValueError
    naming the configuration that left it."""
    raise ValueError(
        f"jaxbwd.{module}: weight_offset needs the kernel path (reduction_axes and feature_axes the last "
        f"axis, of size > 0, no mask or axis_name, epsilon > 0, force_float32_reductions=True, real dtypes), got "
        f"reduction_axes={mod.reduction_axes!r}, feature_axes={mod.feature_axes!r}, mask "
        f"{'given' if mask is not None else 'None'}, axis_name={mod.axis_name!r}, epsilon={mod.epsilon!r}, "
        f"force_float32_reductions={getattr(mod, 'force_float32_reductions', True)!r}, x {jnp.result_type(x)}"
    )


def check_weight_offset(module: str, use_scale, weight_offset) -> None:
    """RMSNorm's ``weight_offset`` offsets the ``scale`` parameter: with ``use_scale=False``
    there is none, and a nonzero offset would be ignored, so it is a ValueError naming ``module``."""
    if weight_offset and not use_scale:
        raise ValueError(f"jaxbwd.{module}: weight_offset offsets the scale parameter, which use_scale=False "
                         f"leaves out; got weight_offset={weight_offset!r} with use_scale=False")


def check_activation(module: str, activation) -> None:
    """GroupNorm's fused ``activation``: None or "silu" (ValueError naming ``module`` otherwise)."""
    if activation not in (None, "silu"):
        raise ValueError(f"jaxbwd.{module}: activation must be None or 'silu', got {activation!r}")


def compute_dtype(out_dtype, *arrays):
    """The dtype the op runs in: wide enough for the inputs and for the requested result.

    flax computes normalisation statistics in at least float32 and casts the result last, so
    running the op in the wider of (inputs, result) and casting afterwards matches it.
    """
    dt = jnp.result_type(*[a for a in arrays if a is not None])
    return jnp.promote_types(dt, out_dtype) if out_dtype is not None else dt


def op_float(dtype) -> bool:
    """A floating dtype the ops take (16 to 64 bits); an Embed table of another runs flax's code."""
    return B.is_op_float(dtype)


def takes_dtypes(*xs) -> bool:
    """Every array or dtype among ``xs`` (None skipped) is one jaxbwd's ops take. flax's
    modules take complex and 8-bit float ones too, so such a call runs flax's code."""
    return all(x is None or B.takes_dtype(jnp.result_type(x)) for x in xs)


def promotes_to_op_dtypes(promote, *args) -> bool:
    """Whether a module's ``promote_dtype`` (``promote``: a function of ``args``, arrays,
    ``ShapeDtypeStruct``s of parameters not yet created, or None) gives dtypes the ops take,
    found by abstract evaluation (nothing is computed). flax's default promotes to the
    inputs' floating dtype or the module's ``dtype``; a custom one may cast to an 8-bit float
    (quantised compute), and such a module runs flax's code, which takes those."""
    return takes_dtypes(*jax.tree_util.tree_leaves(jax.eval_shape(promote, *args)))


def rms_norm(x, scale, *, eps, weight_offset, out_dtype, impl):
    """x [..., D] normalised over D; scale [D] or None (flax's ``use_scale=False``: no scaling;
    the modules refuse a nonzero ``weight_offset`` there, :func:`check_weight_offset`)."""
    ct = compute_dtype(out_dtype, x, scale)
    w = jnp.ones((x.shape[-1],), ct) if scale is None else scale.astype(ct)
    y = jaxbwd.rms_norm(x.astype(ct), w, eps=eps, weight_offset=weight_offset if scale is not None else 0.0,
                        implementation=impl)
    return y.astype(out_dtype if out_dtype is not None else ct)


def layer_norm(x, scale, bias, *, eps, out_dtype, impl):
    """x [..., D] normalised over D; scale/bias [D] or None (``use_scale``/``use_bias`` off)."""
    ct = compute_dtype(out_dtype, x, scale, bias)
    d = x.shape[-1]
    w = jnp.ones((d,), ct) if scale is None else scale.astype(ct)
    b = jnp.zeros((d,), ct) if bias is None else bias.astype(ct)
    y = jaxbwd.layer_norm(x.astype(ct), w, b, eps=eps, implementation=impl)
    return y.astype(out_dtype if out_dtype is not None else ct)


def group_norm_covered(x, reduction_axes, num_groups) -> bool:
    """flax's default reduction (all axes but the first, batch one) with a valid group count."""
    if x.ndim < 2 or not isinstance(num_groups, int) or num_groups <= 0 or x.shape[-1] % num_groups:
        return False
    default = tuple(range(1, x.ndim))
    return reduction_axes is None or _axes(x.ndim, reduction_axes) == default


def group_norm(x, scale, bias, *, num_groups, eps, activation, out_dtype, impl):
    """x [N, ..., C], groups of C / num_groups consecutive channels, stats over (..., group)."""
    ct = compute_dtype(out_dtype, x, scale, bias)
    c = x.shape[-1]
    w = jnp.ones((c,), ct) if scale is None else scale.astype(ct)
    b = jnp.zeros((c,), ct) if bias is None else bias.astype(ct)
    y = jaxbwd.group_norm(x.astype(ct), w, b, num_groups=num_groups, eps=eps, activation=activation,
                          implementation=impl)
    return y.astype(out_dtype if out_dtype is not None else ct)


def dense(x, kernel, bias, impl):
    """x [..., K] @ kernel [K, M] (+ bias [M]); arrays already share flax's promoted dtype."""
    y = jaxbwd.matmul(x, kernel, implementation=impl)
    return y if bias is None else jaxbwd.bias_add(y, bias, implementation=impl)


def embed_lookup(ids, table, impl):
    """``jnp.take(table, ids, axis=0)`` as flax's Embed does it.

    jnp.take wraps ids in [-V, 0) to the end of the table and fills rows of ids outside
    [-V, V) with NaN; :func:`jaxbwd.embed` gives zero rows for those, so both conventions
    are restored here (one select over the output, fused by XLA).
    """
    V = table.shape[0]
    ids = B.check_int("embed", "ids", ids)  # uint8/int16 ids widened: V may not fit their dtype
    wrapped = jnp.where(ids < 0, ids + V, ids)
    y = jaxbwd.embed(wrapped, table, implementation=impl)
    if not jnp.issubdtype(table.dtype, jnp.inexact):
        return y
    ok = (wrapped >= 0) & (wrapped < V)
    return jnp.where(ok[..., None], y, jnp.asarray(jnp.nan, y.dtype))


def attend(query, table, impl):
    """query [..., D] @ table.T -> [..., V] (tied output projection)."""
    return jaxbwd.matmul(query, table.T, implementation=impl)


def attend_cross_entropy(query, table, labels, impl, kwargs):
    """linear_cross_entropy of the tied head ``query @ table.T`` (the table read as [V, D],
    no transposed copy, no logits stored)."""
    return jaxbwd.linear_cross_entropy(query, table, labels, transpose_w=True, implementation=impl, **kwargs)


def _tuple(v, n):
    if v is None:
        v = 1
    return (v,) * n if isinstance(v, int) else tuple(v)


def conv_covered(kernel_size: Sequence[int], padding, input_dilation, spatial: Sequence[int],
                 kernel_dilation=1) -> bool:
    """1-D and 2-D kernels without input dilation, with any of flax's padding spellings that
    reduce to explicit zero padding (ints, pairs, SAME, VALID), to a pad before a VALID
    convolution (CIRCULAR, REFLECT, CAUSAL) or, for negative explicit padding, to a crop of
    the input (``spatial``: its spatial sizes) that leaves at least one element; and an
    output that is not empty (flax returns an empty array where ``jaxbwd.conv2d`` raises)."""
    n = len(kernel_size)
    if n not in (1, 2) or any(d != 1 for d in _tuple(input_dilation, n)) or any(s < 1 for s in spatial):
        return False
    try:
        pad = canonicalize_padding(padding, n)
    except ValueError:
        return False  # flax's own call raises its message
    eff = [(k - 1) * d + 1 for k, d in zip(kernel_size, _tuple(kernel_dilation, n))]
    if isinstance(pad, str):  # flax matches CIRCULAR/REFLECT/CAUSAL case-sensitively, lax SAME/VALID not
        if pad.upper() == "VALID":
            return all(size >= e for size, e in zip(spatial, eff))
        return pad.upper() == "SAME" or pad in ("CIRCULAR", "REFLECT") or (pad == "CAUSAL" and n == 1)
    if not all(isinstance(v, int) for p in pad for v in p):
        return False
    return all(size + min(lo, 0) + min(hi, 0) >= 1 and size + lo + hi >= e
               for size, (lo, hi), e in zip(spatial, pad, eff))


def conv(x, kernel, bias, *, kernel_size, strides, padding, kernel_dilation, feature_group_count, impl):
    """flax's ``Conv`` (channels last, any batch dims) on :func:`jaxbwd.conv2d`.

    x [*batch, *spatial, Cin], kernel [*kernel_size, Cin/G, F] (promoted), bias [F] or None.
    A 1-D convolution runs as a 2-D one over a height of 1. CIRCULAR/REFLECT/CAUSAL pad the
    input first and convolve VALID, as flax does.
    """
    n = len(kernel_size)
    nb = x.ndim - (n + 1)
    batch_shape = x.shape[:nb]
    x = x.reshape((-1,) + x.shape[nb:]) if nb != 1 else x
    strides, dil = _tuple(strides, n), _tuple(kernel_dilation, n)
    pad = canonicalize_padding(padding, n)
    if isinstance(pad, str):
        eff = [(k - 1) * d + 1 for k, d in zip(kernel_size, dil)]
        if pad in ("CIRCULAR", "REFLECT"):
            widths = [(0, 0)] + [((e - 1) // 2, e // 2) for e in eff] + [(0, 0)]
            x = jnp.pad(x, widths, mode={"CIRCULAR": "wrap", "REFLECT": "reflect"}[pad])
            pad = [(0, 0)] * n
        elif pad == "CAUSAL":
            x = jnp.pad(x, [(0, 0), (eff[0] - 1, 0), (0, 0)])
            pad = [(0, 0)]
        else:
            pad = jax.lax.padtype_to_pads(x.shape[1:-1], eff, strides, pad.upper())
    pad = [tuple(int(v) for v in p) for p in pad]
    # Negative padding crops, as in lax.conv_general_dilated; done here as a slice, so that
    # neither the kernel nor XLA sees it (XLA:CPU in jaxlib 0.10.2 reads out of bounds in the
    # backward of a convolution with negative low padding: openxla/xla#48713).
    if any(v < 0 for p in pad for v in p):
        x = x[(slice(None),) + tuple(slice(-min(lo, 0), size + min(hi, 0))
                                     for size, (lo, hi) in zip(x.shape[1:-1], pad))]
        pad = [(max(lo, 0), max(hi, 0)) for lo, hi in pad]
    if n == 1:
        x, kernel = x[:, None], kernel[None]
        strides, dil, pad = (1,) + strides, (1,) + dil, [(0, 0)] + pad
    y = jaxbwd.conv2d(x, kernel, stride=tuple(strides), padding=tuple(pad), dilation=tuple(dil),
                      groups=feature_group_count, implementation=impl)
    if n == 1:
        y = y[:, 0]
    if bias is not None:
        y = jaxbwd.bias_add(y, bias, implementation=impl)
    return y.reshape(batch_shape + y.shape[1:]) if nb != 1 else y


def dropout_covered(inputs, rate, broadcast_dims) -> bool:
    """jaxbwd.dropout covers flax's Dropout for floating inputs, a static rate strictly
    between 0 and 1 (flax's own code returns early at 0 and 1) and no broadcast dims."""
    return (static_real(rate) and 0.0 < rate < 1.0 and not tuple(broadcast_dims)
            and op_float(jnp.result_type(inputs)))


def threefry_key(key) -> bool:
    """A key jaxbwd.dropout takes: threefry, typed or raw uint32 [2]."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return key.shape == () and jax.random.key_data(key).shape == (2,)
    return key.shape == (2,) and key.dtype == jnp.uint32


def check_sizes(module: str, **sizes) -> None:
    """A module's layer sizes (heads, head_dim, hidden, features): static Python ints >= 1,
    checked in the module's own terms before they reach a Dense or a reshape (where a float
    ``d_model / n_heads`` or a negative size fails deep inside flax and JAX)."""
    for name, value in sizes.items():
        B.static_int(module, name, value, minimum=1)


def check_attention_config(module: str, num_heads, num_kv_heads, head_dim, rope_theta) -> None:
    """The Attention modules' configuration: sizes, GQA grouping, RoPE's even head_dim and base."""
    check_sizes(module, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    if num_heads % num_kv_heads:
        raise ValueError(f"jaxbwd.{module}: num_heads must be a multiple of num_kv_heads, got "
                         f"num_heads={num_heads}, num_kv_heads={num_kv_heads}")
    if head_dim % 2:
        raise ValueError(f"jaxbwd.{module}: head_dim must be even (RoPE rotates pairs), got {head_dim}")
    B.check_positive(module, "rope_theta", rope_theta)


def check_attention_call(module: str, x) -> None:
    """The Attention modules' check of their input, before any op sees it."""
    if jnp.ndim(x) != 3:
        raise ValueError(f"jaxbwd.{module}: x must be [B, T, features] (rank 3), got shape {tuple(jnp.shape(x))}")


_ATTENTION_IMPL: contextvars.ContextVar = contextvars.ContextVar("jaxbwd_nn_attention_impl", default=None)


@contextlib.contextmanager
def attention_implementation(impl: Optional[str]):
    """The implementation of a MultiHeadAttention module, during its call: its default
    ``attention_fn`` passes it to the op per call (so that "pallas" with float64 inputs is
    the op's TypeError, as in every other module), and :func:`jaxbwd.config.use` makes it the
    default for a user's ``attention_fn`` that calls jaxbwd's ops itself."""
    if not jaxbwd.config.named(impl):  # the settings' default: nothing to pass on
        yield
        return
    token = _ATTENTION_IMPL.set(impl)
    try:
        with jaxbwd.config.use(implementation=impl):
            yield
    finally:
        _ATTENTION_IMPL.reset(token)


def attention_impl() -> Optional[str]:
    """The calling MultiHeadAttention module's implementation (None outside one)."""
    return _ATTENTION_IMPL.get()


def float_bias(bias, dtype):
    """An attention bias as the op takes it: flax adds a bool or integer bias to its float
    weights as 0/1 (or the integers), so such a bias is cast to ``dtype``."""
    if bias is not None and not jnp.issubdtype(jnp.result_type(bias), jnp.inexact):
        return jnp.asarray(bias).astype(dtype)
    return bias
