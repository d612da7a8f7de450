"""Flax linen modules whose computation runs through jaxbwd's ops.

Parameter names, shapes and default initialisers follow ``flax.linen``'s own modules
(``RMSNorm.scale``, ``LayerNorm.scale/bias``, ``Embed.embedding``, ``Dense.kernel/bias``),
so parameters move across unchanged: ``jaxbwd.nn.RMSNorm()`` is a drop-in for
``flax.linen.RMSNorm()``. Every module takes ``implementation`` (``None``, ``"pallas"``,
``"xla"``), passed to each op it calls.
"""
from __future__ import annotations

from typing import Any, Optional

import flax.linen as fnn
import jax
import jax.numpy as jnp

import jaxbwd

Initializer = Any


class RMSNorm(fnn.Module):
    """RMSNorm over the last axis; params ``scale`` [D] (init ones), as ``flax.linen.RMSNorm``.

    Call: x [..., D] floating -> [..., D] in x's dtype. ``weight_offset=1.0`` gives Gemma's
    ``(1 + scale)`` (then initialise ``scale`` to zeros). Errors: those of :func:`jaxbwd.rms_norm`.
    Source: Zhang & Sennrich (2019).
    """

    epsilon: float = 1e-6
    weight_offset: float = 0.0
    param_dtype: Any = jnp.float32
    scale_init: Initializer = fnn.initializers.ones
    implementation: Optional[str] = None

    @fnn.compact
    def __call__(self, x):
        scale = self.param("scale", self.scale_init, (x.shape[-1],), self.param_dtype)
        return jaxbwd.rms_norm(x, scale.astype(x.dtype) if x.dtype != scale.dtype else scale,
                               eps=self.epsilon, weight_offset=self.weight_offset,
                               implementation=self.implementation)


class LayerNorm(fnn.Module):
    """LayerNorm over the last axis; params ``scale`` (ones) and ``bias`` (zeros), as flax.

    Call: x [..., D] floating -> [..., D] in x's dtype. Errors: those of :func:`jaxbwd.layer_norm`.
    Source: Ba et al. (2016).
    """

    epsilon: float = 1e-6
    param_dtype: Any = jnp.float32
    scale_init: Initializer = fnn.initializers.ones
    bias_init: Initializer = fnn.initializers.zeros
    implementation: Optional[str] = None

    @fnn.compact
    def __call__(self, x):
        d = x.shape[-1]
        scale = self.param("scale", self.scale_init, (d,), self.param_dtype)
        bias = self.param("bias", self.bias_init, (d,), self.param_dtype)
        return jaxbwd.layer_norm(x, scale, bias, eps=self.epsilon, implementation=self.implementation)


class Embed(fnn.Module):
    """Token embedding; param ``embedding`` [num_embeddings, features], flax's default init.

    Call: ids int [...] -> [..., features] in ``param_dtype``. ``attend(x)``: x [..., features]
    -> logits [..., num_embeddings] (tied output projection, via :func:`jaxbwd.matmul`).
    Errors: those of :func:`jaxbwd.embed`. Source: a lookup table; backward is a scatter-add.
    """

    num_embeddings: int
    features: int
    param_dtype: Any = jnp.float32
    embedding_init: Initializer = fnn.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)
    implementation: Optional[str] = None

    def setup(self):
        self.embedding = self.param(
            "embedding", self.embedding_init, (self.num_embeddings, self.features), self.param_dtype
        )

    def __call__(self, ids):
        return jaxbwd.embed(ids, self.embedding, implementation=self.implementation)

    def attend(self, x):
        return jaxbwd.matmul(x, self.embedding.T.astype(x.dtype), implementation=self.implementation)


class Dense(fnn.Module):
    """Affine layer; params ``kernel`` [in, features] (lecun_normal) and ``bias`` [features] (zeros).

    Call: x [..., in] -> [..., features]. Uses :func:`jaxbwd.matmul` and :func:`jaxbwd.bias_add`.
    Errors: those of the two ops. Source: as ``flax.linen.Dense``.
    """

    features: int
    use_bias: bool = True
    param_dtype: Any = jnp.float32
    kernel_init: Initializer = fnn.initializers.lecun_normal()
    bias_init: Initializer = fnn.initializers.zeros
    implementation: Optional[str] = None

    @fnn.compact
    def __call__(self, x):
        kernel = self.param("kernel", self.kernel_init, (x.shape[-1], self.features), self.param_dtype)
        y = jaxbwd.matmul(x, kernel.astype(x.dtype), implementation=self.implementation)
        if self.use_bias:
            bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype)
            y = jaxbwd.bias_add(y, bias.astype(y.dtype), implementation=self.implementation)
        return y


class SwiGLUMLP(fnn.Module):
    """Gated MLP ``down(silu(gate(x)) * up(x))`` (Shazeer 2020); submodules ``gate``, ``up``, ``down``.

    Call: x [..., D] -> [..., D]. ``limit`` clamps as gpt-oss. Errors: those of the ops.
    """

    hidden: int
    limit: Optional[float] = None
    use_bias: bool = False
    implementation: Optional[str] = None

    @fnn.compact
    def __call__(self, x):
        dense = lambda n, name: Dense(n, use_bias=self.use_bias, implementation=self.implementation, name=name)
        h = jaxbwd.swiglu(dense(self.hidden, "gate")(x), dense(self.hidden, "up")(x),
                          limit=self.limit, implementation=self.implementation)
        return dense(x.shape[-1], "down")(h)


