"""Cases the registry contract does not cover for mse_loss, dropout, bias_dropout_add, batch_norm and pooling."""
import os
import subprocess
import sys

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
        y, vjp = jax.vjp(f, x)
        grads[impl] = vjp(ct)[0]
        chex.assert_trees_all_close(y, ref.dropout(x, 0.25, rng=key), atol=0, rtol=0)  # the same scale too
    np.testing.assert_array_equal(np.asarray(grads["xla"]), np.asarray(grads["pallas"]))
    y = jaxbwd.dropout(x, 0.25, rng=key)
    np.testing.assert_array_equal(np.asarray(grads["xla"] != 0), np.asarray(y != 0))
    # flax.linen.Dropout's edge cases: deterministic and rate 0 are the identity, rate 1 zeros.
    assert jaxbwd.dropout(x, 0.5, deterministic=True) is x
    assert jaxbwd.dropout(x, 0.0, rng=key) is x
    np.testing.assert_array_equal(np.asarray(jaxbwd.dropout(x, 1.0, rng=key)), 0.0)


@pytest.mark.parametrize("shape,dtype", [((300, 1100), jnp.float32), ((3, 50, 272), jnp.bfloat16), ((7, 5), jnp.float32)])
def test_bias_dropout_add_is_residual_plus_dropout_of_bias_add(shape, dtype):
    """bias_dropout_add(x, b, r) equals residual_add(r, dropout(bias_add(x, b))) (the same mask
    whenever D >= 16), and its one-pass Pallas backward equals the XLA backward, at shapes
    with several column blocks, row splits and tails."""
    x, b, r = _normal(0, shape, dtype), _normal(1, shape[-1:], dtype), _normal(2, shape, dtype)
    ct = _normal(3, shape, dtype)
    key = jax.random.key(4)
    grads = {}
    for impl in IMPLS:
        f = lambda x, b, r: jaxbwd.bias_dropout_add(x, b, r, 0.3, rng=key, implementation=impl)
        y, vjp = jax.vjp(f, x, b, r)
        grads[impl] = vjp(ct)
        chex.assert_trees_all_close(y, ref.bias_dropout_add(x, b, r, 0.3, rng=key), atol=0, rtol=0)
        if shape[-1] >= 16:
            chex.assert_trees_all_close(y, jaxbwd.dropout(jaxbwd.bias_add(x, b), 0.3, rng=key) + r, atol=0, rtol=0)
        dx, db, dr = grads[impl]
        np.testing.assert_array_equal(np.asarray(dr), np.asarray(ct))
        keep = jaxbwd.bias_dropout_add(jnp.ones_like(x), jnp.zeros_like(b), jnp.zeros_like(r), 0.3, rng=key) != 0
        np.testing.assert_array_equal(np.asarray(dx != 0), np.asarray(keep & (ct != 0)))
    np.testing.assert_array_equal(np.asarray(grads["xla"][0]), np.asarray(grads["pallas"][0]))
    exact = jnp.sum(jnp.where(keep, ct.astype(jnp.float32) / 0.7, 0.0).reshape(-1, shape[-1]), axis=0)
    tol = 1e-5 if dtype == jnp.float32 else 1e-2  # bf16: dbias rounded once (and XLA sums rounded dx)
    for impl in IMPLS:
        chex.assert_trees_all_close(grads[impl][1].astype(jnp.float32), exact, atol=tol * float(jnp.abs(exact).max()), rtol=tol)


def test_bias_dropout_add_edge_rates():
    x, b, r = _normal(0, (4, 32)), _normal(1, (32,)), _normal(2, (4, 32))
    key = jax.random.key(0)
    for kw in ({"rate": 0.0, "rng": key}, {"rate": 0.5, "deterministic": True}):
        rate = kw.pop("rate")
        np.testing.assert_array_equal(np.asarray(jaxbwd.bias_dropout_add(x, b, r, rate, **kw)), np.asarray(r + (x + b)))
    assert jaxbwd.bias_dropout_add(x, b, r, 1.0, rng=key) is r
    g = jax.grad(lambda x, b: jnp.sum(jaxbwd.bias_dropout_add(x, b, r, 1.0, rng=key)), argnums=(0, 1))(x, b)
    chex.assert_trees_all_close(g, (jnp.zeros_like(x), jnp.zeros_like(b)))
    # D = 0 (empty rows): empty grads on every path, bias_add's backward included
    x0, b0 = jnp.ones((3, 0)), jnp.ones((0,))
    for impl in IMPLS:
        for rate in (0.0, 0.5):
            f = lambda x, b: jnp.sum(jaxbwd.bias_dropout_add(x, b, x, rate, rng=key, implementation=impl))
            gx, gb = jax.grad(f, argnums=(0, 1))(x0, b0)
            assert gx.shape == (3, 0) and gb.shape == (0,)


def test_dropout_traced_key_in_a_jitted_step():
    x = _normal(0, (8, 64))

    @jax.jit
    def step(x, key):
        return jax.grad(lambda x: jnp.sum(jaxbwd.dropout(x, 0.5, rng=key) ** 2))(x)

    g1, g2 = step(x, jax.random.key(1)), step(x, jax.random.key(2))
    assert not np.array_equal(np.asarray(g1 != 0), np.asarray(g2 != 0))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kwargs", [{}, {"axis": 1, "momentum": 0.9}, {"use_scale": False, "dtype": jnp.bfloat16}])
