"""Property tests: each op at shapes and options drawn by hypothesis, against its reference.

The contract (``tests/test_contract.py``) runs each op at a few hand-picked shapes; here
hypothesis draws the awkward ones (sizes of 1, primes, sizes just past a block, several
leading dims, ignored labels, repeated ids, GQA groups, causal with more keys than queries)
and checks the forward and a random-cotangent VJP of both implementations (the kernels in
interpret mode, their masked loads and stores bounds-checked: ``jaxbwd.testing.record_out_of_bounds``)
against the plain-jnp reference differentiated by JAX, at the contract's tolerances
(``jaxbwd.testing.TOL``). Plus the invariants a softmax-like gradient must keep:
each row of softmax's and cross_entropy's input gradient sums to 0.

Draws are derandomized (the same examples in every run, so CI is reproducible), few per op
(interpret mode traces each new shape afresh), and small.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import jaxbwd
from jaxbwd import reference as ref
from jaxbwd.testing import TOL, assert_close, record_out_of_bounds

SETTINGS = settings(max_examples=8, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
IMPLS = ["xla", "pallas"]
DTYPES = ["float32", "bfloat16"]

# Sizes that straddle the kernels' block edges (16, 32, 64, 128, 256) and small primes.
dims = st.sampled_from([1, 2, 3, 7, 13, 16, 17, 31, 33, 64, 65, 127, 129, 257])
lead_shapes = st.lists(st.sampled_from([1, 2, 3, 5]), min_size=0, max_size=2).map(tuple)


def _normal(seed, shape, dtype, scale=1.0):
    x = np.random.default_rng(seed).standard_normal(shape) * scale
    return jnp.asarray(x, jnp.float32).astype(dtype)


def _f32(t):
    return jax.tree_util.tree_map(lambda a: a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a, t)


def check_vjp(op, reference, diff, dtype, seed=0):
    """``op(*diff)`` (interpret mode for kernels) and its VJP for a random cotangent, against
    the reference on float32 copies; dtypes and shapes as the inputs'."""
    with jaxbwd.config.use(interpret=True), record_out_of_bounds() as outside:
        out, vjp = jax.vjp(op, *diff)
        ct = _normal(seed + 1, out.shape, out.dtype)
        grads = jax.block_until_ready(vjp(ct))
    assert not outside, outside  # no masked-in lane of a kernel outside its operand at these shapes
    want, vjp_ref = jax.vjp(reference, *_f32(diff))
    assert out.shape == want.shape and out.dtype == jnp.result_type(*diff), (out.shape, want.shape, out.dtype)
    for g, d in zip(grads, diff):
        assert g.shape == d.shape and g.dtype == d.dtype
    assert_close(out, want, TOL[dtype])
    assert_close(grads, vjp_ref(ct.astype(jnp.float32)), TOL[dtype])
    return out, grads


@pytest.mark.parametrize("impl", IMPLS)
@SETTINGS
@given(lead=lead_shapes, D=dims, dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16),
       eps=st.sampled_from([1e-6, 1e-5, 0.1]))
def test_rms_norm(impl, lead, D, dtype, seed, eps):
    x, w = _normal(seed, lead + (D,), dtype), _normal(seed + 2, (D,), dtype)
    check_vjp(lambda x, w: jaxbwd.rms_norm(x, w, eps=eps, implementation=impl),
              functools.partial(ref.rms_norm, eps=eps), (x, w), dtype, seed)


@pytest.mark.parametrize("impl", IMPLS)
@SETTINGS
@given(lead=lead_shapes, D=dims, dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16),
       offset=st.sampled_from([0.0, 3.0, 100.0]))
def test_layer_norm(impl, lead, D, dtype, seed, offset):
    x = (_normal(seed, lead + (D,), jnp.float32) + offset).astype(dtype)
    w, b = _normal(seed + 2, (D,), dtype), _normal(seed + 3, (D,), dtype)
    check_vjp(lambda x, w, b: jaxbwd.layer_norm(x, w, b, implementation=impl), ref.layer_norm, (x, w, b), dtype, seed)