class Attention(fnn.Module):
    """Causal GQA self-attention with RoPE; submodules ``query``, ``key``, ``value``, ``out`` (Dense).

    Call: x [B, T, D] (optional ``segment_ids`` int [B, T], ``positions`` int [B, T] or [T])
    -> [B, T, D]. ``num_heads % num_kv_heads == 0``. Errors: those of
    :func:`jaxbwd.dot_product_attention` and :func:`jaxbwd.rope`.
    Source: Vaswani et al. (2017); GQA, Ainslie et al. (2023); RoPE, Su et al. (2021).
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    is_causal: bool = True
    implementation: Optional[str] = None

    @fnn.compact
    def __call__(self, x, *, segment_ids=None, positions=None):
        B, T, _ = x.shape
        impl = self.implementation
        dense = lambda n, name: Dense(n, use_bias=False, implementation=impl, name=name)
        q = dense(self.num_heads * self.head_dim, "query")(x).reshape(B, T, self.num_heads, self.head_dim)
        k = dense(self.num_kv_heads * self.head_dim, "key")(x).reshape(B, T, self.num_kv_heads, self.head_dim)
        v = dense(self.num_kv_heads * self.head_dim, "value")(x).reshape(B, T, self.num_kv_heads, self.head_dim)
        q = jaxbwd.rope(q, positions=positions, theta=self.rope_theta, implementation=impl)
        k = jaxbwd.rope(k, positions=positions, theta=self.rope_theta, implementation=impl)
        o = jaxbwd.dot_product_attention(q, k, v, is_causal=self.is_causal, segment_ids=segment_ids,
                                         implementation=impl)
        return dense(x.shape[-1], "out")(o.reshape(B, T, self.num_heads * self.head_dim))


class GroupNorm(fnn.Module):
    """GroupNorm over (spatial, channels of a group), channels last; params ``scale``, ``bias``.

    As ``flax.linen.GroupNorm`` (``num_groups=32``, ``epsilon=1e-6``). ``activation="silu"``
    fuses the SiLU that UNet blocks apply next. Call: x [N, ..., C] -> same shape and dtype.
    Errors: those of :func:`jaxbwd.group_norm`. Source: Wu & He (2018).
    """

    num_groups: int = 32
    epsilon: float = 1e-6
    activation: Optional[str] = None
    param_dtype: Any = jnp.float32
    scale_init: Initializer = fnn.initializers.ones
    bias_init: Initializer = fnn.initializers.zeros
    implementation: Optional[str] = None

    @fnn.compact
    def __call__(self, x):
        c = x.shape[-1]
        scale = self.param("scale", self.scale_init, (c,), self.param_dtype)
        bias = self.param("bias", self.bias_init, (c,), self.param_dtype)
        return jaxbwd.group_norm(x, scale.astype(x.dtype), bias.astype(x.dtype), num_groups=self.num_groups,
                                 eps=self.epsilon, activation=self.activation, implementation=self.implementation)


class Conv(fnn.Module):
    """2-D convolution, NHWC; params ``kernel`` [kh, kw, Cin/groups, features] and ``bias``.

    As ``flax.linen.Conv`` for 2-D inputs (lecun_normal kernel, zero bias, padding "SAME").
    Call: x [N, H, W, Cin] -> [N, Ho, Wo, features]. Errors: those of :func:`jaxbwd.conv2d`.
    Source: implicit-GEMM dgrad/wgrad kernels (see :func:`jaxbwd.conv2d`).
    """

    features: int
    kernel_size: tuple = (3, 3)
    strides: Any = 1
    padding: Any = "SAME"
    kernel_dilation: Any = 1
    feature_group_count: int = 1
    use_bias: bool = True
    param_dtype: Any = jnp.float32
    kernel_init: Initializer = fnn.initializers.lecun_normal()
    bias_init: Initializer = fnn.initializers.zeros
    implementation: Optional[str] = None

    @fnn.compact
    def __call__(self, x):
        kh, kw = self.kernel_size
        cin = x.shape[-1] // self.feature_group_count
        kernel = self.param("kernel", self.kernel_init, (kh, kw, cin, self.features), self.param_dtype)
        y = jaxbwd.conv2d(x, kernel.astype(x.dtype), stride=self.strides, padding=self.padding,
                          dilation=self.kernel_dilation, groups=self.feature_group_count,
                          implementation=self.implementation)
        if self.use_bias:
            bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype)
            y = jaxbwd.bias_add(y, bias.astype(y.dtype), implementation=self.implementation)
        return y


class PixelShuffle(fnn.Module):
    """Depth to space: [N, H, W, C*r*r] -> [N, H*r, W*r, C] (no parameters).

    Errors: those of :func:`jaxbwd.pixel_shuffle`. Source: Shi et al. (2016).
    """

    upscale_factor: int
    implementation: Optional[str] = None

    def __call__(self, x):
        return jaxbwd.pixel_shuffle(x, self.upscale_factor, implementation=self.implementation)


class Upsample(fnn.Module):
    """Nearest or bilinear upsampling of NHWC images by integer factors (no parameters).

    Errors: those of :func:`jaxbwd.upsample2d`. Source: as ``jax.image.resize``.
    """

    scale: Any = 2
    method: str = "nearest"
    implementation: Optional[str] = None

    def __call__(self, x):
        return jaxbwd.upsample2d(x, self.scale, method=self.method, implementation=self.implementation)
