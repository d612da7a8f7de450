"""dropout: the backward regenerates the mask from the key; the residual is the key only.

Forward (XLA): ``y = x / (1 - rate)`` where the mask keeps, else 0, the mask computed from
the key by the counter-based hash in ``jaxbwd/pallas/dropout.py``. Saved for the backward:
the key's two uint32 words (8 bytes), where autodiff of ``jnp.where(mask, x / keep, 0)``
saves the boolean mask (x's element count in bytes) or the random bits. Backward: the
Pallas kernel ``dropout_bwd`` (hash, select, scale in one pass over dy) or the same jnp
code in XLA; both compute the same mask bit for bit.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxbwd import sharding as S
from jaxbwd.pallas import _common as C
from jaxbwd.pallas import dropout as kernels
from jaxbwd.vjp import _base as B
from jaxbwd.vjp import linear
from jaxbwd.vjp._derivatives import custom_op


def _key_words(op, rng):
    """uint32 [2] words of a typed key or a raw ``PRNGKey`` (threefry, jax's default)."""
    if rng is None:
        raise ValueError(f"jaxbwd.{op}: rng must be a jax.random key when deterministic is False, got None")
    B.check_array(op, "rng", rng)
    data = jax.random.key_data(rng) if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key) else rng
    if data.shape != (2,) or data.dtype != jnp.uint32:
        raise ValueError(f"jaxbwd.{op}: rng must be a threefry key (key data uint32 [2]), got key data "
                         f"{data.dtype} {tuple(data.shape)}")
    return data


def _check_rate(op, rate, deterministic) -> float:
    """rate as a float in [0, 1] (static) and deterministic a Python bool, or a named error."""
    rate = B.check_static_number(op, "rate", rate)
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"jaxbwd.{op}: rate must be in [0, 1], got {rate!r}")
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"jaxbwd.{op}: deterministic must be a Python bool, got {deterministic!r}")
    return rate


_STATIC_WHY = ("the mask hashes each element's position in a static 2-D view (with deterministic=True "
               "or rate 0 the op exports with symbolic shapes)")


def keep_mask(key, shape, rate, view=None):
    """The boolean keep mask of an array of ``shape`` on its [rows, cols] ``view`` (default
    ``C.as_2d``, the elementwise kernels' view), in XLA; the kernels compute the same."""
    R, Cc = C.as_2d("dropout", shape) if view is None else view
    rows = jax.lax.broadcasted_iota(jnp.int32, (R, 1), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (1, Cc), 1)
    return kernels.keep_mask(key[0], key[1], rows, cols, kernels.keep_threshold(rate)).reshape(shape)


def _scaled(mask, v, rate):
    """``v / (1 - rate)`` where ``mask`` keeps, else 0, in at least float32 (unrounded)."""
    cf = B.acc_dtype(v)
    return jnp.where(mask, v.astype(cf) * (1.0 / (1.0 - rate)), 0.0)


def _apply(mask, v, rate):
    return _scaled(mask, v, rate).astype(v.dtype)


@functools.partial(custom_op, nondiff_argnums=(2, 3), name="dropout")
def _dropout(x, key, rate, impl):
    return _apply(keep_mask(key, x.shape, rate), x, rate)


def _dropout_fwd(x, key, rate, impl):
    return _dropout.fun(x, key, rate, impl), key


def _dropout_bwd(rate, impl, key, dy):
    if impl.pallas:
        return kernels.dropout_bwd(key, dy, rate=rate, interpret=impl.interpret), None
    return _apply(keep_mask(key, dy.shape, rate), dy, rate), None


def _dropout_tangent(rate, impl, key, dx, dkey):
    return _apply(keep_mask(key, dx.shape, rate), dx, rate)


_dropout.defvjp(_dropout_fwd, _dropout_bwd)
_dropout.deftangent(_dropout_tangent)