@pytest.mark.parametrize("impl", IMPLS)
@SETTINGS
@given(data=st.data(), lead=lead_shapes, D=dims, dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16),
       masked=st.booleans())
def test_softmax(impl, data, lead, D, dtype, seed, masked):
    shape = lead + (D,)
    axis = data.draw(st.integers(-len(shape), len(shape) - 1), label="axis")
    where = jnp.asarray(np.random.default_rng(seed).random(shape) < 0.8) if masked else None
    x = _normal(seed, shape, dtype, scale=3.0)
    _, (dx,) = check_vjp(lambda x: jaxbwd.softmax(x, axis=axis, where=where, implementation=impl),
                         functools.partial(ref.softmax, axis=axis, where=where), (x,), dtype, seed)
    # dx = y * (dy - sum(dy * y)): each slice's entries sum to 0 (a rounding of |dx|'s scale).
    sums = jnp.sum(dx.astype(jnp.float32), axis=axis)
    assert float(jnp.max(jnp.abs(sums))) <= 8 * TOL[dtype] * max(1.0, float(jnp.max(jnp.abs(dx.astype(jnp.float32)))))


@pytest.mark.parametrize("impl", IMPLS)
@SETTINGS
@given(lead=lead_shapes, V=dims, dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16),
       smoothing=st.sampled_from([0.0, 0.1]), z_loss=st.sampled_from([0.0, 1e-3]),
       reduction=st.sampled_from(["mean", "sum", "none"]))
def test_cross_entropy(impl, lead, V, dtype, seed, smoothing, z_loss, reduction):
    rows = lead or (1,)
    logits = _normal(seed, rows + (V,), dtype, scale=4.0)
    # Labels in range, ignore_index and out of range (both ignored).
    labels = jnp.asarray(np.random.default_rng(seed + 5).integers(-1, V + 1, rows), jnp.int32)
    labels = jnp.where(labels == -1, -100, labels)
    kw = dict(label_smoothing=smoothing, z_loss=z_loss, reduction=reduction)
    _, (dx,) = check_vjp(lambda x: jaxbwd.cross_entropy(x, labels, implementation=impl, **kw),
                         lambda x: ref.cross_entropy(x, labels, **kw), (logits,), dtype, seed)
    if not z_loss:  # softmax - (1 - eps) onehot - eps / V: each row sums to 0
        sums = jnp.sum(dx.astype(jnp.float32), axis=-1)
        assert float(jnp.max(jnp.abs(sums))) <= 8 * TOL[dtype] * max(1.0, float(jnp.max(jnp.abs(dx.astype(jnp.float32)))))


@pytest.mark.parametrize("impl", IMPLS)
@SETTINGS
@given(lead=lead_shapes, D=dims, dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16),
       limit=st.sampled_from([None, 1.5]))
def test_swiglu(impl, lead, D, dtype, seed, limit):
    gate, up = _normal(seed, lead + (D,), dtype, 2.0), _normal(seed + 2, lead + (D,), dtype, 2.0)
    check_vjp(lambda g, u: jaxbwd.swiglu(g, u, limit=limit, implementation=impl),
              functools.partial(ref.swiglu, limit=limit), (gate, up), dtype, seed)


@pytest.mark.parametrize("impl", IMPLS)
@SETTINGS
@given(lead=lead_shapes, D=dims, dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16),
       op=st.sampled_from(["silu", "gelu", "gelu_erf"]))
def test_activations(impl, lead, D, dtype, seed, op):
    x = _normal(seed, lead + (D,), dtype, 3.0)
    if op == "silu":
        f, r = jaxbwd.silu, ref.silu
    else:
        approximate = op == "gelu"
        f = functools.partial(jaxbwd.gelu, approximate=approximate)
        r = functools.partial(ref.gelu, approximate=approximate)
    check_vjp(lambda x: f(x, implementation=impl), r, (x,), dtype, seed)


