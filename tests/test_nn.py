"""jaxbwd.nn modules: same parameter trees and outputs as flax's own modules."""
from __future__ import annotations

import chex
import flax.linen as fnn
import jax
import jax.numpy as jnp
import pytest

import jaxbwd
import jaxbwd.nn as jnn

X = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 24))
IMG = jax.random.normal(jax.random.PRNGKey(3), (2, 7, 9, 8))


@pytest.mark.parametrize(
    "ours,theirs,inputs",
    [
        (jnn.RMSNorm(), fnn.RMSNorm(), X),
        (jnn.LayerNorm(), fnn.LayerNorm(), X),
        (jnn.Dense(7), fnn.Dense(7), X),
        (jnn.Dense(7, use_bias=False), fnn.Dense(7, use_bias=False), X),
        (jnn.Embed(50, 12), fnn.Embed(50, 12), jnp.array([[1, 4, 49], [0, 0, 7]])),
        (jnn.GroupNorm(num_groups=4), fnn.GroupNorm(num_groups=4), IMG),
        (jnn.Conv(6, (3, 3)), fnn.Conv(6, (3, 3)), IMG),
        (jnn.Conv(8, (3, 3), strides=2, padding=1), fnn.Conv(8, (3, 3), strides=2, padding=1), IMG),
    ],
    ids=["RMSNorm", "LayerNorm", "Dense", "Dense-nobias", "Embed", "GroupNorm", "Conv", "Conv-stride2"],
)
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_matches_flax_module(ours, theirs, inputs, impl):
    ours = ours.clone(implementation=impl)
    params = theirs.init(jax.random.PRNGKey(1), inputs)
    mine = ours.init(jax.random.PRNGKey(1), inputs)
    # Same names, shapes and default initialisers: the same key gives the same parameters.
    chex.assert_trees_all_close(mine, params)
    chex.assert_trees_all_close(ours.apply(params, inputs), theirs.apply(params, inputs), atol=1e-5, rtol=1e-5)
    g1 = jax.grad(lambda p: jnp.sum(jnp.sin(ours.apply(p, inputs))))(params)
    g2 = jax.grad(lambda p: jnp.sum(jnp.sin(theirs.apply(p, inputs))))(params)
    chex.assert_trees_all_close(g1, g2, atol=1e-5, rtol=1e-5)


def test_embed_attend_matches_flax():
    ours, theirs = jnn.Embed(50, 12), fnn.Embed(50, 12)
    params = theirs.init(jax.random.PRNGKey(1), jnp.array([1]))
    x = jax.random.normal(jax.random.PRNGKey(2), (3, 12))
    chex.assert_trees_all_close(
        ours.apply(params, x, method="attend"), theirs.apply(params, x, method="attend"), atol=1e-5, rtol=1e-5
    )


