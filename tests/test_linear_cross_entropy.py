"""linear_cross_entropy against jaxbwd.matmul followed by jaxbwd.cross_entropy, option by
option, on both implementations; block and chunk tails; memory without [tokens, V] arrays.

The generated contract (tests/test_contract.py) covers the registry examples, transforms,
forward mode, second order, lowering at LLM shapes and the residual budget.
"""
from __future__ import annotations

import contextlib

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxbwd
from jaxbwd.pallas import _tuning
from jaxbwd.pallas import linear_cross_entropy as K
from jaxbwd.vjp import linear_cross_entropy as L
from jaxbwd.vjp._derivatives import FORWARD_MODE

R, D, V = 37, 40, 50  # token, feature and vocabulary counts that fill no block exactly


def _inputs(seed=0, R=R, D=D, V=V, scale=1.0, dtype=jnp.float32):
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    x = (scale * jax.random.normal(k[0], (R, D))).astype(dtype)
    w = (3.0 / D**0.5 * jax.random.normal(k[1], (D, V))).astype(dtype)
    labels = jax.random.randint(k[2], (R,), 0, V).at[3].set(-100).at[5].set(V).at[7].set(-2)
    weights = jax.random.uniform(k[3], (R,), jnp.float32, 0.0, 2.0)
    return x, w, labels, weights


def _unfused(x, w, labels, *, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, logit_softcap=None,
             weights=None, reduction="mean", return_aux=False, implementation=None):
    """jaxbwd.matmul -> softcap -> jaxbwd.cross_entropy, weights and reduction applied to its
    per-token losses as the op documents."""
    z = jaxbwd.matmul(x, w).astype(jnp.float32)
    if logit_softcap is not None:
        z = logit_softcap * jnp.tanh(z / logit_softcap)
    kw = dict(ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss, implementation=implementation)
    valid = (labels >= 0) & (labels < w.shape[1]) & (labels != ignore_index)
    lse = jax.nn.logsumexp(z, axis=-1)
    aux = {"lse": lse, "z_loss": jnp.where(valid, z_loss * lse**2, 0.0)}
    if weights is None and reduction != "none":
        out = jaxbwd.cross_entropy(z, labels, reduction=reduction, **kw)
    else:
        loss = jaxbwd.cross_entropy(z, labels, reduction="none", **kw)
        wts = jnp.ones_like(loss) if weights is None else weights
        loss = loss * wts
        if reduction == "none":
            out = loss
        else:
            den = jnp.sum(jnp.where(valid, wts, 0.0))
            out = jnp.sum(loss)
            if reduction == "mean":
                out = jnp.where(den == 0, 0.0, out / jnp.where(den == 0, 1.0, den))
    return (out, aux) if return_aux else out


def _scalar(fn, labels, kw):
    """A scalar of the loss (and aux) whose gradient reaches every output."""
    def f(x, w):
        out = fn(x, w, labels, **kw)
        loss, aux = out if kw.get("return_aux") else (out, None)
        total = jnp.sum(jnp.sin(jnp.arange(loss.size).reshape(loss.shape) + 1.0) * loss.astype(jnp.float32))
        if aux is not None:
            total = total + 0.3 * jnp.sum(jnp.cos(aux["lse"])) + 7.0 * jnp.sum(aux["z_loss"])
        return total
    return f


def _check(kw, impl, transpose_w=False, seed=0, tol=2e-5, **shape):
    x, w, labels, weights = _inputs(seed, **shape)
    kw = dict(kw)
    if kw.pop("use_weights", False):
        kw["weights"] = weights
    want_out = _unfused(x, w, labels, **kw)
    fused = lambda x, w, labels, **k: jaxbwd.linear_cross_entropy(  # noqa: E731
        x, w.T if transpose_w else w, labels, transpose_w=transpose_w, implementation=impl, **k)
    got_out = fused(x, w, labels, **kw)
    for g, e in zip(jax.tree_util.tree_leaves(got_out), jax.tree_util.tree_leaves(want_out)):
        assert g.shape == e.shape and g.dtype == e.dtype
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=tol, atol=tol)
    want = jax.grad(_scalar(_unfused, labels, kw), (0, 1))(x, w)
    got = jax.grad(_scalar(fused, labels, kw), (0, 1))(x, w)
    for g, e in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=tol, atol=tol * float(jnp.max(jnp.abs(e))))


OPTIONS = dict(label_smoothing=(0.0, 0.1), z_loss=(0.0, 1e-2), logit_softcap=(None, 4.0), use_weights=(False, True),
               reduction=("mean", "sum", "none"), return_aux=(False, True))


def _combos(keys):
    return [dict(zip(keys, vals)) for vals in itertools.product(*(OPTIONS[k] for k in keys))]


