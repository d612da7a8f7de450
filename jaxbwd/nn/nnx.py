"""Flax NNX modules whose computation runs through jaxbwd's ops.

Each class subclasses the flax NNX module of the same name and replaces only
``__call__``: parameters (names, shapes, initialisers, metadata) are flax's own, so NNX
state moves across unchanged. Each constructor takes flax's arguments plus
``implementation=None|"pallas"|"xla"``.
"""
from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
from flax import nnx

import jaxbwd


def _value(p):
    return p[...] if hasattr(p, "__getitem__") else p.value


class _Impl:
    def _set_impl(self, implementation: Optional[str]):
        jaxbwd.config.resolve(implementation, type(self).__name__)
        self.implementation = implementation


class RMSNorm(nnx.RMSNorm, _Impl):
    """``flax.nnx.RMSNorm`` over the last axis via :func:`jaxbwd.rms_norm`.

    Call: x [..., num_features] floating -> same shape, x's dtype. Requires ``use_scale=True``
    and the default last-axis reduction. Errors: those of :func:`jaxbwd.rms_norm`; ValueError
    for other reduction axes. Source: Zhang & Sennrich (2019).
    """

    def __init__(self, num_features: int, *, implementation: Optional[str] = None, **kwargs):
        super().__init__(num_features, **kwargs)
        if self.reduction_axes not in (-1, (-1,)) or self.scale is None:
            raise ValueError("jaxbwd.nn.nnx.RMSNorm: only use_scale=True over the last axis is supported")
        self._set_impl(implementation)

    def __call__(self, x, mask=None):
        if mask is not None:
            raise ValueError("jaxbwd.nn.nnx.RMSNorm: mask is not supported, got a mask")
        return jaxbwd.rms_norm(x, _value(self.scale).astype(x.dtype), eps=self.epsilon,
                               implementation=self.implementation)


class LayerNorm(nnx.LayerNorm, _Impl):
    """``flax.nnx.LayerNorm`` over the last axis via :func:`jaxbwd.layer_norm`.

    Call: x [..., num_features] -> same shape, x's dtype. Requires scale and bias.
    Errors: those of :func:`jaxbwd.layer_norm`. Source: Ba et al. (2016).
    """

    def __init__(self, num_features: int, *, implementation: Optional[str] = None, **kwargs):
        super().__init__(num_features, **kwargs)
        if self.reduction_axes not in (-1, (-1,)) or self.scale is None or self.bias is None:
            raise ValueError("jaxbwd.nn.nnx.LayerNorm: only scale and bias over the last axis are supported")
        self._set_impl(implementation)

    def __call__(self, x, mask=None):
        if mask is not None:
            raise ValueError("jaxbwd.nn.nnx.LayerNorm: mask is not supported, got a mask")
        return jaxbwd.layer_norm(x, _value(self.scale).astype(x.dtype), _value(self.bias).astype(x.dtype),
                                 eps=self.epsilon, implementation=self.implementation)


class Linear(nnx.Linear, _Impl):
    """``flax.nnx.Linear`` via :func:`jaxbwd.matmul` and :func:`jaxbwd.bias_add`.

    Call: x [..., in_features] -> [..., out_features]. Errors: those of the two ops.
    """

    def __init__(self, in_features: int, out_features: int, *, implementation: Optional[str] = None, **kwargs):
        super().__init__(in_features, out_features, **kwargs)
        self._set_impl(implementation)

    def __call__(self, x, out_sharding=None):
        y = jaxbwd.matmul(x, _value(self.kernel).astype(x.dtype), implementation=self.implementation)
        if self.bias is not None:
            y = jaxbwd.bias_add(y, _value(self.bias).astype(y.dtype), implementation=self.implementation)
        return y


class Embed(nnx.Embed, _Impl):
    """``flax.nnx.Embed`` via :func:`jaxbwd.embed` (Pallas scatter-add backward).

    Call: ids int [...] -> [..., features]. ``attend(x)``: [..., features] ->
    [..., num_embeddings]. Errors: those of :func:`jaxbwd.embed`.
    """

    def __init__(self, num_embeddings: int, features: int, *, implementation: Optional[str] = None, **kwargs):
        super().__init__(num_embeddings, features, **kwargs)
        self._set_impl(implementation)

    def __call__(self, inputs, out_sharding=None):
        return jaxbwd.embed(inputs, _value(self.embedding), implementation=self.implementation)

    def attend(self, query, out_sharding=None):
        return jaxbwd.matmul(query, _value(self.embedding).T.astype(query.dtype), implementation=self.implementation)


