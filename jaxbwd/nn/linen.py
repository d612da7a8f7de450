"""Flax linen modules whose computation runs through jaxbwd's ops.

``RMSNorm``, ``LayerNorm``, ``GroupNorm``, ``BatchNorm``, ``Dropout``, ``Dense``, ``Embed`` and ``Conv`` subclass flax's
own modules of the same name: every flax argument, in flax's positional order, with flax's
defaults, parameter names, initialisers and dtype promotion (``dtype``, ``param_dtype``,
``promote_dtype``). Each adds ``implementation`` (``None``, ``"auto"``, ``"pallas"``, ``"xla"``,
``"pallas:triton"``, ``"pallas:mosaic"``: see :mod:`jaxbwd.config`), passed to each op it calls. A configuration jaxbwd's ops cover (see each class) runs on them; any
other runs flax's own ``__call__``, so the result is flax's: no argument is ignored.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import flax.linen as fnn
import jax
import jax.numpy as jnp
from flax.linen.dtypes import canonicalize_dtype

import jaxbwd
from jaxbwd.nn import _kernels as K

Initializer = Any


def _param_specs(dtype, kernel_shape, bias_shape, use_bias):
    """Shapes and dtypes of a kernel and (when used) a bias not yet created, for
    :func:`_kernels.promotes_to_op_dtypes`."""
    return (jax.ShapeDtypeStruct(kernel_shape, dtype),
            jax.ShapeDtypeStruct(bias_shape, dtype) if use_bias else None)


class _Impl:
    """Checks ``implementation`` when the module is built, as the NNX modules do: a module
    whose call falls back to flax's code would otherwise never look at it."""

    def __post_init__(self):
        # this module's own class name, not a lifted transform's (CheckpointLayerNorm) or a subclass's
        name = next(c.__name__ for c in type(self).__mro__ if c.__module__ == __name__ and c is not _Impl)
        jaxbwd.config.check_implementation(self.implementation, f"nn.{name}")
        super().__post_init__()


class RMSNorm(_Impl, fnn.RMSNorm):
    """``flax.linen.RMSNorm`` (all its arguments); param ``scale`` [D].

    Kernel path (:func:`jaxbwd.rms_norm`): ``reduction_axes`` and ``feature_axes`` both the
    last axis, of size > 0, no ``axis_name``, no ``mask``, ``force_float32_reductions=True``,
    ``epsilon > 0``; ``use_scale=False`` runs with a unit weight. ``use_fast_variance`` has
    no effect on RMSNorm (no mean is subtracted). Any other configuration runs flax's code.
    dtype: the kernel runs in the wider of (x, scale) and ``dtype`` and returns ``dtype``
    (default: the promoted type of x and scale), as flax.

    Extra: ``weight_offset=1.0`` gives Gemma's ``(1 + scale)`` (initialise ``scale`` to zeros);
    kernel path only (ValueError otherwise), and with ``use_scale=True`` (a nonzero offset with
    ``use_scale=False`` is a ValueError when the module is built). Call: x [..., D] -> same shape.
    Source: Zhang & Sennrich (2019).
    """

    weight_offset: float = 0.0
    implementation: Optional[str] = None

    def __post_init__(self):
        K.check_weight_offset("nn.RMSNorm", self.use_scale, self.weight_offset)
        super().__post_init__()

    @fnn.compact
    def __call__(self, x, *, mask: Optional[jax.Array] = None):
        if not K.last_axis_stats(self, x, mask, self.param_dtype, self.dtype):
            if self.weight_offset:
                K.refuse_weight_offset("nn.RMSNorm", self, x, mask)
            return super().__call__(x, mask=mask)
        scale = self.param("scale", self.scale_init, (x.shape[-1],), self.param_dtype) if self.use_scale else None
        out = canonicalize_dtype(x, scale, dtype=self.dtype)
        return K.rms_norm(x, scale, eps=self.epsilon, weight_offset=self.weight_offset, out_dtype=out,
                          impl=self.implementation)


