"""Plain-jnp forwards of every op: the ground truth that tests differentiate with autodiff.

Each function has the op's signature without ``implementation`` and is written for
clarity, not speed. Statistics are taken in float32 and results cast back to the input
dtype, as the ops do.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

# indices compared in at least int32 (a uint8 label cannot be compared with V = 300)
from jaxbwd.vjp._base import widen_index


def _f32(x):
    return x.astype(jnp.float32) if x.dtype != jnp.float64 else x


def rms_norm(x, weight, *, eps=1e-6, weight_offset=0.0):
    """Reference RMSNorm (Zhang & Sennrich 2019)."""
    xf = _f32(x)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * (_f32(weight) + weight_offset)).astype(x.dtype)


def layer_norm(x, weight, bias, *, eps=1e-5):
    """Reference LayerNorm (Ba et al. 2016): x [..., D], weight and bias [D] -> x's shape and dtype."""
    xf = _f32(x)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    return ((xf - mean) * jax.lax.rsqrt(var + eps) * _f32(weight) + _f32(bias)).astype(x.dtype)


def softmax(x, *, axis=-1, where=None):
    """Reference softmax over ``axis`` (int, tuple or None) as jax.nn.softmax; entries outside
    ``where`` and slices that are entirely -inf give zeros (not NaN), a slice with a +inf or
    NaN entry is all NaN."""
    xf = _f32(x) if where is None else jnp.where(where, _f32(x), -jnp.inf)
    m = jnp.max(xf, axis=axis, keepdims=True)
    m = jnp.where(m == -jnp.inf, 0.0, m)
    e = jnp.exp(xf - jax.lax.stop_gradient(m))
    s = jnp.sum(e, axis=axis, keepdims=True)
    return (e / jnp.where(s == 0, 1.0, s)).astype(x.dtype)


def silu(x):
    """Reference SiLU / swish, ``x * sigmoid(x)``: any shape, x's dtype (Elfwing et al. 2017)."""
    return (_f32(x) * jax.nn.sigmoid(_f32(x))).astype(x.dtype)


def gelu(x, *, approximate=True):
    """Reference GELU (Hendrycks & Gimpel 2016), tanh form when ``approximate``."""
    return jax.nn.gelu(_f32(x), approximate=approximate).astype(x.dtype)


def relu(x):
    """Reference ReLU, ``jax.nn.relu`` (Nair & Hinton 2010)."""
    return jax.nn.relu(x)


def leaky_relu(x, negative_slope=0.01):
    """Reference leaky ReLU, ``jax.nn.leaky_relu`` in float32 (Maas et al. 2013)."""
    return jax.nn.leaky_relu(_f32(x), negative_slope).astype(x.dtype)


def sigmoid(x):
    """Reference logistic sigmoid, ``jax.nn.sigmoid`` in float32."""
    return jax.nn.sigmoid(_f32(x)).astype(x.dtype)


def tanh(x):
    """Reference tanh, ``jnp.tanh`` in float32."""
    return jnp.tanh(_f32(x)).astype(x.dtype)


def _clamp(gate, up, limit):
    """``min(gate, limit)``, ``clip(up, -limit, limit)``; a value equal to the limit keeps
    its derivative, as under torch.clamp (gpt-oss's reference): autodiff of
    jnp.minimum/clip would halve it there."""
    if limit is None:
        return gate, up
    # written as "replace where beyond" so that NaN passes through, as through min/clip
    g = jnp.where(gate > limit, limit, gate)
    return g, jnp.where(jnp.abs(up) > limit, jnp.sign(up) * limit, up)


def swiglu(gate, up, *, limit=None):
    """Reference SwiGLU (Shazeer 2020): silu(gate) * up, clamped as gpt-oss when ``limit``."""
    g, u = _clamp(_f32(gate), _f32(up), limit)
    return (g * jax.nn.sigmoid(g) * u).astype(gate.dtype)


def glu(x, axis=-1):
    """Reference ``jax.nn.glu``: x1 * sigmoid(x2) for the halves of ``axis`` (Dauphin et al. 2017)."""
    x1, x2 = jnp.split(_f32(x), 2, axis=axis)
    return (x1 * jax.nn.sigmoid(x2)).astype(x.dtype)


def gated_linear_unit(x, *, activation="silu", limit=None):
    """Reference gated linear unit over the halves of the last axis: act(x[..., :d]) * x[..., d:]."""
    d = x.shape[-1] // 2
    g, u = _clamp(_f32(x[..., :d]), _f32(x[..., d:]), limit)
    act = {
        "silu": lambda v: v * jax.nn.sigmoid(v),
        "gelu": lambda v: jax.nn.gelu(v, approximate=True),
        "gelu_exact": lambda v: jax.nn.gelu(v, approximate=False),
    }[activation]
    return (act(g) * u).astype(x.dtype)


