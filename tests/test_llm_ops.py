"""Op-specific tests of embed, rope and cross_entropy (the registry contract covers the rest)."""
from __future__ import annotations

import contextlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxbwd import config
from jaxbwd import reference as ref
from jaxbwd.pallas import _common as pallas_common
from jaxbwd.vjp._derivatives import FORWARD_MODE
from jaxbwd.vjp.embedding import embed
from jaxbwd.vjp.losses import cross_entropy
from jaxbwd.vjp.rope import rope

IMPLS = ("xla", "pallas")
KEY = jax.random.PRNGKey(0)


def _normal(seed, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32).astype(dtype)


def _vjp(f, x, ct):
    """(f(x), vjp(ct)) traced and compiled as one program (eager op-by-op dispatch is slow)."""

    def run(x, ct):
        out, vjp = jax.vjp(f, x)
        return out, vjp(ct)[0]

    return jax.jit(run)(x, ct)


def _lowered_kernels(fn, *args):
    with config.use(interpret=False):
        return pallas_common.triton_kernel_names(pallas_common.lower_for_gpu(fn, *args))


# ----------------------------------------------------------------------------- embed
@pytest.mark.parametrize("impl", IMPLS)
def test_embed_all_ids_equal_sum_exactly(impl):
    ids = jnp.full((769,), 3, jnp.int32)
    table = _normal(1, (11, 40))
    out, g = _vjp(lambda t: embed(ids, t, implementation=impl), table, jnp.ones((769, 40)))
    np.testing.assert_array_equal(out, jnp.broadcast_to(table[3], (769, 40)))
    want = jnp.zeros((11, 40)).at[3].set(769.0)
    np.testing.assert_array_equal(g, want)


@pytest.mark.parametrize("impl", IMPLS)
def test_embed_hot_ids_at_chunk_boundaries(impl):
    # Ids with 64 tokens (one chunk), 65 and 300 (hot: several chunks added in order), 1, and
    # rows nobody hits; integer-valued dy so that every f32 sum is exact in any order.
    from jaxbwd.pallas import embedding as emb

    V, D = 50, 700  # two column blocks
    ids = np.concatenate([np.full(300, 3), np.full(65, 7), np.full(64, 9), np.full(128, 11), [20, 21, 21], [-1, 50]])
    ids = jnp.asarray(np.random.default_rng(0).permutation(ids), jnp.int32)
    ct = jnp.round(4.0 * _normal(2, (ids.shape[0], D)))
    _, g = _vjp(lambda t: embed(ids, t, implementation=impl), _normal(1, (V, D)), ct)
    want = np.zeros((V + 1, D))
    np.add.at(want, np.where((np.asarray(ids) < 0) | (np.asarray(ids) >= V), V, np.asarray(ids)), np.asarray(ct, np.float64))
    np.testing.assert_array_equal(g, want[:V])
    work = emb.plan(jnp.where((ids >= 0) & (ids < V), ids, V), V)
    live = np.asarray(work["end"]) > np.arange(ids.shape[0])
    # 300 -> 5 chunks, 65 -> 2, 64 -> 1, 128 -> 2, then ids 20 and 21: work for present ids only.
    assert live.sum() == 5 + 2 + 1 + 2 + 2
    counts = np.asarray(work["hot_count"])
    assert counts[counts > 0].tolist() == [5, 2, 2]


@pytest.mark.parametrize("impl", IMPLS)
def test_embed_random_duplicates_and_out_of_range(impl):
    V, D = 13, 24
    ids = jax.random.randint(KEY, (256, 3, 7), -2, V + 2)  # many duplicates, some out of range
    table = _normal(1, (V, D))
    ct = _normal(2, (256, 3, 7, D))
    out, g = _vjp(lambda t: embed(ids, t, implementation=impl), table, ct)
    out_r, g_r = _vjp(lambda t: ref.embed(ids, t), table, ct)
    np.testing.assert_array_equal(out, out_r)
    oob = (ids < 0) | (ids >= V)
    assert bool(jnp.all(jnp.where(oob[..., None], out == 0, True)))
    # float64 numpy truth of the scatter-add, out-of-range ids dropped
    want = np.zeros((V + 1, D))
    np.add.at(want, np.where(np.asarray(oob), V, np.asarray(ids)).reshape(-1), np.asarray(ct, np.float64).reshape(-1, D))
    np.testing.assert_allclose(g, want[:V], rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(g, g_r, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("impl", IMPLS)
def test_embed_padding_idx(impl):
    V, D = 9, 33
    ids = jnp.array([[0, 4, 4, 8], [0, 0, 2, -1]])
    table = _normal(3, (V, D))
    ct = _normal(4, (2, 4, D))
    for pad in (0, -1):
        out, g = _vjp(lambda t: embed(ids, t, padding_idx=pad, implementation=impl), table, ct)
        _, g_r = _vjp(lambda t: ref.embed(ids, t, padding_idx=pad), table, ct)
        np.testing.assert_array_equal(out[0, 0], table[0])  # the padding row is returned as stored
        np.testing.assert_array_equal(g[pad % V], 0.0)
        np.testing.assert_allclose(g, g_r, rtol=1e-6, atol=1e-6)
        if FORWARD_MODE:  # the padding row gets no tangent either: forward mode agrees with reverse
            f = lambda t: embed(ids, t, padding_idx=pad, implementation=impl)  # noqa: E731
            _, t_out = jax.jvp(f, (table,), (jnp.ones_like(table),))
            np.testing.assert_array_equal(t_out[ids == pad % V], 0.0)
            np.testing.assert_array_equal(jax.jacfwd(f)(table[:, :2]), jax.jacrev(f)(table[:, :2]))
    assert float(jnp.abs(g[4] - ct[0, 1] - ct[0, 2]).max()) < 1e-6


@pytest.mark.parametrize("impl", IMPLS)
def test_embed_vmap_over_ids_with_shared_table(impl):
    V, D = 10, 16
    ids = jax.random.randint(KEY, (3, 5, 4), 0, V)
    table = _normal(5, (V, D))

    def loss(t, i):
        return jnp.sum(embed(i, t, implementation=impl) ** 2)

    per_example = jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0)))(table, ids)
    grad = jax.jit(jax.grad(loss))
    looped = jnp.stack([grad(table, ids[b]) for b in range(3)])
    np.testing.assert_allclose(per_example, looped, rtol=1e-6, atol=1e-6)
    summed = jax.jit(jax.grad(lambda t: jnp.sum(jax.vmap(lambda i: embed(i, t, implementation=impl))(ids) ** 2)))(table)
    np.testing.assert_allclose(summed, looped.sum(0), rtol=1e-5, atol=1e-5)