class LayerNorm(_Impl, fnn.LayerNorm):
    """``flax.linen.LayerNorm`` (all its arguments); params ``scale`` and ``bias`` [D].

    Kernel path (:func:`jaxbwd.layer_norm`): ``reduction_axes`` and ``feature_axes`` the last
    axis, of size > 0, no ``axis_name``, no ``mask``, ``force_float32_reductions=True``, ``epsilon > 0``;
    ``use_scale``/``use_bias=False`` run with a unit weight / zero bias. ``use_fast_variance``:
    both settings take the kernel, which always computes the variance in two passes over a
    float32 row (flax's slow, accurate form; the fast form is a cheaper formula for the same
    quantity, which loses accuracy where the mean is large against the spread: there the
    results match ``use_fast_variance=False``, not flax's default). dtype as :class:`RMSNorm`.
    Any other configuration runs flax's code.
    Call: x [..., D] -> same shape. Source: Ba et al. (2016).

    Errors: ValueError for an unknown ``implementation`` (when the module is built); on the
    kernel path those of :func:`jaxbwd.layer_norm` (TypeError for float64 with
    ``implementation="pallas"``); flax's own on flax's path.
    """

    implementation: Optional[str] = None

    @fnn.compact
    def __call__(self, x, *, mask: Optional[jax.Array] = None):
        if not K.last_axis_stats(self, x, mask, self.param_dtype, self.dtype):
            return super().__call__(x, mask=mask)
        d = x.shape[-1]
        scale = self.param("scale", self.scale_init, (d,), self.param_dtype) if self.use_scale else None
        bias = self.param("bias", self.bias_init, (d,), self.param_dtype) if self.use_bias else None
        out = canonicalize_dtype(x, scale, bias, dtype=self.dtype)
        return K.layer_norm(x, scale, bias, eps=self.epsilon, out_dtype=out, impl=self.implementation)


class Embed(_Impl, fnn.Embed):
    """``flax.linen.Embed`` (all its arguments); param ``embedding`` [num_embeddings, features].

    Kernel path (:func:`jaxbwd.embed`, Pallas scatter-add backward): a floating table
    (after ``promote_dtype(..., dtype=dtype, inexact=False)``, as flax) and
    ``num_embeddings > 1``; ids in [-V, 0) wrap and ids outside [-V, V) give NaN rows, as
    ``jnp.take`` in flax (ids narrower than int32 are read as int32: a negative int8 id
    wraps to V + id, where ``jnp.take`` wraps V + id again in int8). ``attend(query)``
    runs :func:`jaxbwd.matmul` on flax's promoted operands: bf16 queries with an f32 table
    give f32 logits, as flax.
    Call: ids int [...] -> [..., features]. Source: a lookup table.

    Errors: ValueError for an unknown ``implementation`` (when the module is built); on the
    kernel path those of :func:`jaxbwd.embed` (TypeError for float64 with
    ``implementation="pallas"``); flax's ValueError for ids that are not integers; flax's own
    on flax's path.
    """

    implementation: Optional[str] = None

    def __call__(self, inputs):
        if not jnp.issubdtype(inputs.dtype, jnp.integer) or self.num_embeddings == 1:
            return super().__call__(inputs)
        (embedding,) = self.promote_dtype(self.embedding, dtype=self.dtype, inexact=False)
        if not K.op_float(embedding.dtype):
            return super().__call__(inputs)
        return K.embed_lookup(inputs, embedding, self.implementation)

    def attend(self, query):
        query, embedding = self.promote_dtype(query, self.embedding, dtype=self.dtype)
        if jnp.ndim(query) == 0 or not K.op_float(embedding.dtype):
            return super().attend(query)
        return K.attend(query, embedding, self.implementation)

    def attend_cross_entropy(self, query, labels, **kwargs):
        """The loss of the tied output projection, ``cross_entropy(attend(query), labels)``,
        by :func:`jaxbwd.linear_cross_entropy` (the table read as [V, D]; the [..., V] logits
        are never stored). ``kwargs``: its options (``ignore_index``, ``label_smoothing``,
        ``z_loss``, ``logit_softcap``, ``weights``, ``reduction``, ``return_aux``).
        query [..., features], labels int [...]; operands promoted as :meth:`attend`."""
        query, embedding = self.promote_dtype(query, self.embedding, dtype=self.dtype)
        return K.attend_cross_entropy(query, embedding, labels, self.implementation, kwargs)