class GroupNorm(nnx.GroupNorm, _Impl):
    """``flax.nnx.GroupNorm`` (channels last) via :func:`jaxbwd.group_norm`.

    Call: x [N, ..., num_features] -> same shape, x's dtype. ``activation="silu"`` fuses
    the SiLU that follows in UNet blocks. Requires scale and bias. Errors: those of
    :func:`jaxbwd.group_norm`. Source: Wu & He (2018).
    """

    def __init__(self, num_features: int, *, activation: Optional[str] = None,
                 implementation: Optional[str] = None, **kwargs):
        super().__init__(num_features, **kwargs)
        if self.scale is None or self.bias is None:
            raise ValueError("jaxbwd.nn.nnx.GroupNorm: use_scale and use_bias must be True")
        self.activation = activation
        self._set_impl(implementation)

    def __call__(self, x, mask=None):
        if mask is not None:
            raise ValueError("jaxbwd.nn.nnx.GroupNorm: mask is not supported, got a mask")
        return jaxbwd.group_norm(x, _value(self.scale).astype(x.dtype), _value(self.bias).astype(x.dtype),
                                 num_groups=self.num_groups, eps=self.epsilon, activation=self.activation,
                                 implementation=self.implementation)


class Conv(nnx.Conv, _Impl):
    """``flax.nnx.Conv`` for 2-D NHWC inputs via :func:`jaxbwd.conv2d` (+ :func:`jaxbwd.bias_add`).

    Call: x [N, H, W, in_features] -> [N, Ho, Wo, out_features]. Input dilation and masks
    are not supported (ValueError). Errors: those of :func:`jaxbwd.conv2d`.
    """

    def __init__(self, in_features: int, out_features: int, kernel_size, *,
                 implementation: Optional[str] = None, **kwargs):
        super().__init__(in_features, out_features, kernel_size, **kwargs)
        if len(self.kernel_shape) != 4 or self.mask is not None or self.input_dilation not in (1, (1, 1)):
            raise ValueError("jaxbwd.nn.nnx.Conv: only 2-D kernels without mask or input dilation are supported")
        self._set_impl(implementation)

    def __call__(self, x):
        y = jaxbwd.conv2d(x, _value(self.kernel).astype(x.dtype), stride=self.strides, padding=self.padding,
                          dilation=self.kernel_dilation, groups=self.feature_group_count,
                          implementation=self.implementation)
        if self.bias is not None:
            y = jaxbwd.bias_add(y, _value(self.bias).astype(y.dtype), implementation=self.implementation)
        return y


class SwiGLUMLP(nnx.Module, _Impl):
    """Gated MLP ``down(silu(gate(x)) * up(x))`` (Shazeer 2020) of three :class:`Linear` layers.

    Call: x [..., features] -> [..., features]; ``limit`` clamps as gpt-oss. Errors: those
    of the ops.
    """

    def __init__(self, features: int, hidden: int, *, limit: Optional[float] = None, use_bias: bool = False,
                 implementation: Optional[str] = None, rngs: nnx.Rngs):
        self._set_impl(implementation)
        lin = lambda i, o: Linear(i, o, use_bias=use_bias, implementation=implementation, rngs=rngs)
        self.gate, self.up, self.down = lin(features, hidden), lin(features, hidden), lin(hidden, features)
        self.limit = limit

    def __call__(self, x):
        h = jaxbwd.swiglu(self.gate(x), self.up(x), limit=self.limit, implementation=self.implementation)
        return self.down(h)


class Attention(nnx.Module, _Impl):
    """Causal GQA self-attention with RoPE: ``query``, ``key``, ``value``, ``out`` :class:`Linear` layers.

    Call: x [B, T, features] (optional ``segment_ids`` int [B, T], ``positions`` int [T] or
    [B, T]) -> [B, T, features]. Errors: those of :func:`jaxbwd.dot_product_attention` and
    :func:`jaxbwd.rope`. Source: Vaswani et al. (2017); GQA, Ainslie et al. (2023); RoPE, Su
    et al. (2021).
    """

    def __init__(self, features: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 rope_theta: float = 10000.0, is_causal: bool = True, implementation: Optional[str] = None,
                 rngs: nnx.Rngs):
        self._set_impl(implementation)
        lin = lambda i, o: Linear(i, o, use_bias=False, implementation=implementation, rngs=rngs)
        self.query = lin(features, num_heads * head_dim)
        self.key = lin(features, num_kv_heads * head_dim)
        self.value = lin(features, num_kv_heads * head_dim)
        self.out = lin(num_heads * head_dim, features)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rope_theta, self.is_causal = rope_theta, is_causal

    def __call__(self, x, *, segment_ids=None, positions=None):
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

    Errors: those of :func:`jaxbwd.pixel_shuffle`. Source: Shi et al. (2016).
    """

    def __init__(self, upscale_factor: int, *, implementation: Optional[str] = None):
        self._set_impl(implementation)
        self.upscale_factor = upscale_factor

    def __call__(self, x):
        return jaxbwd.pixel_shuffle(x, self.upscale_factor, implementation=self.implementation)


class Upsample(nnx.Module, _Impl):
    """Nearest or bilinear NHWC upsampling via :func:`jaxbwd.upsample2d` (no state).

    Errors: those of :func:`jaxbwd.upsample2d`. Source: as ``jax.image.resize``.
    """

    def __init__(self, scale=2, *, method: str = "nearest", implementation: Optional[str] = None):
        self._set_impl(implementation)
        self.scale, self.method = scale, method

    def __call__(self, x):
        return jaxbwd.upsample2d(x, self.scale, method=self.method, implementation=self.implementation)