def _pairwise(keys):
    """Combinations of OPTIONS[k] for ``keys`` in which every pair of values of every two
    options occurs at least once (a greedy all-pairs covering array, deterministic): the
    interactions of two options at a tenth of the full product's cost."""
    full = _combos(keys)
    pairs = lambda c: {(a, repr(c[a]), b, repr(c[b])) for a, b in itertools.combinations(keys, 2)}  # noqa: E731
    todo, chosen = set().union(*(pairs(c) for c in full)), []
    while todo:
        best = max(full, key=lambda c: len(pairs(c) & todo))
        chosen.append(best)
        todo -= pairs(best)
    return chosen


def test_pairwise_covers_every_pair_of_option_values():
    keys = list(OPTIONS)
    chosen = _pairwise(keys)
    for a, b in itertools.combinations(keys, 2):
        seen = {(repr(c[a]), repr(c[b])) for c in chosen}
        assert seen == {(repr(u), repr(v)) for u in OPTIONS[a] for v in OPTIONS[b]}, (a, b)
    assert len(chosen) < len(_combos(keys)) // 4


def test_xla_option_combinations():
    """The XLA path against matmul + cross_entropy: every pair of option values together
    (``_pairwise``; the full product is 96 combinations)."""
    with L.chunk_size(16):  # 4 chunks, the last clamped onto the third
        for kw in _pairwise(list(OPTIONS)):
            _check(kw, "xla")


@pytest.mark.parametrize("transpose_w", (False, True), ids=("dense", "tied"))
@pytest.mark.parametrize("label_smoothing,logit_softcap", ((0.0, None), (0.1, None), (0.0, 4.0), (0.1, 4.0)))
def test_pallas_every_kernel_option(label_smoothing, logit_softcap, transpose_w):
    """The kernels see only smoothing, softcap and w's layout (z-loss, weights, the
    reduction and aux reach them as the cotangents of the loss and the lse): every
    combination of those, with z-loss, weights and aux on, multi-block in every dimension."""
    kw = dict(label_smoothing=label_smoothing, logit_softcap=logit_softcap, z_loss=1e-2, use_weights=True,
              return_aux=True, reduction="mean")
    with K.block_sizes(16, 16, 16):
        _check(kw, "pallas", transpose_w=transpose_w)


@pytest.mark.parametrize("impl", ("xla", "pallas"))
@pytest.mark.parametrize("reduction", ("sum", "none"))
def test_reductions_ignore_index_and_tied(impl, reduction):
    with K.block_sizes(16, 16, 16), L.chunk_size(16):
        _check(dict(reduction=reduction, ignore_index=4), impl, transpose_w=True)


def test_vocabulary_splits_are_combined():
    """The forward grid splits the vocabulary when token blocks are few; the splits' partials
    combine to the unsplit result."""
    d = K.Dims(R=5, D=16, V=300, n_classes=300, eps=0.1, softcap=None, transpose_w=False)
    cfg = K._blocks("linear_cross_entropy_fwd", d, jnp.float32)[4]
    assert K._num_splits(d, 16, 16, cfg) == 2  # 19 vocabulary blocks, at least 8 per split
    with K.block_sizes(16, 16, 16):
        _check(dict(label_smoothing=0.1, reduction="none"), "pallas", R=5, D=16, V=300)


@pytest.mark.parametrize("transpose_w", (False, True), ids=("dense", "tied"))
def test_dw_programs_walk_several_vocabulary_blocks(transpose_w):
    """The dw kernel's persistent grid: 2 programs over 5 vocabulary blocks (3 and 2 each),
    each reusing its f32 accumulator slab from block to block."""
    with K.block_sizes(16, 16, 16, dw_programs=2):
        _check(dict(label_smoothing=0.1, logit_softcap=4.0), "pallas", transpose_w=transpose_w, V=80)


@pytest.mark.parametrize("transpose_w", (False, True), ids=("dense", "tied"))
@pytest.mark.parametrize("dtype", (jnp.bfloat16, jnp.float16), ids=("bf16", "f16"))
def test_16bit_sums_across_many_blocks(dtype, transpose_w):
    """bf16 grads keep their running sums as bf16 pairs, f16 ones in f32 (``K.accumulation``):
    over 25 vocabulary blocks and 10 token blocks, all with ragged tails, through dw programs
    that reuse their slabs, the kernels' grads are within three bf16 ulps (of the larger of
    |value| and 1e-3 of the largest) of the XLA path's f32 sums of the same 16-bit dz, which
    the two paths round from slightly different exponentials. Measured: bf16 at most 0.97,
    f16 2.4; a plain bf16 running sum (the pair's lo dropped) is off by up to 187 (dx) and
    113 (dw). (With reduction="sum", dz stays above f16's subnormal range.)"""
    x, w, labels, _ = _inputs(4, R=157, D=40, V=395, dtype=dtype)
    wl = w.T if transpose_w else w

    def grads(impl):
        loss = lambda x, w: jaxbwd.linear_cross_entropy(  # noqa: E731
            x, w, labels, transpose_w=transpose_w, label_smoothing=0.1, reduction="sum", implementation=impl)
        return jax.grad(loss, (0, 1))(x, wl)

    with K.block_sizes(16, 16, 16, dw_programs=3), L.chunk_size(16):
        got, want = grads("pallas"), grads("xla")
    assert K.accumulation(dtype) == ("pair" if dtype == jnp.bfloat16 else "f32_temp")
    _assert_within_bf16_ulps(got, want, dtype, 3.0)