def test_attention_and_mlp_modules_run_under_grad():
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 12, 32))
    for mod in (jnn.Attention(num_heads=4, num_kv_heads=2, head_dim=8), jnn.SwiGLUMLP(hidden=48)):
        params = mod.init(jax.random.PRNGKey(1), x)
        for impl in ("xla", "pallas"):
            m = mod.clone(implementation=impl)
            y = m.apply(params, x)
            assert y.shape == x.shape
            g = jax.grad(lambda p: jnp.sum(m.apply(p, x) ** 2))(params)
            assert all(bool(jnp.all(jnp.isfinite(l))) for l in jax.tree_util.tree_leaves(g))
        # Both implementations agree.
        ga = jax.grad(lambda p: jnp.sum(mod.clone(implementation="xla").apply(p, x) ** 2))(params)
        gb = jax.grad(lambda p: jnp.sum(mod.clone(implementation="pallas").apply(p, x) ** 2))(params)
        chex.assert_trees_all_close(ga, gb, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_nnx_modules_match_flax(impl):
    from flax import nnx

    import jaxbwd.nn.nnx as jnnx

    pairs = [
        (jnnx.RMSNorm(24, rngs=nnx.Rngs(0), implementation=impl), nnx.RMSNorm(24, rngs=nnx.Rngs(0)), X),
        (jnnx.LayerNorm(24, rngs=nnx.Rngs(0), implementation=impl), nnx.LayerNorm(24, rngs=nnx.Rngs(0)), X),
        (jnnx.Linear(24, 7, rngs=nnx.Rngs(0), implementation=impl), nnx.Linear(24, 7, rngs=nnx.Rngs(0)), X),
        (jnnx.Embed(50, 12, rngs=nnx.Rngs(0), implementation=impl), nnx.Embed(50, 12, rngs=nnx.Rngs(0)),
         jnp.array([[1, 4, 49], [0, 0, 7]])),
        (jnnx.GroupNorm(8, num_groups=4, rngs=nnx.Rngs(0), implementation=impl),
         nnx.GroupNorm(8, num_groups=4, rngs=nnx.Rngs(0)), IMG),
        (jnnx.Conv(8, 6, (3, 3), rngs=nnx.Rngs(0), implementation=impl), nnx.Conv(8, 6, (3, 3), rngs=nnx.Rngs(0)), IMG),
    ]
    for ours, theirs, inputs in pairs:
        chex.assert_trees_all_close(nnx.state(ours, nnx.Param), nnx.state(theirs, nnx.Param))
        chex.assert_trees_all_close(ours(inputs), theirs(inputs), atol=1e-5, rtol=1e-5)
        g1 = nnx.grad(lambda m: jnp.sum(jnp.sin(m(inputs))))(ours)
        g2 = nnx.grad(lambda m: jnp.sum(jnp.sin(m(inputs))))(theirs)
        chex.assert_trees_all_close(nnx.state(g1, nnx.Param), nnx.state(g2, nnx.Param), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_nnx_composite_modules_run_under_grad(impl):
    from flax import nnx

    import jaxbwd.nn.nnx as jnnx

    x = jax.random.normal(jax.random.PRNGKey(0), (2, 12, 32))
    img = jax.random.normal(jax.random.PRNGKey(1), (1, 4, 4, 8))
    mods = [
        (jnnx.Attention(32, 4, 2, 8, implementation=impl, rngs=nnx.Rngs(0)), x, x.shape),
        (jnnx.SwiGLUMLP(32, 48, implementation=impl, rngs=nnx.Rngs(0)), x, x.shape),
        (jnnx.PixelShuffle(2, implementation=impl), img, (1, 8, 8, 2)),
        (jnnx.Upsample(2, method="bilinear", implementation=impl), img, (1, 8, 8, 8)),
    ]
    for m, inp, shape in mods:
        assert m(inp).shape == shape
        g = nnx.grad(lambda m, inp: jnp.sum(m(inp) ** 2), argnums=1)(m, inp)
        assert g.shape == inp.shape and bool(jnp.all(jnp.isfinite(g)))


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_embed_attend_cross_entropy_is_the_tied_head_loss(impl):
    """Embed.attend_cross_entropy == cross_entropy(attend(query)): value and parameter/query grads."""
    ours = jnn.Embed(37, 16, implementation=impl)
    params = ours.init(jax.random.PRNGKey(1), jnp.array([1]))
    q = jax.random.normal(jax.random.PRNGKey(2), (2, 5, 16))
    labels = jnp.array([[1, 36, 0, -100, 7], [3, 3, 9, 12, 30]])
    kw = dict(label_smoothing=0.1, z_loss=1e-3)

    def fused(p, q):
        return ours.apply(p, q, labels, method="attend_cross_entropy", **kw)

    def unfused(p, q):
        return jaxbwd.cross_entropy(ours.apply(p, q, method="attend"), labels, implementation=impl, **kw)

    chex.assert_trees_all_close(fused(params, q), unfused(params, q), atol=1e-5, rtol=1e-5)
    chex.assert_trees_all_close(jax.grad(fused, (0, 1))(params, q), jax.grad(unfused, (0, 1))(params, q),
                                atol=1e-5, rtol=1e-5)