def test_linen_batch_norm_matches_flax(kwargs, impl):
    """jaxbwd.nn.BatchNorm against flax.linen.BatchNorm: init, training step (outputs, grads,
    updated batch_stats) and eval with the running statistics."""
    import flax.linen as fnn

    import jaxbwd.nn as jnn

    x = 2.0 + _normal(0, (4, 5, 6, 8))
    ours = jnn.BatchNorm(implementation=impl, **kwargs)
    theirs = fnn.BatchNorm(**kwargs)
    variables = theirs.init(jax.random.PRNGKey(0), x, False)
    chex.assert_trees_all_equal_shapes_and_dtypes(ours.init(jax.random.PRNGKey(0), x, False), variables)
    variables = jax.tree_util.tree_map(lambda v: v + 0.1 * _normal(9, v.shape, v.dtype), variables)

    def loss(module, params, x):
        y, upd = module.apply({"params": params, "batch_stats": variables["batch_stats"]}, x, False,
                              mutable=["batch_stats"])
        return jnp.sum(jnp.sin(y.astype(jnp.float32))), (y, upd)

    tol = 2e-2 if kwargs.get("dtype") == jnp.bfloat16 else 1e-5
    (l1, (y1, u1)), g1 = jax.value_and_grad(lambda p, x: loss(ours, p, x), argnums=(0, 1), has_aux=True)(variables["params"], x)
    (l2, (y2, u2)), g2 = jax.value_and_grad(lambda p, x: loss(theirs, p, x), argnums=(0, 1), has_aux=True)(variables["params"], x)
    assert y1.dtype == y2.dtype
    chex.assert_trees_all_close((y1.astype(jnp.float32), u1), (y2.astype(jnp.float32), u2), atol=tol, rtol=tol)
    chex.assert_trees_all_close(g1, g2, atol=tol, rtol=tol)
    ev = lambda m: m.apply(variables, x, use_running_average=True)  # noqa: E731
    chex.assert_trees_all_close(ev(ours).astype(jnp.float32), ev(theirs).astype(jnp.float32), atol=tol, rtol=tol)


BN_SHARDED = r"""
import jax, jax.numpy as jnp
from jax.sharding import PartitionSpec as P, NamedSharding
import jaxbwd
from jaxbwd import config, reference as ref
x = jax.random.normal(jax.random.PRNGKey(0), (4, 5, 6, 40))
w = 1 + 0.1 * jax.random.normal(jax.random.PRNGKey(1), (40,)); b = 0.1 * jax.random.normal(jax.random.PRNGKey(2), (40,))
ct = jax.random.normal(jax.random.PRNGKey(3), x.shape)
want = jax.vjp(lambda x, w, b: ref.batch_norm(x, w, b), x, w, b)[1](ct)
mesh = jax.make_mesh((2,), ("d",))
put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
xs, cts, ws, bs = put(x, P("d")), put(ct, P("d")), put(w, P()), put(b, P())
# Pallas runs in interpret mode here, which cannot run inside a vma-checked shard_map (JAX's
# interpreter), so the kernel path runs with check_vma=False and its weight grads are psummed.
for impl, vma in (("xla", True), ("pallas", False)):
    def f(x, w, b):
        return jaxbwd.batch_norm(x, w, b, axis_name="d", implementation=impl)
    def g(x, w, b, ct):
        y, vjp = jax.vjp(f, x, w, b)
        dx, dw, db = vjp(ct)
        if not vma:
            dw, db = jax.lax.psum(dw, "d"), jax.lax.psum(db, "d")
        return y, dx, dw, db
    sm = jax.shard_map(g, mesh=mesh, in_specs=(P("d"), P(), P(), P("d")), out_specs=(P("d"), P("d"), P(), P()),
                       check_vma=vma)
    with config.use(interpret=True):
        y, *grads = sm(xs, ws, bs, cts)
    err = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip([y, *grads], [ref.batch_norm(x, w, b), *want]))
    assert err < 1e-4, (impl, err)
    print(impl, "ok", err)
"""


def test_batch_norm_axis_name_cross_device_statistics():
    """Two CPU devices, the batch split over them: statistics and gradients as on the whole batch."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", BN_SHARDED], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "xla ok" in r.stdout and "pallas ok" in r.stdout


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("window, strides, padding", [(2, 2, "VALID"), (3, 2, "SAME"), ((3, 2), 1, ((1, 1), (0, 1)))])
def test_max_pool2d_ties_go_where_xla_sends_them(window, strides, padding, impl):
    """Inputs with many exact ties (values rounded to a few levels) and overlapping windows: each
    window selects the element XLA's own gradient (autodiff of flax.linen.max_pool) selects."""
    x = jnp.round(_normal(0, (2, 9, 8, 3)))
    f = lambda x: jaxbwd.max_pool2d(x, window, strides, padding, implementation=impl)  # noqa: E731
    r = lambda x: ref.max_pool2d(x, window, strides, padding)  # noqa: E731
    y, vjp = jax.vjp(f, x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(r(x)))
    # Unit cotangents: each input's gradient counts the windows that selected it (exact).
    ones = jnp.ones(y.shape)
    np.testing.assert_array_equal(np.asarray(vjp(ones)[0]), np.asarray(jax.vjp(r, x)[1](ones)[0]))
    ct = _normal(1, y.shape)  # overlapping windows add in another order: rounding only
    np.testing.assert_allclose(np.asarray(vjp(ct)[0]), np.asarray(jax.vjp(r, x)[1](ct)[0]), atol=1e-6)


def test_pooling_grads_are_deterministic_under_jit():
    x = _normal(0, (4, 16, 16, 8))
    for f in (lambda x: jaxbwd.max_pool2d(x, 3, 2, "SAME"), lambda x: jaxbwd.avg_pool2d(x, 3, 2, "SAME")):
        g = jax.jit(jax.grad(lambda x: jnp.sum(jnp.sin(f(x)))))
        np.testing.assert_array_equal(np.asarray(g(x)), np.asarray(g(x)))