def _assert_within_bf16_ulps(got, want, dtype, n):
    """Every element within ``n`` bf16 ulps of the larger of |want| and 1e-3 of its largest."""
    for g, e in zip(got, want):
        assert g.dtype == dtype
        g, e = np.asarray(g, np.float64), np.asarray(e, np.float64)
        ulp = np.maximum(np.abs(e), 1e-3 * np.abs(e).max()) * float(jnp.finfo(jnp.bfloat16).eps)
        np.testing.assert_array_less(np.abs(g - e) / ulp, n)


@pytest.mark.parametrize("arch,precision", (("sm_90", None), ("sm_90", "highest"), ("sm_80", None), ("sm_80", "highest"),
                                            ("sm_100", None), ("sm_100", "highest")))
@pytest.mark.parametrize("transpose_w", (False, True), ids=("dense", "tied"))
def test_tuning_table_tiles(arch, precision, transpose_w, monkeypatch):
    """The tuning table's own tiles, no block override (f32: 64 x 64 x 32 on sm_90, 64 x 128
    x 64 on 8 warps on sm_80, 64 x 64 x 16 there under 3xTF32; sm_90's and sm_100's dw from
    64-wide D chunks in the dense layout, sm_90's with one stage): several token, vocabulary
    and D blocks in every kernel, with ragged tails. (At this V the forward has one split and each dw program one
    vocabulary block; several of each are tested under ``block_sizes`` above.)"""
    monkeypatch.setattr(_tuning, "arch", lambda: arch)
    with jax.default_matmul_precision(precision) if precision else contextlib.nullcontext():
        assert _tuning.linear_cross_entropy("linear_cross_entropy_bwd_dx", jnp.float32, transpose_w).block_k == (
            (16 if precision else 64) if arch == "sm_80" else 32)
        dw = _tuning.linear_cross_entropy("linear_cross_entropy_bwd_dw", jnp.float32, transpose_w)
        if arch == "sm_100" and not precision:
            assert dw.block_k == (32 if transpose_w else 64)
        if arch == "sm_90":
            assert (dw.block_k, dw.num_stages) == ((16 if precision else 32, 2) if transpose_w else (64, 1))
        _check(dict(label_smoothing=0.1, logit_softcap=4.0), "pallas", transpose_w=transpose_w,
               R=150, D=150, V=300)


@pytest.mark.parametrize("arch", ("sm_90", "sm_100"))
@pytest.mark.parametrize("transpose_w", (False, True), ids=("dense", "tied"))
def test_tuning_table_tiles_16bit(arch, transpose_w, monkeypatch):
    """The 16-bit tiles, no override: on sm_90 64 x 128 (dw 128 x 64) from 64-wide D chunks
    (32 in the table layout); sm_100's dx takes 32 in both and its dw one stage. Several
    blocks of each, within the bound of the many-block test."""
    monkeypatch.setattr(_tuning, "arch", lambda: arch)
    lce = lambda kernel: _tuning.linear_cross_entropy(kernel, jnp.bfloat16, transpose_w)  # noqa: E731
    assert lce("linear_cross_entropy_bwd_dx").block_k == (32 if transpose_w or arch == "sm_100" else 64)
    assert lce("linear_cross_entropy_bwd_dw").num_stages == (1 if arch == "sm_100" and not transpose_w else 2)
    x, w, labels, _ = _inputs(5, R=150, D=150, V=300, dtype=jnp.bfloat16)
    wl = w.T if transpose_w else w

    def grads(impl):
        loss = lambda x, w: jaxbwd.linear_cross_entropy(  # noqa: E731
            x, w, labels, transpose_w=transpose_w, reduction="sum", implementation=impl)
        return jax.grad(loss, (0, 1))(x, wl)

    with L.chunk_size(64):
        _assert_within_bf16_ulps(grads("pallas"), grads("xla"), jnp.bfloat16, 3.0)