def dropout(x, rate, *, rng=None, deterministic=False, implementation=None):
    """Dropout: zero each element with probability ``rate``, scale the rest by ``1/(1 - rate)``.

    As ``flax.linen.Dropout``: identity when ``deterministic`` or ``rate == 0``; zeros when
    ``rate == 1``. The mask comes from a counter-based hash of (key, element position) (see
    ``jaxbwd/pallas/dropout.py``), not from ``jax.random.bernoulli``: the same key gives a
    different mask than flax's, with the same distribution (keep probability quantised to
    2**-24).

    Args:
      x: [...] float32, bfloat16 or float16 (float64 on the XLA path).
      rate: static Python number in [0, 1].
      rng: a threefry key (``jax.random.key`` or ``jax.random.PRNGKey``); required unless
        deterministic or rate == 0. May be traced (a new key per step).
      deterministic: static bool; True returns x unchanged.
      implementation: ``None`` (Pallas on GPU, XLA elsewhere), ``"pallas"`` or ``"xla"``.

    Returns:
      [...] in x's dtype.

    Residuals: the key only (8 bytes). Backward: the Pallas kernel ``dropout_bwd``
    regenerates the mask from the key in registers (reads dy, writes dx) or the same in XLA.

    Raises:
      TypeError: x not floating; rate not a static real number or deterministic not a
        static bool; rng not an array.
      ValueError: rate outside [0, 1] or NaN; rng missing or not a threefry key; unknown
        implementation; x of symbolic shape (``jax.export``) with 0 < rate < 1 and not deterministic.
      Also the errors common to every op (``help(jaxbwd)``).

    Source: Srivastava et al., "Dropout: A Simple Way to Prevent Neural Networks from
    Overfitting" (JMLR 2014), inverted-dropout scaling; hash: lowbias32 (Wellons 2018).
    """
    op = "dropout"
    B.check_float(op, "x", x)
    rate = _check_rate(op, rate, deterministic)
    if deterministic or rate == 0.0:
        return x
    key = _key_words(op, rng)
    if rate == 1.0:
        return jnp.zeros_like(x)
    B.require_static(op, "x's shape", x.shape, _STATIC_WHY)
    impl = B.impl(implementation, op, x)
    if impl.pallas:  # the mask is defined on global element positions: the kernel runs whole
        return S.whole(lambda x, key: _dropout(x, key, rate, impl), x, key)
    return _dropout(x, key, rate, impl)


# --------------------------------------------------------------------- bias_dropout_add
def _bias_view(shape):
    """bias_dropout_add's mask view: [rows, D] with D the bias axis."""
    return (int(np.prod(shape[:-1], dtype=np.int64)), shape[-1])


@functools.partial(custom_op, nondiff_argnums=(4, 5), name="bias_dropout_add")
def _bias_dropout_add(x, bias, residual, key, rate, impl):
    h = x + bias.astype(x.dtype)
    return (residual + _apply(keep_mask(key, x.shape, rate, _bias_view(x.shape)), h, rate)).astype(x.dtype)


def _bias_dropout_add_fwd(x, bias, residual, key, rate, impl):
    # bias's dtype rides along as an empty array (the gradient's dtype).
    return _bias_dropout_add.fun(x, bias, residual, key, rate, impl), (key, jnp.zeros((0,), bias.dtype))


def _bias_dropout_add_bwd(rate, impl, res, dy):
    key, bias0 = res
    R, D = _bias_view(dy.shape)
    if impl.pallas and R > 0 and D > 0:
        dx, db = kernels.bias_dropout_bwd(key, dy.reshape(R, D), rate=rate, interpret=impl.interpret)
        dx = dx.reshape(dy.shape)
    else:  # as the kernel: dbias sums the unrounded float32 dx
        dxf = _scaled(keep_mask(key, dy.shape, rate, (R, D)), dy, rate)
        dx, db = dxf.astype(dy.dtype), jnp.sum(dxf.reshape(R, D), axis=0)
    return dx, db.astype(bias0.dtype), dy, None