class Dense(_Impl, fnn.Dense):
    """``flax.linen.Dense`` (all its arguments); params ``kernel`` [in, features], ``bias``.

    Kernel path (:func:`jaxbwd.matmul` + :func:`jaxbwd.bias_add`): ``precision=None``, no
    ``dot_general``/``dot_general_cls``; operands promoted by the module's ``promote_dtype``
    (``dtype``/``param_dtype`` as flax). Otherwise flax's code.
    Call: x [..., in] -> [..., features]. Source: as ``flax.linen.Dense``.

    Errors: ValueError for an unknown ``implementation`` (when the module is built); on the
    kernel path those of :func:`jaxbwd.matmul` and :func:`jaxbwd.bias_add` (TypeError for
    float64 with a bias and ``implementation="pallas"``); flax's own on flax's path.
    """

    implementation: Optional[str] = None

    @fnn.compact
    def __call__(self, inputs):
        kshape = (jnp.shape(inputs)[-1:] or (0,)) + (self.features,)
        if (self.precision is not None or self.dot_general is not None or self.dot_general_cls is not None
                or jnp.ndim(inputs) == 0 or not K.takes_dtypes(inputs, self.param_dtype, self.dtype)
                or not K.promotes_to_op_dtypes(lambda *a: self.promote_dtype(*a, dtype=self.dtype), inputs,
                                               *_param_specs(self.param_dtype, kshape, (self.features,), self.use_bias))):
            return super().__call__(inputs)
        kernel = self.param("kernel", self.kernel_init, kshape, self.param_dtype)
        bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype) if self.use_bias else None
        inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        return K.dense(inputs, kernel, bias, self.implementation)


def dot_product_attention(query, key, value, bias=None, mask=None, broadcast_dropout=True, dropout_rng=None,
                          dropout_rate=0.0, deterministic=False, dtype=None, precision=None, module=None,
                          force_fp32_for_softmax=False, einsum_dot_general=None, qk_attn_weights_einsum=None,
                          attn_weights_value_einsum=None):
    """``flax.linen.dot_product_attention`` (same signature) on :func:`jaxbwd.dot_product_attention`.

    query [batch, q_len, heads, depth] (or unbatched [q_len, heads, depth]), key/value
    [batch, kv_len, heads, depth]; promoted to ``dtype`` as flax. Runs jaxbwd's op when no
    dropout is active (``dropout_rate == 0`` or ``deterministic``), ``precision``,
    ``einsum_dot_general`` and the einsum overrides are None, ``module`` is None (no
    sown weights) and there is at most one batch dim: with no ``bias``/``mask`` on the flash
    kernels, with a dense ``bias``/``mask`` (flax's usual causal/padding masks) on the
    op's dense XLA path. Masked logits and fully masked rows follow flax (a uniform softmax
    over the row). The softmax is always float32; with ``force_fp32_for_softmax=True`` and
    non-float32 inputs the result is promoted with float32, as flax's (whose float32 weights
    promote the product with v). q, k and v must share heads and depth (flax also takes
    another value depth: its code runs then). Anything else (an empty key sequence too)
    runs flax's own function.
    Source: Vaswani et al. (2017).

    Errors: flax's own shape checks first (AssertionError for head counts that differ, as
    flax), then on jaxbwd's path those of :func:`jaxbwd.dot_product_attention`.
    """
    query, key, value = fnn.dtypes.promote_dtype(query, key, value, dtype=dtype)
    covered = ((dropout_rate == 0.0 or deterministic) and precision is None and einsum_dot_general is None
               and qk_attn_weights_einsum is None and attn_weights_value_einsum is None and module is None
               and query.ndim in (3, 4) and key.ndim == query.ndim and value.ndim == query.ndim
               # flax's shapes: equal heads (flax asserts it), one depth for q, k and v (flax
               # also takes another value depth), keys and values of one length.
               and query.shape[:-3] == key.shape[:-3] == value.shape[:-3]
               and query.shape[-2] == key.shape[-2] == value.shape[-2] and key.shape[-3] == value.shape[-3]
               and query.shape[-1] == key.shape[-1] == value.shape[-1] and K.takes_dtypes(query)
               and key.shape[-3] > 0)  # no keys: flax's zeros (the op asks for S >= 1)
    if not covered:
        return fnn.dot_product_attention(
            query, key, value, bias, mask, broadcast_dropout, dropout_rng, dropout_rate, deterministic, dtype,
            precision, module, force_fp32_for_softmax, einsum_dot_general, qk_attn_weights_einsum,
            attn_weights_value_einsum)
    bias = K.float_bias(bias, query.dtype)
    # flax's masks are often float (make_attention_mask): nonzero takes part, as its jnp.where.
    out = jaxbwd.dot_product_attention(query, key, value, bias, None if mask is None else mask != 0,
                                       implementation=K.attention_impl())
    if force_fp32_for_softmax and query.dtype != jnp.float32:
        # flax multiplies its float32 weights into v: the result is promoted with float32.
        out = out.astype(jnp.promote_types(jnp.float32, value.dtype))
    return out