@pytest.mark.parametrize("impl", IMPLS)
@SETTINGS
@given(lead=lead_shapes, C=dims, dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_bias_add(impl, lead, C, dtype, seed):
    x, b = _normal(seed, lead + (C,), dtype), _normal(seed + 2, (C,), dtype)
    check_vjp(lambda x, b: jaxbwd.bias_add(x, b, implementation=impl), ref.bias_add, (x, b), dtype, seed)


@pytest.mark.parametrize("impl", IMPLS)
@SETTINGS
@given(V=dims, D=dims, n=st.sampled_from([1, 5, 64, 70, 200]), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**16), padding=st.booleans())
def test_embed(impl, V, D, n, dtype, seed, padding):
    # Few distinct ids (hot rows summed in chunks), the table's edges and out-of-range ids.
    rng = np.random.default_rng(seed)
    ids = jnp.asarray(rng.choice(np.array([0, V - 1, V // 2, -1, V, V + 3]), size=n), jnp.int32)
    table = _normal(seed + 2, (V, D), dtype)
    pad = V // 2 if padding else None
    check_vjp(lambda t: jaxbwd.embed(ids, t, padding_idx=pad, implementation=impl),
              lambda t: ref.embed(ids, t, padding_idx=pad), (table,), dtype, seed)


@pytest.mark.parametrize("impl", IMPLS)
@SETTINGS
@given(B=st.sampled_from([1, 2]), T=dims, N=st.sampled_from([1, 3]), H=st.sampled_from([2, 8, 34, 64]),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16), interleaved=st.booleans(),
       start=st.sampled_from([0, 7, 40000]))
def test_rope(impl, B, T, N, H, dtype, seed, interleaved, start):
    x = _normal(seed, (B, T, N, H), dtype)
    kw = dict(start_pos=start, interleaved=interleaved)
    check_vjp(lambda x: jaxbwd.rope(x, implementation=impl, **kw), functools.partial(ref.rope, **kw), (x,), dtype, seed)


@pytest.mark.parametrize("impl", IMPLS)
@SETTINGS
@given(B=st.sampled_from([1, 2]), T=st.sampled_from([1, 5, 16, 17, 33]), extra=st.sampled_from([0, 1, 16]),
       K=st.sampled_from([1, 2]), G=st.sampled_from([1, 3]), H=st.sampled_from([8, 16, 40, 64]),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16), causal=st.booleans(),
       window=st.sampled_from([None, 1, 4]), softcap=st.sampled_from([None, 5.0]))
def test_dot_product_attention(impl, B, T, extra, K, G, H, dtype, seed, causal, window, softcap):
    S = T + extra  # causal: every query sees a key (top-left aligned, as the reference)
    q = _normal(seed, (B, T, K * G, H), dtype)
    k, v = _normal(seed + 2, (B, S, K, H), dtype), _normal(seed + 3, (B, S, K, H), dtype)
    kw = dict(is_causal=causal, logit_softcap=softcap)
    op_kw = dict(kw, local_window_size=None if window is None else (window - 1, window - 1 if not causal else 0))
    check_vjp(lambda q, k, v: jaxbwd.dot_product_attention(q, k, v, implementation=impl, **op_kw),
              functools.partial(ref.dot_product_attention, sliding_window=window, **kw), (q, k, v), dtype, seed)


@pytest.mark.parametrize("impl", IMPLS)
@SETTINGS
@given(N=st.sampled_from([1, 2]), HW=st.sampled_from([(1, 1), (3, 5), (8, 8), (9, 17)]),
       groups_and_size=st.sampled_from([(1, 1), (2, 3), (4, 8), (8, 1), (3, 11)]), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**16), silu=st.booleans())
def test_group_norm(impl, N, HW, groups_and_size, dtype, seed, silu):
    G, per = groups_and_size
    C = G * per
    x = _normal(seed, (N,) + HW + (C,), dtype)
    w, b = _normal(seed + 2, (C,), dtype), _normal(seed + 3, (C,), dtype)
    kw = dict(num_groups=G, activation="silu" if silu else None)
    check_vjp(lambda x, w, b: jaxbwd.group_norm(x, w, b, implementation=impl, **kw),
              functools.partial(ref.group_norm, **kw), (x, w, b), dtype, seed)