def bias_add(x, bias):
    """Reference bias addition over the last axis."""
    return (x + bias.astype(x.dtype)).astype(x.dtype)


def matmul(x, w):
    """Reference matrix product [..., K] @ [K, M]."""
    return jnp.matmul(x, w, preferred_element_type=jnp.promote_types(jnp.result_type(x, w), jnp.float32)).astype(jnp.result_type(x, w))


def scale(x, factor):
    """Reference scaling ``x * factor`` by a static Python number: x's shape and dtype,
    computed in float32 (float64 for float64 x) and rounded once."""
    wide = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
    return (x.astype(wide) * factor).astype(x.dtype)


def residual_add(a, b):
    """Reference ``a + b`` with NumPy broadcasting; result in ``result_type(a, b)``."""
    return a + b


def reshape(x, shape):
    """Reference reshape of x to ``shape`` (one -1 allowed); same dtype."""
    return x.reshape(shape)


def row_slice(x, start, size):
    """Reference dynamic row slice (start clamped as lax.dynamic_slice)."""
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=0)


def dot_product_attention(q, k, v, *, scale=None, is_causal=False, segment_ids=None,
                          sliding_window=None, logit_softcap=None):
    """Reference attention: materialises the [B, N, T, S] logits.

    q [B, T, N, H], k/v [B, S, K, H] (N % K == 0). Query i sees key j when j <= i (causal),
    i - w < j (sliding window w; also j < i + w when not causal), and the segment ids agree.
    logit_softcap c: logits -> c * tanh(logits / c) before masking. Rows that see no key
    give 0.
    """
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    scale = H ** -0.5 if scale is None else scale
    qf = _f32(q).reshape(B, T, K, G, H)
    s = jnp.einsum("btkgh,bskh->bkgts", qf, _f32(k)) * scale
    if logit_softcap is not None:
        s = logit_softcap * jnp.tanh(s / logit_softcap)
    i = jnp.arange(T)[:, None]
    j = jnp.arange(S)[None, :]
    mask = jnp.ones((T, S), bool)
    if is_causal:
        mask = mask & (j <= i)
    if sliding_window is not None:
        mask = mask & (j > i - sliding_window)
        if not is_causal:
            mask = mask & (j < i + sliding_window)
    mask = jnp.broadcast_to(mask, (B, T, S))
    if segment_ids is not None:
        qs, ks = segment_ids if isinstance(segment_ids, (tuple, list)) else (segment_ids, segment_ids)
        mask = mask & (qs[:, :, None] == ks[:, None, :])
    mask = mask[:, None, None]
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    p = jnp.where(mask, jnp.exp(s - m), 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(l == 0, 1.0, l)
    o = jnp.einsum("bkgts,bskh->btkgh", p, _f32(v))
    return o.reshape(B, T, N, H).astype(q.dtype)


def cross_entropy(logits, labels, *, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, reduction="mean"):
    """Reference softmax cross-entropy with integer labels (optax's definitions).

    Per row: ``lse - (1 - eps) * x[label] - eps / V * sum(x) + z_loss * lse**2``
    (label smoothing of Szegedy et al. 2016, z-loss of PaLM, Chowdhury et al. 2022).
    Rows with ``label == ignore_index`` or a label outside [0, V) count as ignored;
    "mean" divides by the number of non-ignored rows (0 if there are none).
    """
    xf = _f32(logits)
    V = logits.shape[-1]
    labels = widen_index(labels)
    valid = (labels >= 0) & (labels < V) & (labels != ignore_index)
    safe = jnp.where(valid, labels, 0).astype(jnp.int32)
    lse = jax.nn.logsumexp(xf, axis=-1)
    xl = jnp.take_along_axis(xf, safe[..., None], axis=-1)[..., 0]
    loss = lse - (1.0 - label_smoothing) * xl
    if label_smoothing:
        loss = loss - label_smoothing / V * jnp.sum(xf, axis=-1)
    if z_loss:
        loss = loss + z_loss * lse * lse
    loss = jnp.where(valid, loss, 0.0)
    if reduction == "none":
        return loss.astype(logits.dtype)
    total = jnp.sum(loss)
    if reduction == "mean":
        total = total / jnp.maximum(jnp.sum(valid), 1)
    return total.astype(logits.dtype)


def linear_cross_entropy(x, w, labels, *, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, logit_softcap=None,
                         weights=None, reduction="mean", return_aux=False, transpose_w=False):
    """Reference fused LM head + loss: the f32 logits ``x @ w`` (``x @ w.T`` with
    ``transpose_w``), soft-capped ``c * tanh(z / c)``, then :func:`cross_entropy` per token;
    per-token ``weights`` multiply each loss, "mean" divides by the weights' sum over
    non-ignored tokens (their count without weights; 0 if it is 0)."""
    dtype = jnp.result_type(x, w)
    wf = _f32(w).T if transpose_w else _f32(w)
    z = jnp.matmul(_f32(x), wf, precision=jax.lax.Precision.HIGHEST)
    if logit_softcap is not None:
        z = logit_softcap * jnp.tanh(z / logit_softcap)
    V = z.shape[-1]
    labels = widen_index(labels)
    valid = (labels >= 0) & (labels < V) & (labels != ignore_index)
    loss = cross_entropy(z, labels, ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss,
                         reduction="none")
    lse = jax.nn.logsumexp(z, axis=-1)
    wts = jnp.ones_like(loss) if weights is None else _f32(weights)
    loss = loss * wts
    if reduction == "none":
        out = loss
    else:
        out = jnp.sum(loss)
        if reduction == "mean":
            den = jnp.sum(jnp.where(valid, wts, 0.0))
            out = jnp.where(den == 0, 0.0, out / jnp.where(den == 0, 1.0, den))
    out = out.astype(dtype)
    if return_aux:
        return out, {"lse": lse, "z_loss": jnp.where(valid, z_loss * lse * lse, 0.0)}
    return out


def embed(ids, table, *, padding_idx=None):
    """Reference embedding lookup ``table[ids]``; out-of-range ids give zero rows, and the
    ``padding_idx`` row gets no gradient (its forward value is the table's row)."""
    V = table.shape[0]
    ids = widen_index(ids)
    valid = (ids >= 0) & (ids < V)
    rows = jnp.take(table, jnp.where(valid, ids, 0), axis=0)
    if padding_idx is not None:
        pad = ids == (padding_idx % V)
        rows = jnp.where(pad[..., None], jax.lax.stop_gradient(rows), rows)
    return jnp.where(valid[..., None], rows, jnp.zeros((), table.dtype))


def rope_inv_freq(head_dim, theta, dtype=jnp.float32):
    """``theta ** (-2i / H)`` for i in [0, H/2), computed as ``exp(-(2i / H) * log(theta))``."""
    import math

    i = jnp.arange(head_dim // 2, dtype=dtype)
    return jnp.exp(i * (-2.0 * math.log(theta) / head_dim))


def llama3_inv_freq(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings):
    """Llama 3.1's rescaled rotary frequencies, in its three cases (Meta, Llama 3.1, 2024)."""
    import math

    wavelen = 2 * math.pi / inv_freq
    low_wavelen = original_max_position_embeddings / low_freq_factor
    high_wavelen = original_max_position_embeddings / high_freq_factor
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    medium = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return jnp.where(wavelen > low_wavelen, inv_freq / factor, jnp.where(wavelen < high_wavelen, inv_freq, medium))


def rope(x, *, positions=None, start_pos=0, theta=10000.0, interleaved=False, scale_factor=1.0,
         frequency_scaling=None):
    """Reference rotary position embedding (RoFormer, Su et al. 2021) of x [B, T, N, H].

    Half-split (Llama/NeoX) rotates x[..., :H/2] with x[..., H/2:]; interleaved (GPT-J)
    rotates pairs (2i, 2i+1). Angle of pair i at position p: ``(p / scale_factor) * f_i`` with
    ``f_i = theta**(-2i/H)``, rescaled by :func:`llama3_inv_freq` when ``frequency_scaling``
    (a dict of its arguments) is given; in f32 (f64 for float64 x).
    """
    Bsz, T, N, H = x.shape
    if positions is None:
        positions = start_pos + jnp.arange(T)
    xf = _f32(x)
    pos = jnp.broadcast_to(jnp.asarray(positions), (Bsz, T)).astype(xf.dtype) / scale_factor
    inv_freq = rope_inv_freq(H, theta, xf.dtype)
    if frequency_scaling is not None:
        inv_freq = llama3_inv_freq(inv_freq, **{k: v for k, v in frequency_scaling.items() if k != "rope_type"})
    ang = pos[:, :, None, None].astype(xf.dtype) * inv_freq
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    if interleaved:
        a, b = xf[..., 0::2], xf[..., 1::2]
        y = jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(x.shape)
    else:
        a, b = xf[..., : H // 2], xf[..., H // 2:]
        y = jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    return y.astype(x.dtype)


def group_norm(x, weight, bias, *, num_groups, eps=1e-5, activation=None):
    """Reference GroupNorm (Wu & He 2018) over channels-last x [N, ..., C], optional SiLU."""
    N, Cc = x.shape[0], x.shape[-1]
    xg = _f32(x).reshape(N, -1, num_groups, Cc // num_groups)
    mean = jnp.mean(xg, axis=(1, 3), keepdims=True)
    var = jnp.mean(jnp.square(xg - mean), axis=(1, 3), keepdims=True)
    y = ((xg - mean) * jax.lax.rsqrt(var + eps)).reshape(x.shape) * _f32(weight) + _f32(bias)
    if activation == "silu":
        y = y * jax.nn.sigmoid(y)
    return y.astype(x.dtype)


def upsample2d(x, scale, *, method="nearest"):
    """Reference 2-D upsampling of x [N, H, W, C] by integer factors: ``jax.image.resize``
    ("nearest" repeats pixels; "bilinear" uses half-pixel centres)."""
    sh, sw = (scale, scale) if isinstance(scale, int) else tuple(scale)
    N, H, W, Cc = x.shape
    if method == "nearest":
        return jnp.repeat(jnp.repeat(x, sh, axis=1), sw, axis=2)
    y = jax.image.resize(_f32(x), (N, H * sh, W * sw, Cc), method="bilinear")
    return y.astype(x.dtype)


def pixel_shuffle(x, upscale_factor):
    """Reference sub-pixel shuffle (Shi et al. 2016), torch.nn.PixelShuffle in NHWC:
    ``out[n, h*r+i, w*r+j, c] = x[n, h, w, c*r*r + i*r + j]``."""
    r = upscale_factor
    N, H, W, Cr = x.shape
    y = x.reshape(N, H, W, Cr // (r * r), r, r).transpose(0, 1, 4, 2, 5, 3)
    return y.reshape(N, H * r, W * r, Cr // (r * r))


def unpatchify(tokens, *, grid, patch_size, channels):
    """Reference DiT/MAE unpatchify: ``out[n, gi*p+i, gj*p+j, c] = tokens[n, gi*gw+gj, (i*p+j)*C + c]``."""
    gh, gw = (grid, grid) if isinstance(grid, int) else tuple(grid)
    p, Cc = patch_size, channels
    N = tokens.shape[0]
    y = tokens.reshape(N, gh, gw, p, p, Cc).transpose(0, 1, 3, 2, 4, 5)
    return y.reshape(N, gh * p, gw * p, Cc)


def conv2d(x, w, *, stride=1, padding=0, dilation=1, groups=1):
    """Reference 2-D convolution, x NHWC and w HWIO [kh, kw, Cin/groups, Cout], by
    ``lax.conv_general_dilated`` (f32 accumulation)."""
    pair = lambda v: (v, v) if isinstance(v, int) else tuple(v)
    if isinstance(padding, str):
        pad = padding.upper()
    elif isinstance(padding, int):
        pad = ((padding, padding), (padding, padding))
    else:
        pad = tuple((p, p) if isinstance(p, int) else tuple(p) for p in padding)
    y = jax.lax.conv_general_dilated(
        _f32(x), _f32(w), window_strides=pair(stride), padding=pad, rhs_dilation=pair(dilation),
        dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=groups,
        precision=jax.lax.Precision.HIGHEST,
    )
    return y.astype(x.dtype)


def mse_loss(predictions, targets, weights=None, *, reduction="mean"):
    """Reference mean squared error in float32: ``w * (p - t)**2``, mean over elements, sum or none."""
    r = _f32(predictions) - _f32(targets)
    sq = r * r if weights is None else _f32(weights) * r * r
    if reduction == "none":
        return sq.astype(predictions.dtype)
    total = jnp.sum(sq)
    return (total / sq.size if reduction == "mean" else total).astype(predictions.dtype)


def dropout(x, rate, *, rng=None, deterministic=False):
    """Reference dropout: ``x * (1 / (1 - rate))`` where the counter-based hash of (key, row, col)
    of x's [rows, cols] view keeps, else 0 (the mask's definition: ``jaxbwd/pallas/dropout.py``).
    The scale is the float32 reciprocal, multiplied in float32, as the kernels do (a division
    can differ from it by one rounding)."""
    from jaxbwd.pallas import _common as C

    if deterministic or rate == 0.0:
        return x
    if rate == 1.0:
        return jnp.zeros_like(x)
    keep = _dropout_keep(rng, x.shape, C.as_2d("dropout", x.shape), rate)
    return jnp.where(keep, _f32(x) * (1.0 / (1.0 - rate)), 0.0).astype(x.dtype)


def _dropout_keep(rng, shape, view, rate):
    """The keep mask of an array of ``shape`` on its [rows, cols] ``view``: the counter hash
    of (key, row, col) defined in ``jaxbwd/pallas/dropout.py``."""
    from jaxbwd.pallas import dropout as D

    key = jax.random.key_data(rng) if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key) else rng
    rows = jnp.arange(view[0], dtype=jnp.int32)[:, None]
    cols = jnp.arange(view[1], dtype=jnp.int32)[None, :]
    return D.keep_mask(key[0], key[1], rows, cols, D.keep_threshold(rate)).reshape(shape)


def bias_dropout_add(x, bias, residual, rate, *, rng=None, deterministic=False):
    """Reference ``residual + dropout(x + bias)``, the mask on x's [rows, D] view (the scale as
    :func:`dropout`'s)."""
    h = bias_add(x, bias)
    if deterministic or rate == 0.0:
        return residual + h
    if rate == 1.0:
        return residual
    keep = _dropout_keep(rng, x.shape, (math.prod(x.shape[:-1]), x.shape[-1]), rate)
    return (residual + jnp.where(keep, _f32(h) * (1.0 / (1.0 - rate)), 0.0).astype(x.dtype)).astype(x.dtype)


def batch_norm(x, weight, bias, *, eps=1e-5, axis=-1):
    """Reference batch norm in training mode (Ioffe & Szegedy 2015): f32 statistics over every
    axis but ``axis``, biased variance, as flax.linen.BatchNorm."""
    xf = _f32(x)
    red = tuple(i for i in range(x.ndim) if i != axis % x.ndim)
    shape = [1] * x.ndim
    shape[axis] = x.shape[axis]
    mean = jnp.mean(xf, axis=red, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=red, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps) * _f32(weight).reshape(shape) + _f32(bias).reshape(shape)
    return y.astype(x.dtype)


def _pool_args(x, window_shape, strides, padding):
    """lax.reduce_window's window, strides and padding over NHWC for a 2-D pool, as flax's
    ``pool`` builds them (padding "SAME"/"VALID" or ((top, bottom), (left, right)))."""
    w = (window_shape,) * 2 if isinstance(window_shape, int) else tuple(window_shape)
    s = (1, 1) if strides is None else ((strides,) * 2 if isinstance(strides, int) else tuple(strides))
    if isinstance(padding, str):
        padding = padding.upper()
    else:
        padding = ((0, 0),) + tuple(tuple(p) for p in padding) + ((0, 0),)
    return (1,) + w + (1,), (1,) + s + (1,), padding


def max_pool2d(x, window_shape, strides=None, padding="VALID"):
    """Reference max pooling, NHWC: ``lax.reduce_window`` max with -inf padding, as
    ``flax.linen.max_pool`` (strides default to 1)."""
    dims, strides_, pad = _pool_args(x, window_shape, strides, padding)
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, dims, strides_, pad)


def avg_pool2d(x, window_shape, strides=None, padding="VALID", count_include_pad=True):
    """Reference average pooling in float32, NHWC, as ``flax.linen.avg_pool``: window sums
    over zero padding, divided by the window size or (``count_include_pad=False``) by the
    number of real elements in each window."""
    dims, strides_, pad = _pool_args(x, window_shape, strides, padding)
    xf = _f32(x)
    total = jax.lax.reduce_window(xf, 0.0, jax.lax.add, dims, strides_, pad)
    if count_include_pad:
        y = total / (dims[1] * dims[2])
    else:
        y = total / jax.lax.reduce_window(jnp.ones_like(xf), 0.0, jax.lax.add, dims, strides_, pad)
    return y.astype(x.dtype)


def adaptive_avg_pool2d(x, output_size):
    """Reference adaptive average pooling (torch's bins) by explicit slices, NHWC."""
    oh, ow = (output_size,) * 2 if isinstance(output_size, int) else tuple(output_size)
    H, W = x.shape[1:3]
    rows = []
    for i in range(oh):
        cols = []
        for j in range(ow):
            h0, h1 = (i * H) // oh, -(-((i + 1) * H) // oh)
            w0, w1 = (j * W) // ow, -(-((j + 1) * W) // ow)
            cols.append(jnp.mean(_f32(x[:, h0:h1, w0:w1, :]), axis=(1, 2)))
        rows.append(jnp.stack(cols, axis=1))
    return jnp.stack(rows, axis=1).astype(x.dtype)