def _bias_dropout_add_tangent(rate, impl, res, dx, dbias, dresidual, dkey):
    key, _ = res
    return _bias_dropout_add.fun(dx, dbias, dresidual, key, rate, impl)  # linear in (x, bias, residual)


_bias_dropout_add.defvjp(_bias_dropout_add_fwd, _bias_dropout_add_bwd)
_bias_dropout_add.deftangent(_bias_dropout_add_tangent)


def bias_dropout_add(x, bias, residual, rate, *, rng=None, deterministic=False, implementation=None):
    """``residual + dropout(x + bias)``, fused: the transformer's bias-dropout-residual step.

    The mask is :func:`dropout`'s hash of (key, row, col) on x's [rows, D] view (D the last
    axis): the same elements as ``dropout(x + bias)`` drops whenever ``16 <= D < 2**31``. Identity
    dropout when ``deterministic`` or ``rate == 0`` (then ``residual_add(bias_add(x, bias),
    residual)``); ``residual`` alone when ``rate == 1``.

    Args:
      x: [..., D] float32, bfloat16 or float16 (float64 on the XLA path).
      bias: [D] floating (added in x's dtype, as :func:`bias_add`).
      residual: x's shape and dtype.
      rate: static Python number in [0, 1].
      rng: a threefry key (``jax.random.key`` or ``jax.random.PRNGKey``); required unless
        deterministic or rate == 0. May be traced.
      deterministic: static bool.
      implementation: ``None`` (Pallas on GPU, XLA elsewhere), ``"pallas"`` or ``"xla"``.

    Returns:
      [..., D] in x's dtype.

    Residuals: the key (8 bytes). Backward: ``dresidual = dy`` (no copy); dx and dbias from
    one Pallas pass over dy (``bias_dropout_add_bwd``: the regenerated mask, the scaled
    write of dx and f32 column sums for dbias). Unfused, :func:`dropout` then
    :func:`bias_add` read dy, write dx and read dx again: 3 passes of x's bytes; fused, 2.

    Raises:
      TypeError: x, bias not floating; residual's dtype not x's; rate not a static real
        number or deterministic not a static bool; rng not an array.
      ValueError: x rank 0; bias not [D]; residual not x's shape; rate outside [0, 1] or NaN; rng
        missing or not a threefry key; unknown implementation; with 0 < rate < 1 and not
        deterministic (the mask's 2-D view), rows (the product of x's leading dims) >= 2**31
        or x of symbolic shape (``jax.export``).
      Also the errors common to every op (``help(jaxbwd)``).

    Source: Megatron-LM's fused bias-dropout-add (Shoeybi et al. 2019); dropout as
    Srivastava et al. (JMLR 2014), inverted scaling.
    """
    op = "bias_dropout_add"
    B.check_float(op, "x", x)
    B.check_float(op, "bias", bias)
    B.check_ndim(op, "x", x, min_ndim=1, what="([..., D])")
    B.check_shape(op, "bias", bias, (x.shape[-1],), what=f"(x's last dimension D={x.shape[-1]})")
    B.check_float(op, "residual", residual)
    B.check_shape(op, "residual", residual, x.shape, what="(x's shape)")
    B.check_same_dtype(op, ("x", "residual"), (x, residual))
    rate = _check_rate(op, rate, deterministic)
    if deterministic or rate == 0.0:
        h = linear.bias_add(x, bias, implementation=implementation)
        return linear.residual_add(h, residual, implementation=implementation)
    key = _key_words(op, rng)
    if rate == 1.0:
        return residual
    B.require_static(op, "x's shape", x.shape, _STATIC_WHY)
    impl = B.impl(implementation, op, x)
    C.check_index_range(op, rows=_bias_view(x.shape)[0])
    if impl.pallas:  # as dropout's
        return S.whole(lambda x, b, r, key: _bias_dropout_add(x, b, r, key, rate, impl), x, bias, residual, key)
    return _bias_dropout_add(x, bias, residual, key, rate, impl)