class MultiHeadDotProductAttention(_Impl, fnn.MultiHeadDotProductAttention):
    """``flax.linen.MultiHeadDotProductAttention`` (all its arguments and parameters) whose
    default ``attention_fn`` is :func:`dot_product_attention` above (jaxbwd's op where it
    covers the call, flax's function otherwise); projections are flax's ``DenseGeneral``.
    ``implementation`` applies to the attention op (and, via :func:`jaxbwd.config.use`, to
    jaxbwd's ops in a user's ``attention_fn``). Source: Vaswani et al. (2017).

    Call: inputs_q [batch..., q_len, in_features] (inputs_k/inputs_v [batch..., kv_len,
    in_features]) -> [batch..., q_len, out_features or in_features], as flax; dtypes as flax
    (jaxbwd's op takes float32, bfloat16 or float16, and float64 on the XLA path). Errors:
    ValueError for an unknown ``implementation`` (when the module is built); on the kernel
    path those of :func:`jaxbwd.dot_product_attention` (TypeError for float64 with
    ``implementation="pallas"``); flax's own on flax's path.
    """

    attention_fn: Callable[..., Any] = dot_product_attention
    implementation: Optional[str] = None

    @fnn.compact
    def __call__(self, *args, **kwargs):
        with K.attention_implementation(self.implementation):
            return super().__call__(*args, **kwargs)


class SwiGLUMLP(_Impl, fnn.Module):
    """Gated MLP ``down(silu(gate(x)) * up(x))`` (Shazeer 2020); submodules ``gate``, ``up``, ``down``.

    Call: x [..., D] -> [..., D]. ``limit`` clamps as gpt-oss. Errors: TypeError/ValueError
    naming the module for a ``hidden`` that is not an int >= 1 or an unknown
    ``implementation`` (when the module is built); then those of the ops.

    dtypes: float32, bfloat16 or float16 (float64 on the XLA path); the parameters are
    float32 and the result is x promoted with them, as in flax's Dense: float32 for 16-bit
    and float32 x, float64 for float64 x (an integer x is promoted too: float32).

    Source: Shazeer, "GLU Variants Improve Transformer" (2020), the SwiGLU variant.
    """

    hidden: int
    limit: Optional[float] = None
    use_bias: bool = False
    implementation: Optional[str] = None

    @fnn.compact
    def __call__(self, x):
        K.check_sizes("nn.SwiGLUMLP", hidden=self.hidden)
        dense = lambda n, name: Dense(n, use_bias=self.use_bias, implementation=self.implementation, name=name)
        h = jaxbwd.swiglu(dense(self.hidden, "gate")(x), dense(self.hidden, "up")(x),
                          limit=self.limit, implementation=self.implementation)
        return dense(x.shape[-1], "down")(h)


