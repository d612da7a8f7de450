"""Flax NNX modules whose computation runs through jaxbwd's ops.

``RMSNorm``, ``LayerNorm``, ``GroupNorm``, ``BatchNorm``, ``Dropout``, ``Linear``, ``Embed`` and ``Conv`` subclass the
flax NNX module of the same name and take its constructor unchanged (positional order,
defaults, initialisers, metadata, ``dtype``/``param_dtype``/``promote_dtype``), plus
``implementation`` (None, ``"auto"``, ``"pallas"``, ``"xla"``, ``"pallas:triton"``,
``"pallas:mosaic"``: see :mod:`jaxbwd.config`): parameters are flax's own, so NNX state moves
across unchanged. ``__call__`` runs jaxbwd's ops on flax's promoted operands where they
cover the configuration (see each class, and :mod:`jaxbwd.nn.linen` for the same rules),
and flax's own ``__call__`` otherwise: no argument is ignored.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes as nnx_dtypes

import jaxbwd
from jaxbwd.nn import _kernels as K


__all__ = ["Attention", "BatchNorm", "Conv", "Dropout", "Embed", "GroupNorm", "LayerNorm", "Linear",
           "MultiHeadAttention", "PixelShuffle", "RMSNorm", "SwiGLUMLP", "Upsample", "dot_product_attention"]


def _value(p):
    return None if p is None else (p[...] if hasattr(p, "__getitem__") else p.value)


class _Impl:
    def _set_impl(self, implementation: Optional[str]):
        name = next(c.__name__ for c in type(self).__mro__ if c.__module__ == __name__ and c is not _Impl)
        jaxbwd.config.check_implementation(implementation, f"nn.nnx.{name}")
        self.implementation = implementation


class RMSNorm(nnx.RMSNorm, _Impl):
    """``flax.nnx.RMSNorm`` (same constructor); kernel path :func:`jaxbwd.rms_norm`.

    Kernel path: ``reduction_axes`` and ``feature_axes`` the last axis, no ``axis_name``,
    no ``mask``, ``epsilon > 0`` (``use_scale=False`` runs with a unit weight). x and scale
    are first promoted by the module's ``promote_dtype`` (``dtype``), as flax. Otherwise
    flax's ``__call__``. Call: x [..., num_features] -> same shape. Source: Zhang & Sennrich (2019).

    Extra: ``weight_offset=1.0`` gives Gemma's ``(1 + scale)`` (pass ``scale_init`` zeros);
    kernel path only (ValueError otherwise), and with ``use_scale=True``.

    Errors: ValueError for an unknown ``implementation`` or a nonzero ``weight_offset`` with
    ``use_scale=False`` (when the module is built), for ``weight_offset`` off the kernel path; on the kernel path those of
    :func:`jaxbwd.rms_norm` (TypeError for float64 with ``implementation="pallas"``); flax's
    own on flax's path.
    """

    def __init__(self, *args, weight_offset: float = 0.0, implementation: Optional[str] = None, **kwargs):
        super().__init__(*args, **kwargs)
        K.check_weight_offset("nn.nnx.RMSNorm", self.use_scale, weight_offset)
        self.weight_offset = weight_offset
        self._set_impl(implementation)

    def __call__(self, x, mask: Optional[jax.Array] = None):
        if not K.last_axis_stats(self, x, mask, self.dtype, _value(self.scale)):
            if self.weight_offset:
                K.refuse_weight_offset("nn.nnx.RMSNorm", self, x, mask)
            return super().__call__(x, mask=mask)
        xp, scale = self.promote_dtype((x, _value(self.scale)), dtype=self.dtype)
        if not K.takes_dtypes(xp, scale):  # a custom promote_dtype's 8-bit floats: flax's code
            if self.weight_offset:
                K.refuse_weight_offset("nn.nnx.RMSNorm", self, xp, mask)
            return super().__call__(x, mask=mask)
        x = xp
        out = self.dtype if self.dtype is not None else jnp.result_type(*[a for a in (x, scale) if a is not None])
        return K.rms_norm(x, scale, eps=self.epsilon, weight_offset=self.weight_offset, out_dtype=out,
                          impl=self.implementation)


class LayerNorm(nnx.LayerNorm, _Impl):
    """``flax.nnx.LayerNorm`` (same constructor); kernel path :func:`jaxbwd.layer_norm`.

    Kernel path: as :class:`RMSNorm`; ``use_scale``/``use_bias=False`` run with a unit
    weight / zero bias; ``use_fast_variance`` as :class:`jaxbwd.nn.LayerNorm`. Otherwise
    flax's ``__call__``. Call: x [..., num_features] -> same shape. Source: Ba et al. (2016).

    Errors: ValueError for an unknown ``implementation`` (when the module is built); on the
    kernel path those of :func:`jaxbwd.layer_norm` (TypeError for float64 with
    ``implementation="pallas"``); flax's own on flax's path.
    """

    def __init__(self, *args, implementation: Optional[str] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._set_impl(implementation)

    def __call__(self, x, *, mask: Optional[jax.Array] = None):
        if not K.last_axis_stats(self, x, mask, self.dtype, _value(self.scale), _value(self.bias)):
            return super().__call__(x, mask=mask)
        xp, scale, bias = self.promote_dtype((x, _value(self.scale), _value(self.bias)), dtype=self.dtype)
        if not K.takes_dtypes(xp, scale, bias):  # a custom promote_dtype's 8-bit floats: flax's code
            return super().__call__(x, mask=mask)
        x = xp
        out = self.dtype if self.dtype is not None else jnp.result_type(*[a for a in (x, scale, bias) if a is not None])
        return K.layer_norm(x, scale, bias, eps=self.epsilon, out_dtype=out, impl=self.implementation)


class Linear(nnx.Linear, _Impl):
    """``flax.nnx.Linear`` (same constructor); kernel path :func:`jaxbwd.matmul` + :func:`jaxbwd.bias_add`.

    Kernel path: ``precision=None``, the default ``dot_general``, no
    ``preferred_element_type``, no ``out_sharding`` at the call; operands promoted by the
    module's ``promote_dtype``. Otherwise flax's ``__call__``.
    Call: x [..., in_features] -> [..., out_features].

    Errors: ValueError for an unknown ``implementation`` (when the module is built); on the
    kernel path those of :func:`jaxbwd.matmul` and :func:`jaxbwd.bias_add` (TypeError for
    float64 with a bias and ``implementation="pallas"``); flax's own on flax's path.

    Source: flax's ``nnx.Linear`` (``y = x W + b``); the gradients are the matmul's
    ``dx = dy W^T``, ``dW = x^T dy`` and the bias's column sum.
    """

    def __init__(self, *args, implementation: Optional[str] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._set_impl(implementation)

    def __call__(self, inputs, out_sharding=None):
        if (out_sharding is not None or self.precision is not None or self.dot_general is not jax.lax.dot_general
                or getattr(self, "dot_general_cls", None) is not None or self.preferred_element_type is not None
                or jnp.ndim(inputs) == 0 or not K.takes_dtypes(inputs, self.dtype, _value(self.kernel))):
            return super().__call__(inputs, out_sharding=out_sharding)
        promoted = self.promote_dtype((inputs, _value(self.kernel), _value(self.bias)), dtype=self.dtype)
        if not K.takes_dtypes(*promoted):  # a custom promote_dtype's 8-bit floats: flax's code
            return super().__call__(inputs, out_sharding=out_sharding)
        return K.dense(*promoted, self.implementation)


class Embed(nnx.Embed, _Impl):
    """``flax.nnx.Embed`` (same constructor); kernel path :func:`jaxbwd.embed` (Pallas scatter-add backward).

    Kernel path as :class:`jaxbwd.nn.Embed` (floating promoted table, ``num_embeddings > 1``,
    jnp.take's wrap/NaN conventions for out-of-range ids), and no ``out_sharding``.
    ``attend(query)`` runs :func:`jaxbwd.matmul` on flax's promoted operands.
    Call: ids int [...] -> [..., features].

    Errors: ValueError for an unknown ``implementation`` (when the module is built); on the
    kernel path those of :func:`jaxbwd.embed` (TypeError for float64 with
    ``implementation="pallas"``); flax's ValueError for ids that are not integers; flax's own
    on flax's path.

    Source: flax's ``nnx.Embed``; the table gradient is the scatter-add of the output
    cotangent rows at the ids (:func:`jaxbwd.embed`).
    """

    def __init__(self, *args, implementation: Optional[str] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._set_impl(implementation)

    def __call__(self, inputs, out_sharding=None):
        if out_sharding is not None or not jnp.issubdtype(inputs.dtype, jnp.integer) or self.num_embeddings == 1:
            return super().__call__(inputs, out_sharding=out_sharding)
        (embedding,) = self.promote_dtype((_value(self.embedding),), dtype=self.dtype, inexact=False)
        if not K.op_float(embedding.dtype):
            return super().__call__(inputs)
        return K.embed_lookup(inputs, embedding, self.implementation)

    def attend(self, query, out_sharding=None):
        query, embedding = self.promote_dtype((query, _value(self.embedding)), dtype=self.dtype)
        if out_sharding is not None or jnp.ndim(query) == 0 or not K.op_float(embedding.dtype):
            return super().attend(query, out_sharding=out_sharding)
        return K.attend(query, embedding, self.implementation)

    def attend_cross_entropy(self, query, labels, **kwargs):
        """``cross_entropy(attend(query), labels)`` by :func:`jaxbwd.linear_cross_entropy`
        without storing the logits; as :meth:`jaxbwd.nn.Embed.attend_cross_entropy`."""
        query, embedding = self.promote_dtype((query, _value(self.embedding)), dtype=self.dtype)
        return K.attend_cross_entropy(query, embedding, labels, self.implementation, kwargs)


class GroupNorm(nnx.GroupNorm, _Impl):
    """``flax.nnx.GroupNorm`` (same constructor, ``num_groups``/``group_size`` positional too),
    channels last; kernel path :func:`jaxbwd.group_norm`.

    Kernel path: x of rank >= 2, ``reduction_axes`` None or flax's default (every axis but
    the first), no ``axis_name``, no ``mask``, ``epsilon > 0``. Otherwise flax's ``__call__``.
    Extra: ``activation="silu"`` fuses the SiLU that UNet blocks apply next (applied after
    flax's result on the other path). Call: x [N, ..., num_features] -> same shape.
    Source: Wu & He (2018).

    Errors: ValueError for an unknown ``implementation`` (when the module is built); on the
    kernel path those of :func:`jaxbwd.group_norm` (TypeError for float64 with
    ``implementation="pallas"``); ValueError for an ``activation`` other than None or "silu"
    (when built); flax's own on flax's path.
    """

    def __init__(self, *args, activation: Optional[str] = None, implementation: Optional[str] = None, **kwargs):
        super().__init__(*args, **kwargs)
        K.check_activation("nn.nnx.GroupNorm", activation)
        self.activation = activation
        self._set_impl(implementation)

    def __call__(self, x, *, mask: Optional[jax.Array] = None):
        # x's channels not the constructor's (possible without scale and bias): flax's code raises.
        if not (K.plain_stats(self, mask) and K.group_norm_covered(x, self.reduction_axes, self.num_groups)
                and jnp.shape(x)[-1:] == (self.num_groups * self.group_size,)
                and K.takes_dtypes(x, self.dtype, _value(self.scale), _value(self.bias))):
            y = super().__call__(x, mask=mask)
            return y if self.activation is None else jaxbwd.silu(y, implementation=self.implementation)
        xp, scale, bias = self.promote_dtype((x, _value(self.scale), _value(self.bias)), dtype=self.dtype)
        if not K.takes_dtypes(xp, scale, bias):  # a custom promote_dtype's 8-bit floats: flax's code
            y = super().__call__(x, mask=mask)
            return y if self.activation is None else jaxbwd.silu(y, implementation=self.implementation)
        x = xp
        out = self.dtype if self.dtype is not None else jnp.result_type(*[a for a in (x, scale, bias) if a is not None])
        return K.group_norm(x, scale, bias, num_groups=self.num_groups, eps=self.epsilon,
                            activation=self.activation, out_dtype=out, impl=self.implementation)


class Conv(nnx.Conv, _Impl):
    """``flax.nnx.Conv`` (same constructor, ``strides`` positional too); kernel path
    :func:`jaxbwd.conv2d` (+ :func:`jaxbwd.bias_add`).

    Kernel path as :class:`jaxbwd.nn.Conv` (1-D/2-D kernels, every padding mode but 3-D and
    other strings, no input dilation, ``mask`` multiplied in, any batch dims), plus the
    default ``conv_general_dilated``, no ``preferred_element_type``, no ``out_sharding``.
    Otherwise flax's ``__call__``.

    dtypes: x and kernel float32, bfloat16 or float16 (float64 on the XLA path); the
    result's dtype is flax's. Errors: ValueError for an unknown ``implementation`` (when the
    module is built); on the kernel path those of :func:`jaxbwd.conv2d` (TypeError for
    float64 with ``implementation="pallas"``); flax's own on flax's path.

    Source: flax's ``nnx.Conv``; the backward is :func:`jaxbwd.conv2d`'s implicit-GEMM
    dgrad and wgrad.
    """

    def __init__(self, *args, implementation: Optional[str] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._set_impl(implementation)

    def __call__(self, inputs, out_sharding=None):
        ks = tuple(self.kernel_size)
        spatial = jnp.shape(inputs)[-len(ks) - 1:-1]
        if not (out_sharding is None
                and K.conv_covered(ks, self.padding, self.input_dilation, spatial, self.kernel_dilation)
                and self.precision is None and self.conv_general_dilated is jax.lax.conv_general_dilated
                and self.preferred_element_type is None and jnp.ndim(inputs) >= len(ks) + 1
                and (self.mask is None or self.mask.shape == self.kernel_shape)
                and min(self.kernel_shape) > 0 and jnp.shape(inputs)[-1] > 0
                and K.takes_dtypes(inputs, self.dtype, _value(self.kernel))):
            return super().__call__(inputs, out_sharding=out_sharding)
        kernel = _value(self.kernel)
        if self.mask is not None:
            kernel = kernel * self.mask
        inputs_p, kernel, bias = self.promote_dtype((inputs, kernel, _value(self.bias)), dtype=self.dtype)
        if not K.takes_dtypes(inputs_p, kernel, bias):  # a custom promote_dtype's 8-bit floats: flax's code
            return super().__call__(inputs, out_sharding=out_sharding)
        return K.conv(inputs_p, kernel, bias, kernel_size=ks, strides=self.strides, padding=self.padding,
                      kernel_dilation=self.kernel_dilation, feature_group_count=self.feature_group_count,
                      impl=self.implementation)


def dot_product_attention(query, key, value, bias=None, mask=None, broadcast_dropout=True, dropout_rng=None,
                          dropout_rate=0.0, deterministic=False, dtype=None, precision=None, module=None,
                          promote_dtype=nnx.nn.dtypes.promote_dtype, is_causal=False):
    """``flax.nnx.dot_product_attention`` (same signature) on :func:`jaxbwd.dot_product_attention`.

    Where flax's own function calls ``jax.nn.dot_product_attention`` (no dropout, nothing
    sown), this runs jaxbwd's op with jax.nn's meaning: ``is_causal``, GQA (fewer kv
    heads) and unbatched inputs on the flash kernels, a dense ``bias``/``mask`` on the op's
    documented XLA path, several batch dims flattened as flax does. ``precision`` is
    ignored there by flax too. Otherwise (dropout, ``module``, no keys) flax's function runs.
    Source: Vaswani et al. (2017).

    Shapes: query [batch..., q_len, heads, depth] (or unbatched [q_len, heads, depth]),
    key/value [batch..., kv_len, kv_heads, depth] -> query's shape, in the dtype the
    inputs are promoted to (``dtype``, else their promoted type), as flax.

    Errors: on jaxbwd's path those of :func:`jaxbwd.dot_product_attention` (e.g. ValueError
    for query heads that are not a multiple of the key heads), flax's own on flax's path.
    """
    if (dropout_rate != 0.0 or module is not None or query.ndim < 3 or key.shape[-3] == 0
            or not K.takes_dtypes(query, key, value)):
        return nnx.dot_product_attention(query, key, value, bias, mask, broadcast_dropout, dropout_rng, dropout_rate,
                                         deterministic, dtype, precision, module, promote_dtype, is_causal)
    query, key, value = promote_dtype((query, key, value), dtype=dtype)
    bias = K.float_bias(bias, query.dtype)
    shape = query.shape
    if query.ndim > 4:
        flat = lambda x: None if x is None else x.reshape((-1,) + x.shape[-3:])
        query, key, value, bias, mask = flat(query), flat(key), flat(value), flat(bias), flat(mask)
    mask = None if mask is None else mask.astype(jnp.bool_)
    return jaxbwd.dot_product_attention(query, key, value, bias, mask, is_causal=is_causal,
                                        implementation=K.attention_impl()).reshape(shape)


class MultiHeadAttention(nnx.MultiHeadAttention, _Impl):
    """``flax.nnx.MultiHeadAttention`` (same constructor) whose default ``attention_fn`` is
    :func:`dot_product_attention` above; projections, norms, decode cache and state are
    flax's. ``implementation`` applies to the attention op (and, via
    :func:`jaxbwd.config.use`, to jaxbwd's ops in a user's ``attention_fn``).
    Source: Vaswani et al. (2017).

    Call shapes, dtypes and errors: as :class:`jaxbwd.nn.MultiHeadDotProductAttention`.
    """

    def __init__(self, *args, attention_fn=dot_product_attention, implementation: Optional[str] = None, **kwargs):
        super().__init__(*args, attention_fn=attention_fn, **kwargs)
        self._set_impl(implementation)

    def __call__(self, *args, **kwargs):
        with K.attention_implementation(self.implementation):
            return super().__call__(*args, **kwargs)


class SwiGLUMLP(nnx.Module, _Impl):
    """Gated MLP ``down(silu(gate(x)) * up(x))`` (Shazeer 2020) of three :class:`Linear` layers.

    Call: x [..., features] -> [..., features]; ``limit`` clamps as gpt-oss. Errors:
    TypeError/ValueError naming the module, at construction, for ``features`` or ``hidden``
    not an int >= 1, or an unknown ``implementation``; then those of the ops.

    dtypes: float32, bfloat16 or float16 (float64 on the XLA path); the parameters are
    float32 and the result is x promoted with them, as in flax's Dense: float32 for 16-bit
    and float32 x, float64 for float64 x (an integer x is promoted too: float32).

    Source: Shazeer, "GLU Variants Improve Transformer" (2020), the SwiGLU variant.
    """

    def __init__(self, features: int, hidden: int, *, limit: Optional[float] = None, use_bias: bool = False,
                 implementation: Optional[str] = None, rngs: nnx.Rngs):
        self._set_impl(implementation)
        K.check_sizes("nn.nnx.SwiGLUMLP", features=features, hidden=hidden)
        lin = lambda i, o: Linear(i, o, use_bias=use_bias, implementation=implementation, rngs=rngs)
        self.gate, self.up, self.down = lin(features, hidden), lin(features, hidden), lin(hidden, features)
        self.limit = limit

    def __call__(self, x):
        h = jaxbwd.swiglu(self.gate(x), self.up(x), limit=self.limit, implementation=self.implementation)
        return self.down(h)


class Attention(nnx.Module, _Impl):
    """Causal GQA self-attention with RoPE: ``query``, ``key``, ``value``, ``out`` :class:`Linear` layers.

    Call: x [B, T, features] (optional ``segment_ids`` int [B, T], ``positions`` int [T] or
    [B, T]) -> [B, T, features]. Errors: TypeError/ValueError naming the module, at
    construction, for a size that is not an int >= 1, num_heads not a multiple of
    num_kv_heads, an odd head_dim, rope_theta <= 0 or an unknown ``implementation``; then
    those of :func:`jaxbwd.dot_product_attention` and :func:`jaxbwd.rope`. Source: Vaswani
    et al. (2017); GQA, Ainslie et al. (2023); RoPE, Su et al. (2021).

    dtypes: x float32, bfloat16 or float16 (float64 on the XLA path); the parameters are
    float32 and the result is x promoted with them, as in flax's Dense: float32 for 16-bit
    and float32 x, float64 for float64 x (an integer x is promoted too: float32).
    """

    def __init__(self, features: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 rope_theta: float = 10000.0, is_causal: bool = True, implementation: Optional[str] = None,
                 rngs: nnx.Rngs):
        self._set_impl(implementation)
        K.check_sizes("nn.nnx.Attention", features=features)
        K.check_attention_config("nn.nnx.Attention", num_heads, num_kv_heads, head_dim, rope_theta)
        lin = lambda i, o: Linear(i, o, use_bias=False, implementation=implementation, rngs=rngs)
        self.query = lin(features, num_heads * head_dim)
        self.key = lin(features, num_kv_heads * head_dim)
        self.value = lin(features, num_kv_heads * head_dim)
        self.out = lin(num_heads * head_dim, features)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rope_theta, self.is_causal = rope_theta, is_causal

    def __call__(self, x, *, segment_ids=None, positions=None):
        K.check_attention_call("nn.nnx.Attention", x)
        Bsz, T, _ = x.shape
        impl = self.implementation
        q = self.query(x).reshape(Bsz, T, self.num_heads, self.head_dim)
        k = self.key(x).reshape(Bsz, T, self.num_kv_heads, self.head_dim)
        v = self.value(x).reshape(Bsz, T, self.num_kv_heads, self.head_dim)
        q = jaxbwd.rope(q, positions=positions, theta=self.rope_theta, implementation=impl)
        k = jaxbwd.rope(k, positions=positions, theta=self.rope_theta, implementation=impl)
        o = jaxbwd.dot_product_attention(q, k, v, is_causal=self.is_causal, segment_ids=segment_ids,
                                         implementation=impl)
        return self.out(o.reshape(Bsz, T, self.num_heads * self.head_dim))


class PixelShuffle(nnx.Module, _Impl):
    """Depth to space [N, H, W, C*r*r] -> [N, H*r, W*r, C] via :func:`jaxbwd.pixel_shuffle` (no state).

    Errors: ValueError for an unknown ``implementation`` (when the module is built); at the
    call those of :func:`jaxbwd.pixel_shuffle`. Source: Shi et al. (2016).

    dtypes: float32, bfloat16 or float16 (float64 on the XLA path), kept.
    """

    def __init__(self, upscale_factor: int, *, implementation: Optional[str] = None):
        self._set_impl(implementation)
        self.upscale_factor = upscale_factor

    def __call__(self, x):
        return jaxbwd.pixel_shuffle(x, self.upscale_factor, implementation=self.implementation)


class Upsample(nnx.Module, _Impl):
    """Nearest or bilinear NHWC upsampling via :func:`jaxbwd.upsample2d` (no state).

    Errors: ValueError for an unknown ``implementation`` (when the module is built); at the
    call those of :func:`jaxbwd.upsample2d`. Source: as ``jax.image.resize``.

    Call: x [N, H, W, C] float32, bfloat16 or float16 (float64 on the XLA path) -> [N, H*sh,
    W*sw, C] for ``scale`` (sh, sw) (an int s: sh = sw = s), same dtype.
    """

    def __init__(self, scale=2, *, method: str = "nearest", implementation: Optional[str] = None):
        self._set_impl(implementation)
        self.scale, self.method = scale, method

    def __call__(self, x):
        return jaxbwd.upsample2d(x, self.scale, method=self.method, implementation=self.implementation)


class BatchNorm(nnx.BatchNorm, _Impl):
    """``flax.nnx.BatchNorm`` (same constructor); kernel path :func:`jaxbwd.batch_norm`.

    Kernel path: an int ``axis``, x of rank >= 2 and not empty, no ``mask``, no ``axis_index_groups``,
    static ``epsilon > 0`` and ``momentum`` in [0, 1]; ``axis_name`` is supported
    (cross-device statistics); ``use_scale``/``use_bias=False`` run with a unit weight / zero
    bias. As flax: x, the running statistics and the parameters are promoted together by the
    module's ``promote_dtype`` (``dtype``); the result's dtype is flax's; in training
    (``use_running_average=False``) the stored running statistics ``mean``/``var`` [C] are
    updated from their stored values (float32), in eval the promoted ones normalise. Batch
    statistics are float32, two-pass, whatever ``use_fast_variance``. Otherwise flax's
    ``__call__``.
    Call: x [N, ..., C] (channels on ``axis``) -> same shape. Source: Ioffe & Szegedy (2015).

    Errors: ValueError for an unknown ``implementation`` (when the module is built); on the
    kernel path those of :func:`jaxbwd.batch_norm` (TypeError for float64 with
    ``implementation="pallas"``); flax's own on flax's path.
    """

    def __init__(self, *args, implementation: Optional[str] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._set_impl(implementation)

    def __call__(self, x, use_running_average: Optional[bool] = None, *, mask: Optional[jax.Array] = None):
        use_ra = self.use_running_average if use_running_average is None else use_running_average
        if not (use_ra is not None and isinstance(self.axis, int) and mask is None and self.axis_index_groups is None
                and K.static_real(self.epsilon) and self.epsilon > 0 and K.static_real(self.momentum)
                and 0 <= self.momentum <= 1
                and jnp.ndim(x) >= 2 and jnp.size(x) > 0 and K.takes_dtypes(x, self.dtype, _value(self.scale), _value(self.bias))):
            return super().__call__(x, use_running_average, mask=mask)
        promoted = self.promote_dtype(
            (x, self.mean[...], self.var[...], _value(self.scale), _value(self.bias)), dtype=self.dtype)
        if not K.takes_dtypes(*promoted):  # a custom promote_dtype's 8-bit floats: flax's code
            return super().__call__(x, use_running_average, mask=mask)
        x, mean, var, scale, bias = promoted
        # As flax's _normalize: the result's dtype from x, scale, bias and ``dtype``; the op runs
        # in the wider of that and the operands (its statistics are float32 either way).
        out = nnx_dtypes.canonicalize_dtype(*[a for a in (x, scale, bias) if a is not None], dtype=self.dtype)
        ct = K.compute_dtype(out, x, scale, bias)
        c = x.shape[self.axis]
        w = jnp.ones((c,), ct) if scale is None else scale.astype(ct)
        b = jnp.zeros((c,), ct) if bias is None else bias.astype(ct)
        kw = dict(eps=self.epsilon, momentum=self.momentum, axis=self.axis, axis_name=self.axis_name,
                  implementation=self.implementation)
        if use_ra:  # flax normalises with the promoted running statistics
            return jaxbwd.batch_norm(x.astype(ct), w, b, running_mean=mean, running_var=var, training=False,
                                     **kw).astype(out)
        # flax updates the stored (float32) statistics, not their promoted copies
        y, new = jaxbwd.batch_norm(x.astype(ct), w, b, running_mean=self.mean[...], running_var=self.var[...],
                                   training=True, **kw)
        self.mean[...], self.var[...] = new["mean"], new["var"]
        return y.astype(out)


class Dropout(nnx.Dropout, _Impl):
    """``flax.nnx.Dropout`` (same constructor); kernel path :func:`jaxbwd.dropout`, whose
    backward regenerates the mask from the key instead of saving it.

    Kernel path as :class:`jaxbwd.nn.Dropout` (floating inputs, a static ``rate`` in
    (0, 1), no ``broadcast_dims``, a threefry key); otherwise flax's ``__call__``. The key
    is drawn as flax draws it (``rngs`` of the call, else the constructor's; a ``Rngs``
    gives its ``rng_collection`` stream), the mask from it is jaxbwd's counter hash: flax's
    keep probability and scaling, other elements. Call: x [...] -> same shape and dtype.
    Source: Srivastava et al. (JMLR 2014).

    Errors: ValueError for an unknown ``implementation`` (when the module is built); on the
    kernel path those of :func:`jaxbwd.dropout` (TypeError for float64 with
    ``implementation="pallas"``); flax's own on flax's path.
    """

    def __init__(self, *args, implementation: Optional[str] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._set_impl(implementation)

    def __call__(self, inputs, *, deterministic: Optional[bool] = None, rngs=None):
        det = self.deterministic if deterministic is None else deterministic
        source = self.rngs if rngs is None else rngs
        if det is not False or source is None or not K.dropout_covered(inputs, self.rate, self.broadcast_dims):
            return super().__call__(inputs, deterministic=deterministic, rngs=rngs)  # flax's result or error
        if isinstance(source, nnx.Rngs):
            key = source[self.rng_collection]()
        elif isinstance(source, nnx.RngStream):
            key = source()
        elif isinstance(source, jax.Array):
            key = source
        else:
            return super().__call__(inputs, deterministic=deterministic, rngs=rngs)  # flax's TypeError
        if not K.threefry_key(key):
            return super().__call__(inputs, deterministic=deterministic, rngs=key)
        return jaxbwd.dropout(inputs, self.rate, rng=key, implementation=self.implementation)
