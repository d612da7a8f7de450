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

from jaxbwd.pallas import _common as C
from jaxbwd.pallas import dropout as kernels
from jaxbwd.vjp import _base as B
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


def keep_mask(key, shape, rate):
    """The boolean keep mask of an array of ``shape`` (XLA; the kernel computes the same)."""
    R, Cc = C.as_2d("dropout", shape)
    rows = jax.lax.broadcasted_iota(jnp.int32, (R, 1), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (1, Cc), 1)
    return kernels.keep_mask(key[0], key[1], rows, cols, kernels.keep_threshold(rate)).reshape(shape)


def _apply(mask, v, rate):
    cf = jnp.promote_types(v.dtype, jnp.float32)
    return jnp.where(mask, v.astype(cf) * (1.0 / (1.0 - rate)), 0.0).astype(v.dtype)


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
      x: [...] float32, bfloat16 or float16.
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
      TypeError: x not floating; rate or deterministic not static.
      ValueError: rate outside [0, 1]; rng missing or not a threefry key; unknown implementation.

    Source: Srivastava et al., "Dropout: A Simple Way to Prevent Neural Networks from
    Overfitting" (JMLR 2014), inverted-dropout scaling; hash: lowbias32 (Wellons 2018).
    """
    op = "dropout"
    B.check_float(op, "x", x)
    rate = B.check_static_number(op, "rate", rate)
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"jaxbwd.{op}: rate must be in [0, 1], got {rate!r}")
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"jaxbwd.{op}: deterministic must be a Python bool, got {deterministic!r}")
    if deterministic or rate == 0.0:
        return x
    key = _key_words(op, rng)
    if rate == 1.0:
        return jnp.zeros_like(x)
    return _dropout(x, key, rate, B.impl(implementation, op, x))