@pytest.mark.parametrize("impl", ("xla", "pallas"))
def test_large_logits_stay_exact(impl):
    """Logits near 1e4: the loss keeps f32 precision (the large terms cancel before log(s))."""
    x, w, labels, _ = _inputs(1, R=8, D=16, V=24, scale=2000.0)
    want = jaxbwd.cross_entropy(jnp.matmul(x, w, precision="highest"), labels, reduction="none")
    got = jaxbwd.linear_cross_entropy(x, w, labels, reduction="none", implementation=impl)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=2e-2)
    g = jax.grad(lambda x: jnp.sum(jaxbwd.linear_cross_entropy(x, w, labels, implementation=impl)))(x)
    assert bool(jnp.all(jnp.isfinite(g)))


@pytest.mark.parametrize("impl", ("xla", "pallas"))
def test_everything_ignored_or_zero_weights_gives_zero(impl):
    x, w, labels, _ = _inputs(2, R=6, D=16, V=20)
    none = jnp.full_like(labels, -100)
    loss, g = jax.value_and_grad(lambda x: jaxbwd.linear_cross_entropy(x, w, none, implementation=impl))(x)
    assert float(loss) == 0.0 and not np.any(np.asarray(g))
    zero_w = jaxbwd.linear_cross_entropy(x, w, labels, weights=jnp.zeros((6,)), implementation=impl)
    assert float(zero_w) == 0.0
    # Weights of both signs summing to 0 over valid labels: the documented 0, not the numerator.
    wts, labels = jnp.array([1.0, -1.0, 2.0, -2.0, 0.5, -0.5]), jnp.arange(6) * 3
    mean, g = jax.value_and_grad(lambda x: jaxbwd.linear_cross_entropy(x, w, labels, weights=wts, implementation=impl))(x)
    assert float(jaxbwd.linear_cross_entropy(x, w, labels, weights=wts, reduction="sum", implementation=impl)) != 0.0
    assert float(mean) == 0.0 and not np.any(np.asarray(g))


def test_bfloat16_matches_float32_reference():
    x, w, labels, weights = _inputs(3, dtype=jnp.bfloat16)
    x32, w32 = x.astype(jnp.float32), w.astype(jnp.float32)
    kw = dict(label_smoothing=0.1, z_loss=1e-3, weights=weights)
    want = _unfused(x32, w32, labels, **kw)
    gw = jax.grad(_scalar(_unfused, labels, kw), (0, 1))(x32, w32)
    for impl in ("xla", "pallas"):
        fused = lambda x, w, labels, **k: jaxbwd.linear_cross_entropy(x, w, labels, implementation=impl, **k)  # noqa
        out = fused(x, w, labels, **kw)
        assert out.dtype == jnp.bfloat16
        np.testing.assert_allclose(float(out), float(want), rtol=2e-2)
        for g, e in zip(jax.grad(_scalar(fused, labels, kw), (0, 1))(x, w), gw):
            assert g.dtype == jnp.bfloat16
            np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(e), atol=2e-2 * float(jnp.max(jnp.abs(e))))


def _temp_bytes(fn, *args):
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_xla_path_holds_no_tokens_by_vocab_array():
    """Compiled temp memory of grad (and of jvp) on the XLA path stays far below one
    [tokens, V] f32 array: the vocabulary is walked in chunks of CHUNK_ELEMENTS logits."""
    T, Dm, Vb = 2048, 256, 32000
    x = jax.ShapeDtypeStruct((T, Dm), jnp.float32)
    w = jax.ShapeDtypeStruct((Dm, Vb), jnp.float32)
    labels = jnp.zeros((T,), jnp.int32)
    loss = lambda x, w: jaxbwd.linear_cross_entropy(x, w, labels, label_smoothing=0.1, z_loss=1e-4,  # noqa: E731
                                                    implementation="xla")
    full = T * Vb * 4
    grad_temp = _temp_bytes(jax.grad(loss, (0, 1)), x, w)
    # Forward mode exists on jax >= 0.12 only (ops are plain custom_vjp before).
    jvp_temp = _temp_bytes(lambda x, w: jax.jvp(loss, (x, w), (x, w)), x, w) if FORWARD_MODE else 0
    unfused_temp = _temp_bytes(jax.grad(lambda x, w: jaxbwd.cross_entropy(jaxbwd.matmul(x, w), labels,
                                                                          implementation="xla"), (0, 1)), x, w)
    budget = 8 * 4 * L.CHUNK_ELEMENTS + 4 * (T * Dm + Dm * Vb) * 4
    assert grad_temp <= budget and jvp_temp <= budget, (grad_temp, jvp_temp, budget)
    assert grad_temp < full / 2 < unfused_temp, (grad_temp, full, unfused_temp)
