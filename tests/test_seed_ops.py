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
