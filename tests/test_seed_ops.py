"""Cases the registry contract does not cover for mse_loss, dropout, batch_norm and pooling."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxbwd
from jaxbwd import config
from jaxbwd import reference as ref

IMPLS = ("xla", "pallas")


@pytest.fixture(autouse=True)
def _interpret():
    with config.use(interpret=True):
        yield


def _normal(seed, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32).astype(dtype)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_mse_loss_weights_grad_and_optax(reduction):
    p, t = _normal(0, (7, 13)), _normal(1, (7, 13))
    w = jax.random.uniform(jax.random.PRNGKey(2), (7, 13))
    ct = _normal(3, () if reduction != "none" else (7, 13))
    f = lambda p, t, w: jaxbwd.mse_loss(p, t, w, reduction=reduction)
    f_ref = lambda p, t, w: ref.mse_loss(p, t, w, reduction=reduction)
    got = jax.vjp(f, p, t, w)[1](ct)
    want = jax.vjp(f_ref, p, t, w)[1](ct)
    chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5)
    plain = optax.squared_error(p, t)
    want_out = {"mean": plain.mean(), "sum": plain.sum(), "none": plain}[reduction]
    chex.assert_trees_all_close(jaxbwd.mse_loss(p, t, reduction=reduction), want_out, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_dropout_mask_statistics(rate):
    """Keep fraction per array, per row and per column near 1 - rate (binomial bounds), and
    independent keys give independent masks."""
    x = jnp.ones((512, 1024))
    y = jaxbwd.dropout(x, rate, rng=jax.random.key(0))
    keep = np.asarray(y != 0)
    p, n = 1 - rate, keep.size
    assert abs(keep.mean() - p) < 5 * np.sqrt(p * (1 - p) / n)
    for axis, m in ((0, 512), (1, 1024)):
        frac = keep.mean(axis=axis)  # per column, per row
        assert np.all(np.abs(frac - p) < 6 * np.sqrt(p * (1 - p) / m))
    other = np.asarray(jaxbwd.dropout(x, rate, rng=jax.random.key(1)) != 0)
    agree = (keep == other).mean()  # independent masks agree with probability p^2 + (1-p)^2
    assert abs(agree - (p * p + (1 - p) ** 2)) < 0.01
    np.testing.assert_allclose(np.asarray(y)[keep], 1 / p, rtol=1e-6)


def test_dropout_same_mask_both_implementations_and_flax_semantics():
    x = _normal(0, (3, 5, 77))
    key = jax.random.key(5)
    ct = _normal(1, x.shape)
    grads = {}
    for impl in IMPLS:
        f = lambda x: jaxbwd.dropout(x, 0.25, rng=key, implementation=impl)
        grads[impl] = jax.vjp(f, x)[1](ct)[0]
    np.testing.assert_array_equal(np.asarray(grads["xla"]), np.asarray(grads["pallas"]))
    y = jaxbwd.dropout(x, 0.25, rng=key)
    np.testing.assert_array_equal(np.asarray(grads["xla"] != 0), np.asarray(y != 0))
    # flax.linen.Dropout's edge cases: deterministic and rate 0 are the identity, rate 1 zeros.
    assert jaxbwd.dropout(x, 0.5, deterministic=True) is x
    assert jaxbwd.dropout(x, 0.0, rng=key) is x
    np.testing.assert_array_equal(np.asarray(jaxbwd.dropout(x, 1.0, rng=key)), 0.0)


def test_dropout_traced_key_in_a_jitted_step():
    x = _normal(0, (8, 64))

    @jax.jit
    def step(x, key):
        return jax.grad(lambda x: jnp.sum(jaxbwd.dropout(x, 0.5, rng=key) ** 2))(x)

    g1, g2 = step(x, jax.random.key(1)), step(x, jax.random.key(2))
    assert not np.array_equal(np.asarray(g1 != 0), np.asarray(g2 != 0))