def test_embed_lowers_for_cuda():
    def bwd(ids, t):
        out, vjp = jax.vjp(lambda t: embed(ids, t, padding_idx=0, implementation="pallas"), t)
        return vjp(jnp.ones_like(out))

    names = _lowered_kernels(bwd, jax.ShapeDtypeStruct((8, 1024), jnp.int32), jax.ShapeDtypeStruct((32000, 4096), jnp.bfloat16))
    assert "embed_bwd" in names


# ------------------------------------------------------------------------------ rope
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("interleaved", (False, True))
def test_rope_per_batch_positions(impl, interleaved):
    x = _normal(6, (2, 5, 3, 8))
    pos = jnp.array([[0, 1, 2, 3, 4], [7, 8, 0, 1, 2]])  # packed second row
    ct = _normal(7, x.shape)
    out, g = _vjp(lambda v: rope(v, positions=pos, interleaved=interleaved, implementation=impl), x, ct)
    out_r, g_r = _vjp(lambda v: ref.rope(v, positions=pos, interleaved=interleaved), x, ct)
    np.testing.assert_allclose(out, out_r, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(g, g_r, rtol=1e-5, atol=1e-5)
    # each row uses its own positions: row 1 at positions 7, 8 equals a lone sequence at 7, 8
    lone = ref.rope(x[1:, :2], start_pos=7, interleaved=interleaved)
    np.testing.assert_allclose(out[1:, :2], lone, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_rope_traced_start_pos_under_jit(impl):
    x = _normal(8, (1, 4, 2, 16))
    ct = _normal(9, x.shape)

    @jax.jit
    def f(x, start):
        return _vjp(lambda v: rope(v, start_pos=start, implementation=impl), x, ct)

    for start in (0, 5, 37):
        out, g = f(x, jnp.int32(start))
        out_r, g_r = _vjp(lambda v: ref.rope(v, positions=start + jnp.arange(4)), x, ct)
        np.testing.assert_allclose(out, out_r, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(g, g_r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("interleaved", (False, True))
def test_rope_conventions_and_gqa_k(impl, interleaved):
    """q (8 heads) and GQA k (2 heads): scores depend only on relative position; grads = reference's."""
    H = 16
    q = _normal(10, (1, 6, 8, H))
    k = _normal(11, (1, 6, 2, H))

    @jax.jit
    def scores(q, k, start):
        qr = rope(q, start_pos=start, interleaved=interleaved, implementation=impl)
        kr = rope(k, start_pos=start, interleaved=interleaved, implementation=impl)
        return jnp.einsum("btnh,bsnh->bnts", qr[:, :, ::4], kr)

    s1, s2 = scores(q, k, jnp.int32(0)), scores(q, k, jnp.int32(11))
    np.testing.assert_allclose(s1, s2, rtol=1e-4, atol=1e-4)
    # the convention is what it says: half-split pairs (i, i + H/2), interleaved pairs (2i, 2i + 1)
    e = jnp.zeros((1, 2, 1, H)).at[0, 1, 0, 0].set(1.0)
    y = rope(e, interleaved=interleaved, implementation=impl)[0, 1, 0]
    partner = 1 if interleaved else H // 2
    np.testing.assert_allclose([y[0], y[partner]], [np.cos(1.0), np.sin(1.0)], rtol=1e-6)
    ct = _normal(12, k.shape)
    _, g = _vjp(lambda v: rope(v, interleaved=interleaved, implementation=impl), k, ct)
    _, g_r = _vjp(lambda v: ref.rope(v, interleaved=interleaved), k, ct)
    np.testing.assert_allclose(g, g_r, rtol=1e-5, atol=1e-5)


def test_rope_lowers_for_cuda():
    def bwd(x, pos):
        out, vjp = jax.vjp(lambda v: rope(v, positions=pos, implementation="pallas"), x)
        return vjp(jnp.ones_like(out))

    names = _lowered_kernels(bwd, jax.ShapeDtypeStruct((2, 8192, 32, 128), jnp.bfloat16), jax.ShapeDtypeStruct((2, 8192), jnp.int32))
    assert "rope_bwd" in names


# --------------------------------------------------------------------- cross_entropy
def _ce_inputs(shape=(4, 6), V=37, dtype=jnp.float32, seed=0):
    logits = 2.0 * _normal(seed, shape + (V,), dtype)
    labels = jax.random.randint(jax.random.PRNGKey(seed + 1), shape, 0, V)
    return logits, labels


@pytest.mark.parametrize("impl", IMPLS)
def test_cross_entropy_matches_optax(impl):
    logits, labels = _ce_inputs()
    ct = jnp.float32(1.3)
    for kw, optax_fn in (
        ({}, lambda x: optax.softmax_cross_entropy_with_integer_labels(x, labels).mean()),
        ({"reduction": "sum"}, lambda x: optax.softmax_cross_entropy_with_integer_labels(x, labels).sum()),
        (
            {"label_smoothing": 0.1, "reduction": "sum"},
            lambda x: optax.softmax_cross_entropy(x, optax.smooth_labels(jax.nn.one_hot(labels, 37), 0.1)).sum(),
        ),
    ):
        out, g = _vjp(lambda x: cross_entropy(x, labels, implementation=impl, **kw), logits, ct)
        out_o, g_o = _vjp(optax_fn, logits, ct)
        np.testing.assert_allclose(out, out_o, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(g, g_o, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_cross_entropy_smoothing_and_z_loss(impl):
    logits, labels = _ce_inputs(shape=(3, 5), V=50)
    labels = labels.at[0, 0].set(-100).at[1, 1].set(7)
    eps, z = 0.1, 1e-2
    ct = jnp.float32(0.7)
    out, g = _vjp(lambda x: cross_entropy(x, labels, label_smoothing=eps, z_loss=z, implementation=impl), logits, ct)

    def explicit(x):  # written out from the definitions, independent of reference.py
        logp = jax.nn.log_softmax(x)
        q = optax.smooth_labels(jax.nn.one_hot(labels, 50), eps)
        lse = jax.nn.logsumexp(x, axis=-1)
        per = -jnp.sum(q * logp, axis=-1) + z * lse**2
        valid = labels != -100
        return jnp.sum(jnp.where(valid, per, 0.0)) / jnp.sum(valid)

    out_e, g_e = _vjp(explicit, logits, ct)
    out_r, g_r = _vjp(lambda x: ref.cross_entropy(x, labels, label_smoothing=eps, z_loss=z), logits, ct)
    np.testing.assert_allclose(out, out_e, rtol=1e-5)
    np.testing.assert_allclose(out_r, out_e, rtol=1e-5)
    np.testing.assert_allclose(g, g_e, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(g, g_r, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("impl", IMPLS)
def test_cross_entropy_reduction_none_uses_row_cotangents(impl):
    logits, labels = _ce_inputs(shape=(2, 7), V=33)
    labels = labels.at[1, 3].set(-100).at[0, 2].set(33)  # ignored and out-of-range rows
    ct = jnp.arange(14, dtype=jnp.float32).reshape(2, 7) - 5.0  # non-uniform, some negative
    out, g = _vjp(lambda x: cross_entropy(x, labels, reduction="none", z_loss=1e-3, implementation=impl), logits, ct)
    out_r, g_r = _vjp(lambda x: ref.cross_entropy(x, labels, reduction="none", z_loss=1e-3), logits, ct)
    assert out.shape == (2, 7)
    assert float(out[1, 3]) == 0.0 and float(out[0, 2]) == 0.0
    np.testing.assert_allclose(out, out_r, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g, g_r, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(g[1, 3], 0.0)
    np.testing.assert_array_equal(g[0, 2], 0.0)
    # row r's gradient is ct[r] times the gradient of its own loss
    unit = _vjp(lambda x: cross_entropy(x, labels, reduction="none", z_loss=1e-3, implementation=impl), logits, jnp.ones_like(ct))[1]
    np.testing.assert_allclose(g, unit * ct[..., None], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_cross_entropy_bf16_error_no_worse_than_autodiff(impl):
    logits32, labels = _ce_inputs(shape=(16,), V=300, seed=3)
    logits = logits32.astype(jnp.bfloat16)
    truth_in = logits.astype(jnp.float32)  # the same (rounded) values, computed in f32
    _, g_true = _vjp(lambda x: ref.cross_entropy(x, labels, z_loss=1e-3), truth_in, jnp.float32(1.0))
    _, g_ad = _vjp(lambda x: ref.cross_entropy(x, labels, z_loss=1e-3), logits, jnp.bfloat16(1.0))
    out, g = _vjp(lambda x: cross_entropy(x, labels, z_loss=1e-3, implementation=impl), logits, jnp.bfloat16(1.0))
    assert g.dtype == jnp.bfloat16 and out.dtype == jnp.bfloat16
    err = float(jnp.max(jnp.abs(g.astype(jnp.float32) - g_true)))
    err_ad = float(jnp.max(jnp.abs(g_ad.astype(jnp.float32) - g_true)))
    assert err <= err_ad * 1.01 + 1e-6, (err, err_ad)


@pytest.mark.parametrize("impl", IMPLS)
def test_cross_entropy_float16_loss_scaling_keeps_small_gradients(impl):
    # The saved gradient of float16 logits is float32: softmax / rows values below float16's
    # range survive until a loss-scaling cotangent brings them back into it.
    logits32, labels = _ce_inputs(shape=(512,), V=64, seed=5)
    logits = (4.0 * logits32).astype(jnp.float16)
    scale = 2.0**12
    _, g = _vjp(lambda x: cross_entropy(x, labels, implementation=impl), logits, jnp.float16(scale))
    _, g32 = _vjp(lambda x: ref.cross_entropy(x, labels), logits.astype(jnp.float32), jnp.float32(scale))
    assert g.dtype == jnp.float16
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(g32.astype(jnp.float16), np.float32),
                               rtol=2e-3, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("reduction", ("mean", "sum", "none"))
def test_cross_entropy_all_ignored(impl, reduction):
    logits, _ = _ce_inputs(shape=(5,), V=20)
    labels = jnp.full((5,), -100)
    ct = jnp.ones(()) if reduction != "none" else jnp.ones((5,))
    out, g = _vjp(lambda x: cross_entropy(x, labels, reduction=reduction, label_smoothing=0.1, z_loss=1e-3, implementation=impl), logits, ct)
    np.testing.assert_array_equal(out, jnp.zeros_like(out))
    np.testing.assert_array_equal(g, jnp.zeros_like(g))


@pytest.mark.parametrize("impl", IMPLS)
def test_cross_entropy_neg_inf_logits(impl):
    logits, labels = _ce_inputs(shape=(6,), V=40)
    labels = labels.at[5].set(-100)
    masked = logits.at[:, 20:].set(-jnp.inf)  # masked vocabulary
    masked = masked.at[5].set(-jnp.inf)  # an ignored row that is entirely -inf
    labels = labels % 20
    labels = labels.at[5].set(-100)
    out, g = _vjp(lambda x: cross_entropy(x, labels, z_loss=1e-3, implementation=impl), masked, jnp.float32(1.0))
    out_r, g_r = _vjp(lambda x: ref.cross_entropy(x[:5, :20], labels[:5], z_loss=1e-3), logits, jnp.float32(1.0))
    assert bool(jnp.isfinite(out)) and bool(jnp.all(jnp.isfinite(g)))
    np.testing.assert_allclose(out, out_r, rtol=1e-5)
    np.testing.assert_allclose(g[:5, :20], g_r[:5, :20], rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(g[:, 20:], 0.0)
    np.testing.assert_array_equal(g[5], 0.0)


def test_cross_entropy_pallas_uses_both_kernels():
    logits, labels = _ce_inputs()
    with config.use(interpret=True):
        jaxpr = str(jax.make_jaxpr(jax.grad(lambda x: cross_entropy(x, labels, implementation="pallas")))(logits))
    assert "name=cross_entropy_fwd" in jaxpr and "name=cross_entropy_bwd" in jaxpr
    # The backward scales the forward's gradient in place; a loss that is not differentiated
    # runs the statistics kernel alone.
    assert "input_output_aliases=((0, 0),)" in jaxpr.split("name=cross_entropy_bwd")[0].rsplit("pallas_call", 1)[1]
    with config.use(interpret=False):
        primal = _lowered_kernels(lambda x: cross_entropy(x, labels, implementation="pallas"), logits)
    assert primal == ["cross_entropy_stats"], primal


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cross_entropy_bwd_kernel_skips_only_unit_rows(dtype):
    from jaxbwd.pallas import losses as ce_kernels

    d = _normal(0, (40, 9000), dtype)  # two column tiles; row blocks of one row
    g = jnp.where(jnp.arange(40) % 3 == 0, 1.0, jnp.linspace(-2.0, 2.0, 40)).astype(jnp.float32)
    out = ce_kernels.cross_entropy_bwd(d, g, interpret=True)
    want = (g[:, None] * d.astype(jnp.float32)).astype(dtype)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
    out16 = ce_kernels.cross_entropy_bwd(d.astype(jnp.float32), g, out_dtype=jnp.float16, interpret=True)
    np.testing.assert_allclose(np.asarray(out16, np.float32), np.asarray(want, np.float32), rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("impl", IMPLS)
def test_cross_entropy_residuals_are_the_size_of_the_logits(impl):
    logits, labels = _ce_inputs(shape=(8,), V=500)
    _, vjp = jax.vjp(lambda x: cross_entropy(x, labels, label_smoothing=0.1, z_loss=1e-3, implementation=impl), logits)
    leaves = [x for x in jax.tree_util.tree_leaves(vjp) if hasattr(x, "dtype")]
    saved = sum(x.size * x.dtype.itemsize for x in leaves)
    rows = 8
    # The unit-cotangent gradient in logits' dtype, kept instead of the logits (budget: the
    # logits plus 12 bytes per row).
    assert saved <= logits.nbytes + 12 * rows, saved
    _, vjp_ad = jax.vjp(lambda x: ref.cross_entropy(x, labels, label_smoothing=0.1, z_loss=1e-3), logits)
    saved_ad = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(vjp_ad) if hasattr(x, "dtype"))
    assert saved < saved_ad


def test_cross_entropy_lowers_for_cuda_at_llama3_vocab():
    def bwd(x, labels):
        out, vjp = jax.vjp(lambda v: cross_entropy(v, labels, label_smoothing=0.1, z_loss=1e-4, implementation="pallas"), x)
        return vjp(jnp.ones_like(out))

    names = _lowered_kernels(bwd, jax.ShapeDtypeStruct((8192, 128256), jnp.bfloat16), jax.ShapeDtypeStruct((8192,), jnp.int32))
    assert "cross_entropy_fwd" in names and "cross_entropy_bwd" in names


def _ce_truth_f64(logits, labels, eps=0.0):
    """Loss and dlogits of the mean cross-entropy in float64 (numpy), from f32 logits."""
    x = np.asarray(logits, np.float64)
    V = x.shape[-1]
    m = x.max(-1, keepdims=True)
    p = np.exp(x - m)
    p /= p.sum(-1, keepdims=True)
    target = (1 - eps) * np.eye(V)[np.asarray(labels)] + eps / V
    lse = m[..., 0] + np.log(np.exp(x - m).sum(-1))
    loss = lse - (target * x).sum(-1)
    return loss.mean(), (p - target) / x.shape[0]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("offset", [1e4, 1e6])
def test_cross_entropy_exact_at_large_logit_offsets(impl, offset):
    # Softmax is shift-invariant: the gradient at logits + 1e6 is the gradient at logits.
    logits, labels = _ce_inputs(shape=(6,), V=301)
    x = logits + offset
    with config.use(interpret=True):
        loss, g = jax.value_and_grad(lambda x: cross_entropy(x, labels, implementation=impl))(x)
    want_loss, want_g = _ce_truth_f64(x, labels)
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(g), want_g, atol=2e-7)
    # Each row of softmax - onehot sums to 0 up to f32 rounding of its V terms.
    assert np.max(np.abs(np.asarray(g, np.float64).sum(-1))) < 301 * 2**-24 / 6
    ref_g = jax.grad(lambda x: optax.softmax_cross_entropy_with_integer_labels(x, labels).mean())(x)
    np.testing.assert_allclose(np.asarray(g), np.asarray(ref_g), atol=2e-7)


@pytest.mark.parametrize("impl", IMPLS)
def test_cross_entropy_tied_huge_logits_split_evenly(impl):
    x = jnp.array([[1e8, 1e8], [-1e8, -1e8]], jnp.float32)
    labels = jnp.array([0, 1])
    with config.use(interpret=True):
        g = jax.grad(lambda x: cross_entropy(x, labels, reduction="sum", implementation=impl))(x)
    np.testing.assert_array_equal(np.asarray(g), [[-0.5, 0.5], [0.5, -0.5]])


@pytest.mark.parametrize("impl", IMPLS)
def test_cross_entropy_smoothing_near_f32_max_is_finite(impl):
    big = float(np.finfo(np.float32).max) / 2
    x = jnp.array([[big, big * 0.99, big * 0.98, 0.0]], jnp.float32)
    labels = jnp.array([0])
    with config.use(interpret=True):
        loss, g = jax.value_and_grad(lambda x: cross_entropy(x, labels, label_smoothing=0.1, implementation=impl))(x)
    want_loss, want_g = _ce_truth_f64(x, labels, eps=0.1)
    assert np.isfinite(float(loss)) and np.all(np.isfinite(np.asarray(g)))
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(g), want_g, atol=1e-6)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_rope_scale_factor_is_fractional_positions(impl):
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 2, 8))
    ct = jax.random.normal(jax.random.PRNGKey(1), x.shape)
    pos = jnp.array([0, 3, 8, 9, 40])
    a = _vjp(lambda v: rope(v, positions=pos, scale_factor=8.0, implementation=impl), x, ct)
    b = _vjp(lambda v: rope(v, positions=pos / 8.0, implementation=impl), x, ct)
    chex.assert_trees_all_close(a, b, atol=1e-6, rtol=1e-6)
    # Integer-valued float positions are the integer positions.
    chex.assert_trees_all_close(_vjp(lambda v: rope(v, positions=pos.astype(jnp.float32), implementation=impl), x, ct),
                                _vjp(lambda v: rope(v, positions=pos, implementation=impl), x, ct), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_rope_llama3_scaling(impl):
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 6, 2, 64))
    ct = jax.random.normal(jax.random.PRNGKey(1), x.shape)
    pos = jnp.array([0, 1, 5, 300, 2000, 9000])
    cfg = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
    f = lambda c: lambda v: rope(v, positions=pos, theta=500000.0, frequency_scaling=c, implementation=impl)
    out, g = _vjp(f(cfg), x, ct)
    chex.assert_trees_all_close((out, g), _vjp(lambda v: ref.rope(v, positions=pos, theta=500000.0,
                                                                  frequency_scaling=cfg), x, ct), atol=2e-5, rtol=2e-5)
    # factor 1 leaves every frequency as it is (up to f32 rounding of the blend, seen at
    # position 9000); factor 8 changes the low frequencies only.
    plain = _vjp(f(None), x, ct)
    chex.assert_trees_all_close(_vjp(f({**cfg, "factor": 1.0}), x, ct), plain, atol=1e-4, rtol=1e-4)
    inv = ref.rope_inv_freq(64, 500000.0)
    scaled = ref.llama3_inv_freq(inv, **cfg)
    np.testing.assert_allclose(scaled[:4], inv[:4])  # wavelength < 256 / 4: kept
    np.testing.assert_allclose(scaled[-4:], inv[-4:] / 8.0, rtol=1e-6)  # wavelength > 256: divided
    assert not np.allclose(out, plain[0])


# The worst inputs of an earlier version of sincos (errors up to 1.75e-7), found by checking
# every float32 below 2**36.
_SINCOS_HARD = [302715168.0, 150581392.0, 30156100.0, 28735698.0, 144819664.0, 151919456.0, 3557267.0]


@pytest.mark.parametrize("xp", [jnp, np], ids=["xla-fused-multiply-add", "numpy-separate-roundings"])
@pytest.mark.parametrize("lo, hi", [(0.0, 1.0), (1.0, 105615.0), (105615.0, 2.0**24), (2.0**24, 2.0**30),
                                    (2.0**30, 2.0**36)])
def test_kernel_sincos_against_float64(lo, hi, xp, atol=9.5e-8):
    """rope_bwd's cos/sin (``_common.sincos``, no libdevice) within the documented error of
    float64 over each range of angles, both signs, in XLA's rounding (fused multiply-adds,
    as interpret mode runs it) and in NumPy's (each operation rounded, as the compiled kernel
    runs it); sin**2 + cos**2 = 1."""
    x = np.random.default_rng(0).uniform(lo, hi, 200_000).astype(np.float32)
    x = np.concatenate([x, -x, np.float32([lo, -lo] + _SINCOS_HARD)])
    with np.errstate(invalid="ignore"):
        s, c = map(np.asarray, pallas_common.sincos(xp.asarray(x), xp=xp))
    assert s.dtype == c.dtype == np.float32
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(s, np.sin(x64), rtol=0, atol=atol)
    np.testing.assert_allclose(c, np.cos(x64), rtol=0, atol=atol)
    np.testing.assert_allclose(s.astype(np.float64) ** 2 + c.astype(np.float64) ** 2, 1.0, rtol=0, atol=1e-6)


@pytest.mark.parametrize("xp", [jnp, np], ids=["xla", "numpy"])
def test_kernel_sincos_special_values(xp):
    x = np.float32([0.0, -0.0, 2.0**36, -(2.0**40), np.inf, -np.inf, np.nan])
    with np.errstate(invalid="ignore"):
        s, c = map(np.asarray, pallas_common.sincos(xp.asarray(x), xp=xp))
    np.testing.assert_array_equal(s[:2], [0.0, -0.0])
    assert not np.signbit(s[0]) and np.signbit(s[1])  # sin(-0.0) = -0.0
    np.testing.assert_array_equal(c[:2], [1.0, 1.0])
    assert np.isnan(s[2:]).all() and np.isnan(c[2:]).all()  # documented: NaN from 2**36


@contextlib.contextmanager
def _as_interpret_mode():
    """Kernel helpers evaluated as in an interpret-mode kernel (jnp.exp2 and a division
    instead of the GPU's inline PTX)."""
    token = pallas_common._INTERPRETING.set(True)
    try:
        yield
    finally:
        pallas_common._INTERPRETING.reset(token)


@pytest.mark.parametrize("xp", [jnp, np], ids=["xla-fused-multiply-add", "numpy-separate-roundings"])
@pytest.mark.parametrize("scale", [1.0, 1.0 / 30.0, -0.125, 0.125 ** 0.5 / 4.0])
def test_kernel_tanh_with_grad_against_float64(scale, xp):
    """The logit softcaps' tanh and its derivative (``_common.tanh_with_grad``, no libdevice)
    within the documented error of float64: tanh to 1.4e-7 and the derivative to 1.6e-7
    absolute, and the derivative to 1e-5 relative up to |scale x| = 43, where ``1 - t * t``
    from a correctly rounded f32 tanh is off by more than its own value."""
    rng = np.random.default_rng(0)
    u = np.concatenate([rng.uniform(lo, hi, 100_000) for lo, hi in [(0, 1e-3), (1e-3, 1), (1, 9), (9, 43), (43, 99)]])
    x = (u / scale).astype(np.float32)
    x = np.concatenate([x, -x])
    with np.errstate(over="ignore"), _as_interpret_mode():
        t, dt = map(np.asarray, pallas_common.tanh_with_grad(xp.asarray(x), scale, xp=xp))
    assert t.dtype == dt.dtype == np.float32
    z = scale * x.astype(np.float64)
    want_dt = 1.0 / np.cosh(z) ** 2
    np.testing.assert_allclose(t, np.tanh(z), rtol=0, atol=1.4e-7)
    np.testing.assert_allclose(dt, want_dt, rtol=0, atol=1.6e-7)
    inside = np.abs(z) < 43
    np.testing.assert_allclose(dt[inside], want_dt[inside], rtol=1e-5, atol=0)
    assert np.max(np.abs((1 - np.tanh(x[inside] * np.float32(scale)) ** 2) / want_dt[inside] - 1)) > 1.0


@pytest.mark.parametrize("xp", [jnp, np], ids=["xla", "numpy"])
def test_kernel_tanh_with_grad_special_values(xp):
    x = np.float32([0.0, -0.0, 44.5, -1e30, np.inf, -np.inf, np.nan])
    with np.errstate(over="ignore", invalid="ignore"), _as_interpret_mode():
        t, dt = map(np.asarray, pallas_common.tanh_with_grad(xp.asarray(x), xp=xp))
    np.testing.assert_array_equal(t, [0.0, 0.0, 1.0, -1.0, 1.0, -1.0, np.nan])
    np.testing.assert_array_equal(dt, [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, np.nan])


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_backward_at_long_context_positions(interleaved):
    """The Pallas backward's own cos/sin against the XLA backward's at positions where
    libdevice's sin/cos switch to their slow reduction (angles past 105615) and beyond."""
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 6, 2, 16))
    ct = jax.random.normal(jax.random.PRNGKey(1), x.shape)
    pos = jnp.array([[0, 1, 105_614, 105_616, 1_000_003, 16_777_000],
                     [131_071, 524_287, 2_000_000, 9_999_999, 3, 7]])
    f = lambda impl: lambda v: rope(v, positions=pos, interleaved=interleaved, implementation=impl)  # noqa: E731
    _, g = _vjp(f("pallas"), x, ct)
    _, g_xla = _vjp(f("xla"), x, ct)
    np.testing.assert_allclose(np.asarray(g), np.asarray(g_xla), rtol=0, atol=2e-6)


# optax.softmax_cross_entropy_with_integer_labels's own cases, with jaxbwd.cross_entropy
# (reduction="none") in its place: scalar and batched rows, gradients, row and per-class
# masks, one class axis anywhere, several class axes in any order.
_OPTAX_LOGITS = np.array([[10.0, 1.0, -2.0], [1.0, 4.0, 0.2]], np.float32)
_OPTAX_LABELS = np.array([1, 0], np.int32)


def _ce(impl, **kw):
    import jaxbwd

    return lambda x, y: jaxbwd.cross_entropy(x, y, reduction="none", implementation=impl, **kw)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_optax_ce_scalar_and_batched(impl):
    for x, y in ((_OPTAX_LOGITS[0], _OPTAX_LABELS[0]), (_OPTAX_LOGITS, _OPTAX_LABELS)):
        want = optax.softmax_cross_entropy(x, jax.nn.one_hot(y, 3))
        np.testing.assert_allclose(jax.jit(_ce(impl))(jnp.asarray(x), jnp.asarray(y)), want, rtol=1e-6)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_optax_ce_gradients(impl):
    x, y = jnp.asarray(_OPTAX_LOGITS), jnp.asarray(_OPTAX_LABELS)
    if impl == "xla":  # numerical derivatives in f32 need the exact (XLA) path
        modes = ["fwd", "rev"] if FORWARD_MODE else ["rev"]  # forward mode from jax 0.12
        jax.test_util.check_grads(lambda x: _ce(impl)(x, y), (x,), order=1, modes=modes)
    g = jax.grad(lambda x: jnp.sum(_ce(impl)(x, y)))(x)
    gw = jax.grad(lambda x: jnp.sum(optax.softmax_cross_entropy_with_integer_labels(x, y)))(x)
    np.testing.assert_allclose(g, gw, rtol=1e-6, atol=1e-6)
    # A row mask: masked rows give 0 and finite (zero) gradients, as optax.
    row_mask = jnp.array([True, False])
    f = lambda x: jnp.sum(_ce(impl, where=row_mask)(x, y))
    fw = lambda x: jnp.sum(optax.softmax_cross_entropy_with_integer_labels(x, y, where=row_mask))
    np.testing.assert_allclose(f(x), fw(x), rtol=1e-6)
    gs = jax.grad(f)(x)
    assert bool(jnp.all(jnp.isfinite(gs)))
    np.testing.assert_allclose(gs, jax.grad(fw)(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_optax_ce_per_class_mask(impl):
    x, y = jnp.asarray(_OPTAX_LOGITS), jnp.array([0, 0])
    where = jnp.array([[1, 0, 1], [0, 0, 0]], bool)
    out = _ce(impl, where=where)(x, y)
    want = optax.softmax_cross_entropy_with_integer_labels(x, y, where=where)
    # Row 0's loss is a difference of O(10) terms, 6.144e-6 in float64: optax's f32 lse - x
    # lands at 5.72e-6 (4e-7 off), jaxbwd's (max - x) + log(sum) at 6.20e-6 (6e-8 off).
    np.testing.assert_allclose(out, want, atol=1e-6)
    np.testing.assert_allclose(float(out[0]), 6.144193477553017e-06, atol=1.2e-7)
    assert float(out[1]) == 0.0  # row 1 has no class left: 0


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("axis", [0, 1, 2])
def test_optax_ce_axis(axis, impl):
    shape = (4, 5, 6)
    x = jax.random.normal(jax.random.PRNGKey(axis), shape)
    y = jax.random.randint(jax.random.PRNGKey(9), shape[:axis] + shape[axis + 1:], 0, shape[axis])
    np.testing.assert_allclose(_ce(impl, axis=axis)(x, y),
                               optax.softmax_cross_entropy_with_integer_labels(x, y, axis=axis), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("axis", [(1, 3), (3, 2), (2, 3), (-3, -1), (-1, -2), (-2, -1), (0, 1, 3), (-4, -3, -1)])
def test_optax_ce_axes(axis, impl):
    shape = (2, 3, 4, 5)
    x = jax.random.uniform(jax.random.PRNGKey(42), shape)
    keep = tuple(i for i in range(4) if i not in {a % 4 for a in axis})
    n = int(np.prod([shape[a] for a in axis]))
    y = jax.random.randint(jax.random.PRNGKey(43), tuple(shape[i] for i in keep), 0, n)
    f = _ce(impl, axis=axis)
    fw = lambda x, y: optax.softmax_cross_entropy_with_integer_labels(x, y, axis)
    np.testing.assert_allclose(f(x, y), fw(x, y), rtol=1e-5, atol=1e-6)
    ct = jax.random.normal(jax.random.PRNGKey(44), y.shape)
    np.testing.assert_allclose(jax.vjp(lambda x: f(x, y), x)[1](ct)[0], jax.vjp(lambda x: fw(x, y), x)[1](ct)[0],
                               rtol=1e-5, atol=1e-6)


def test_ce_where_needs_no_smoothing():
    import jaxbwd

    with pytest.raises(ValueError, match="cross_entropy: where needs label_smoothing == 0"):
        jaxbwd.cross_entropy(jnp.ones((2, 3)), jnp.zeros((2,), jnp.int32), where=jnp.ones((2, 3), bool),
                             label_smoothing=0.1)


def test_cross_entropy_grad_kernel_programs_independent_and_in_bounds():
    # The vocabulary-parallel backward's kernel (a shard's gradient from the combined row
    # statistics) runs only under a mesh, which the contract's program check does not build;
    # here it runs alone on one shard's logits: labels outside the shard are -1, and the
    # statistics come from the whole vocabulary.
    from jaxbwd import testing
    from jaxbwd.pallas import losses as ce_kernels
    from jaxbwd.vjp import losses as ce_vjp

    V, shard = 96, slice(32, 80)  # a 48-class shard of a 96-class vocabulary
    full = _normal(0, (11, V)) * 3.0
    labels = jnp.array([3, 40, 79, 95, 32, -1, 50, 0, 60, 47, 80], jnp.int32)
    local = jnp.where((labels >= shard.start) & (labels < shard.stop), labels - shard.start, -1)
    m = jnp.max(full, axis=-1)
    s = jnp.sum(jnp.exp(full - m[:, None]), axis=-1)
    w = jnp.where(labels >= 0, 1.0 / 10, 0.0).astype(jnp.float32)
    x = full[:, shard]
    args = (x, local, m, s, w)
    kw = dict(label_smoothing=0.1, z_loss=1e-3, n_classes=V)
    with testing.small_tiles(), testing.record_program_writes() as reports:
        d = ce_kernels.cross_entropy_grad(*args, **kw, interpret=True)
    (r,) = reports
    assert r.kernel == "cross_entropy_grad" and min(r.grid) >= 2, r  # both grid axes split
    assert (r.multiply_written, r.unwritten, r.dependent) == (0, 0, 0), r
    for tiles in (testing.small_tiles, contextlib.nullcontext):
        checked = set()
        with tiles(), testing.record_out_of_bounds(checked) as outside:
            jax.block_until_ready(ce_kernels.cross_entropy_grad(*args, **kw, interpret=True))
        assert checked == {"cross_entropy_grad"} and not outside, outside
    chex.assert_trees_all_close(d, ce_vjp._xla_grad(x, local, m, s, w, 0.1, 1e-3, V), rtol=1e-5, atol=1e-7)
    # and the shard's gradient is that slice of the whole vocabulary's
    d_full = jax.grad(lambda l: ref.cross_entropy(l, labels, label_smoothing=0.1, z_loss=1e-3))(full)
    chex.assert_trees_all_close(d, d_full[:, shard], rtol=1e-5, atol=1e-6)


def test_cross_entropy_grad_kernel_lowers_for_gpu_at_a_vocab_shard():
    """The vocabulary-parallel kernel at a realistic shard (Llama 3's 128256 classes over 8
    devices, 8192 rows, bf16) lowers for CUDA; the registry's compile cases do not build a
    mesh, so this is its lowering check (its compiled figures:
    ``bench/results/2026-12-07-compile-cross-entropy-primal.md``)."""
    from jaxbwd.pallas import losses as ce_kernels

    R, V = 8192, 128256 // 8
    sds = jax.ShapeDtypeStruct
    args = (sds((R, V), jnp.bfloat16), sds((R,), jnp.int32), sds((R,), jnp.float32), sds((R,), jnp.float32),
            sds((R,), jnp.float32))
    grad = lambda *a: ce_kernels.cross_entropy_grad(*a, label_smoothing=0.1, z_loss=1e-4, n_classes=128256)  # noqa: E731
    assert _lowered_kernels(grad, *args) == ["cross_entropy_grad"]