class Attention(_Impl, fnn.Module):
    """Causal GQA self-attention with RoPE; submodules ``query``, ``key``, ``value``, ``out`` (Dense).

    Call: x [B, T, D] (optional ``segment_ids`` int [B, T], ``positions`` int [B, T] or [T])
    -> [B, T, D]. ``num_heads % num_kv_heads == 0``. Errors: TypeError/ValueError naming
    the module for a size that is not an int >= 1 (``d_model / n_heads`` is a float),
    num_heads not a multiple of num_kv_heads, an odd head_dim or rope_theta <= 0, and
    ValueError for an unknown ``implementation`` (when the module is built); then those of
    :func:`jaxbwd.dot_product_attention` and :func:`jaxbwd.rope`.
    Source: Vaswani et al. (2017); GQA, Ainslie et al. (2023); RoPE, Su et al. (2021).

    dtypes: x float32, bfloat16 or float16 (float64 on the XLA path); the parameters are
    float32 and the result is x promoted with them, as in flax's Dense: float32 for 16-bit
    and float32 x, float64 for float64 x (an integer x is promoted too: float32).
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    is_causal: bool = True
    implementation: Optional[str] = None

    @fnn.compact
    def __call__(self, x, *, segment_ids=None, positions=None):
        K.check_attention_config("nn.Attention", self.num_heads, self.num_kv_heads, self.head_dim, self.rope_theta)
        K.check_attention_call("nn.Attention", x)
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


class GroupNorm(_Impl, fnn.GroupNorm):
    """``flax.linen.GroupNorm`` (all its arguments), channels last; params ``scale``, ``bias`` [C].

    Kernel path (:func:`jaxbwd.group_norm`): x of rank >= 2, ``reduction_axes`` None (flax's
    default: every axis but the first) or equal to it, a valid ``num_groups`` or
    ``group_size``, no ``axis_name``, no ``mask``, ``force_float32_reductions=True``,
    ``epsilon > 0``; ``use_fast_variance`` as :class:`LayerNorm`. Otherwise flax's code.
    Extra: ``activation="silu"`` fuses the SiLU that UNet blocks apply next (applied after
    flax's result on the other path). Call: x [N, ..., C] -> same shape. Source: Wu & He (2018).

    Errors: ValueError for an unknown ``implementation`` (when the module is built); on the
    kernel path those of :func:`jaxbwd.group_norm` (TypeError for float64 with
    ``implementation="pallas"``); ValueError for an ``activation`` other than None or
    "silu"; flax's own on flax's path.
    """

    activation: Optional[str] = None
    implementation: Optional[str] = None

    def _groups(self, c: int):
        if (self.num_groups is None) == (self.group_size is None):
            return None
        if self.group_size is not None:
            return c // self.group_size if self.group_size > 0 and c % self.group_size == 0 else None
        return self.num_groups

    @fnn.compact
    def __call__(self, x, *, mask: Optional[jax.Array] = None):
        K.check_activation("nn.GroupNorm", self.activation)
        g = self._groups(x.shape[-1]) if x.ndim else None
        if not (K.plain_stats(self, mask) and K.group_norm_covered(x, self.reduction_axes, g)
                and K.takes_dtypes(x, self.param_dtype, self.dtype)):
            y = super().__call__(x, mask=mask)
            return y if self.activation is None else jaxbwd.silu(y, implementation=self.implementation)
        c = x.shape[-1]
        scale = self.param("scale", self.scale_init, (c,), self.param_dtype) if self.use_scale else None
        bias = self.param("bias", self.bias_init, (c,), self.param_dtype) if self.use_bias else None
        out = canonicalize_dtype(x, scale, bias, dtype=self.dtype)
        return K.group_norm(x, scale, bias, num_groups=g, eps=self.epsilon, activation=self.activation,
                            out_dtype=out, impl=self.implementation)


class BatchNorm(_Impl, fnn.BatchNorm):
    """``flax.linen.BatchNorm`` (all its arguments); params ``scale``, ``bias`` and
    ``batch_stats`` ``mean``, ``var`` [C] (float32; an update promotes them as flax's does,
    to float64 for float64 inputs), updated as flax (not while initialising).

    Kernel path (:func:`jaxbwd.batch_norm`): a non-empty x, an int ``axis``, no ``mask``, no
    ``axis_index_groups``, ``force_float32_reductions=True``, ``epsilon > 0``;
    ``axis_name`` is supported (cross-device statistics); ``use_scale``/``use_bias=False``
    run with a unit weight / zero bias; ``use_fast_variance`` as :class:`LayerNorm` (two-pass
    float32 variance either way). With ``use_running_average`` the normalisation is
    jaxbwd's eval form (an affine map). Otherwise flax's code. dtype as :class:`LayerNorm`.
    Call: x [N, ..., C] (channels on ``axis``) -> same shape. Source: Ioffe & Szegedy (2015).

    Errors: ValueError for an unknown ``implementation`` (when the module is built); on the
    kernel path those of :func:`jaxbwd.batch_norm` (TypeError for float64 with
    ``implementation="pallas"``); flax's own on flax's path.
    """

    implementation: Optional[str] = None

    @fnn.compact
    def __call__(self, x, use_running_average: Optional[bool] = None, *, mask: Optional[jax.Array] = None):
        if not (isinstance(self.axis, int) and mask is None and self.axis_index_groups is None
                and getattr(self, "force_float32_reductions", True) and K.static_real(self.epsilon)
                and self.epsilon > 0 and jnp.ndim(x) >= 2 and jnp.size(x) > 0 and K.static_real(self.momentum)
                and 0 <= self.momentum <= 1 and K.takes_dtypes(x, self.param_dtype, self.dtype)):
            return super().__call__(x, use_running_average, mask=mask)
        use_ra = fnn.module.merge_param("use_running_average", self.use_running_average, use_running_average)
        c = x.shape[self.axis]
        ra_mean = self.variable("batch_stats", "mean", lambda s: jnp.zeros(s, jnp.float32), (c,))
        ra_var = self.variable("batch_stats", "var", lambda s: jnp.ones(s, jnp.float32), (c,))
        scale = self.param("scale", self.scale_init, (c,), self.param_dtype) if self.use_scale else None
        bias = self.param("bias", self.bias_init, (c,), self.param_dtype) if self.use_bias else None
        out = canonicalize_dtype(x, scale, bias, dtype=self.dtype)
        ct = K.compute_dtype(out, x, scale, bias)
        w = jnp.ones((c,), ct) if scale is None else scale.astype(ct)
        b = jnp.zeros((c,), ct) if bias is None else bias.astype(ct)
        # As flax: no cross-device reduction while initialising (the axis need not exist yet).
        kw = dict(eps=self.epsilon, momentum=self.momentum, axis=self.axis, implementation=self.implementation,
                  axis_name=None if self.is_initializing() else self.axis_name)
        if use_ra:
            y = jaxbwd.batch_norm(x.astype(ct), w, b, running_mean=ra_mean.value, running_var=ra_var.value,
                                  training=False, **kw)
        else:
            # As flax: the update promotes the stored float32 statistics with the batch's
            # (at least float32, in dtype or x's dtype): float64 inputs leave float64 ones.
            sd = jnp.promote_types(ra_mean.value.dtype, jnp.promote_types(self.dtype or x.dtype, jnp.float32))
            y, new = jaxbwd.batch_norm(x.astype(ct), w, b, running_mean=ra_mean.value.astype(sd),
                                       running_var=ra_var.value.astype(sd), training=True, **kw)
            if not self.is_initializing():
                ra_mean.value, ra_var.value = new["mean"], new["var"]
        return y.astype(out)


class Dropout(_Impl, fnn.Dropout):
    """``flax.linen.Dropout`` (all its arguments); kernel path :func:`jaxbwd.dropout`, whose
    backward regenerates the mask from the key instead of saving it.

    Kernel path: floating inputs, a static ``rate`` in (0, 1), no ``broadcast_dims``, a
    threefry key (flax's default); otherwise flax's code (``deterministic``, rate 0 and 1
    behave as flax's either way). The key is flax's (``rng``, else ``make_rng`` of
    ``rng_collection``), but the mask drawn from it is jaxbwd's counter hash, not
    ``jax.random.bernoulli``: the same keep probability and scaling, other elements than
    flax's for the same key. Call: x [...] -> same shape and dtype.
    Source: Srivastava et al. (JMLR 2014).

    Errors: ValueError for an unknown ``implementation`` (when the module is built); on the
    kernel path those of :func:`jaxbwd.dropout` (TypeError for float64 with
    ``implementation="pallas"``); flax's own on flax's path.
    """

    implementation: Optional[str] = None

    @fnn.compact
    def __call__(self, inputs, deterministic: Optional[bool] = None, rng: Optional[jax.Array] = None):
        # flax's own call is given the call-time argument unmerged: it merges it with the
        # field itself (and rejects a value given in both places).
        merged = fnn.module.merge_param("deterministic", self.deterministic, deterministic)
        if merged or not K.dropout_covered(inputs, self.rate, self.broadcast_dims):
            return super().__call__(inputs, deterministic, rng)
        if rng is None:
            rng = self.make_rng(self.rng_collection)
        if not K.threefry_key(rng):
            return super().__call__(inputs, deterministic, rng)
        return jaxbwd.dropout(inputs, self.rate, rng=rng, implementation=self.implementation)


class Conv(_Impl, fnn.Conv):
    """``flax.linen.Conv`` (all its arguments), channels last; params ``kernel``
    [*kernel_size, Cin/feature_group_count, features] and ``bias`` [features].

    Kernel path (:func:`jaxbwd.conv2d`, Pallas dgrad/wgrad): 1-D or 2-D ``kernel_size``
    (1-D runs as 2-D over a height of 1), ``input_dilation`` 1, any ``strides``,
    ``kernel_dilation``, ``feature_group_count``, ``mask`` (multiplied into the kernel, as
    flax), padding an int, ints, pairs, ``"SAME"``, ``"VALID"``, ``"CIRCULAR"``,
    ``"REFLECT"`` or (1-D) ``"CAUSAL"`` (the last three pad the input and convolve VALID,
    as flax), negative explicit padding (a crop of the input, sliced before the kernel, as
    long as one element is left), unbatched or any number of batch dims, ``precision=None``
    and no ``conv_general_dilated``/``_cls``. Otherwise (3-D kernels, input dilation, other
    padding strings, a precision) flax's code. Source: as ``flax.linen.Conv``.

    dtypes: x and kernel float32, bfloat16 or float16 (float64 on the XLA path); the
    result's dtype is flax's. Errors: ValueError for an unknown ``implementation`` (when the
    module is built); on the kernel path those of :func:`jaxbwd.conv2d` (TypeError for
    float64 with ``implementation="pallas"``); flax's own on flax's path.
    """

    implementation: Optional[str] = None

    @fnn.compact
    def __call__(self, inputs):
        ks = (self.kernel_size,) if isinstance(self.kernel_size, int) else tuple(self.kernel_size)
        cin, fgc = jnp.shape(inputs)[-1], self.feature_group_count
        kernel_shape = ks + (cin // fgc, self.features)
        spatial = jnp.shape(inputs)[-len(ks) - 1:-1]
        if not (K.conv_covered(ks, self.padding, self.input_dilation, spatial, self.kernel_dilation)
                and self.precision is None and self.conv_general_dilated is None
                and self.conv_general_dilated_cls is None
                and jnp.ndim(inputs) >= len(ks) + 1 and cin % fgc == 0 and min(kernel_shape) > 0
                and K.takes_dtypes(inputs, self.param_dtype, self.dtype)
                and (self.mask is None or self.mask.shape == kernel_shape)
                and K.promotes_to_op_dtypes(lambda *a: self.promote_dtype(*a, dtype=self.dtype), inputs,
                                            *_param_specs(self.param_dtype, kernel_shape, (self.features,),
                                                          self.use_bias))):
            return super().__call__(inputs)
        kernel = self.param("kernel", self.kernel_init, kernel_shape, self.param_dtype)
        if self.mask is not None:
            kernel *= self.mask
        bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype) if self.use_bias else None
        inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        return K.conv(inputs, kernel, bias, kernel_size=ks, strides=self.strides, padding=self.padding,
                      kernel_dilation=self.kernel_dilation, feature_group_count=fgc, impl=self.implementation)


class PixelShuffle(_Impl, fnn.Module):
    """Depth to space: [N, H, W, C*r*r] -> [N, H*r, W*r, C] (no parameters).

    Errors: ValueError for an unknown ``implementation`` (when the module is built); at the
    call those of :func:`jaxbwd.pixel_shuffle`. Source: Shi et al. (2016).

    dtypes: float32, bfloat16 or float16 (float64 on the XLA path), kept.
    """

    upscale_factor: int
    implementation: Optional[str] = None

    def __call__(self, x):
        return jaxbwd.pixel_shuffle(x, self.upscale_factor, implementation=self.implementation)


class Upsample(_Impl, fnn.Module):
    """Nearest or bilinear upsampling of NHWC images by integer factors (no parameters).

    Errors: ValueError for an unknown ``implementation`` (when the module is built); at the
    call those of :func:`jaxbwd.upsample2d`. Source: as ``jax.image.resize``.

    Call: x [N, H, W, C] float32, bfloat16 or float16 (float64 on the XLA path) -> [N, H*sh,
    W*sw, C] for ``scale`` (sh, sw) (an int s: sh = sw = s), same dtype.
    """

    scale: Any = 2
    method: str = "nearest"
    implementation: Optional[str] = None

    def __call__(self, x):
        return jaxbwd.upsample2d(x, self.scale, method=self.method, implementation=self.implementation)
