"""dot_product_attention beyond the registry contract: masks, GQA, tails, transforms,
lowering at realistic shapes, residual size, bad inputs.

Kernels run in interpret mode (tests/conftest.py); ``block_sizes(8, 8)`` makes the small
shapes span several blocks with ragged tails.
"""
from __future__ import annotations

import contextlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxbwd import config, reference as ref, testing
from jaxbwd.pallas import _common as C
from jaxbwd.pallas import _tuning
from jaxbwd.pallas import attention as PA
from jaxbwd.vjp._derivatives import FORWARD_MODE
from jaxbwd.vjp.attention import dot_product_attention

TOL = {"float32": 1e-5, "bfloat16": 2e-2}
KERNELS = ("attention_fwd", "attention_bwd_dkdv", "attention_bwd_dq")


def _inputs(B, T, S, N, K, H, dtype="float32", seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    mk = lambda k, s: jax.random.normal(k, s, jnp.float32).astype(dtype)
    return mk(ks[0], (B, T, N, H)), mk(ks[1], (B, S, K, H)), mk(ks[2], (B, S, K, H)), mk(ks[3], (B, T, N, H))


def _close(actual, expected, tol):
    scale = max(1.0, max(float(jnp.max(jnp.abs(e))) for e in jax.tree_util.tree_leaves(expected)))
    chex.assert_trees_all_close(
        jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), actual), expected, atol=tol * scale, rtol=tol
    )


def _check(impl, B, T, S, N, K, H, dtype="float32", blocks=(8, 8), **kw):
    q, k, v, ct = _inputs(B, T, S, N, K, H, dtype)
    f = lambda q, k, v: dot_product_attention(q, k, v, implementation=impl, **kw)

    def fwd_bwd(q, k, v, ct):
        out, vjp = jax.vjp(f, q, k, v)
        return out, vjp(ct)

    with PA.block_sizes(*blocks) if blocks else contextlib.nullcontext():
        out, grads = jax.jit(fwd_bwd)(q, k, v, ct)
        if impl == "pallas":
            jaxpr = str(jax.make_jaxpr(fwd_bwd)(q, k, v, ct))
            for name in KERNELS:
                assert f"name={name}" in jaxpr
    f32 = lambda x: x.astype(jnp.float32)

    @jax.jit
    def truth(q, k, v, ct):
        want, vjp_ref = jax.vjp(lambda q, k, v: ref.dot_product_attention(q, k, v, **kw), q, k, v)
        return want, vjp_ref(ct)

    want, want_grads = truth(f32(q), f32(k), f32(v), f32(ct))
    assert out.dtype == q.dtype and out.shape == q.shape
    for g, x in zip(grads, (q, k, v)):
        assert g.dtype == x.dtype and g.shape == x.shape
        assert bool(jnp.all(jnp.isfinite(f32(g))))
    _close(out, want, TOL[dtype])
    _close(grads, want_grads, TOL[dtype])
    return out, grads


SEG3 = jnp.array([[0] * 5 + [1] * 4 + [2] * 3, [0] * 2 + [1] * 8 + [2] * 2], jnp.int32)

CASES = {
    "causal": dict(B=1, T=12, S=12, N=4, K=2, H=16, is_causal=True),
    "gqa8:1-causal": dict(B=1, T=12, S=12, N=8, K=1, H=16, is_causal=True),
    "mha-H20-pad": dict(B=2, T=12, S=12, N=2, K=2, H=20, is_causal=True),
    "T8-S24": dict(B=1, T=8, S=24, N=4, K=2, H=16),
    "T13-S29": dict(B=2, T=13, S=29, N=4, K=2, H=32),
    "T13-S29-causal": dict(B=1, T=13, S=29, N=4, K=2, H=16, is_causal=True),
    "segments3-causal": dict(B=2, T=12, S=12, N=4, K=2, H=16, is_causal=True, segment_ids=SEG3),
    "segments-unsorted": dict(B=1, T=12, S=12, N=4, K=2, H=16,
                              segment_ids=jnp.array([[2, 0, 0, 1, 1, 2, 0, 0, 2, 2, 1, 0]], jnp.int32)),
    "window4-causal": dict(B=1, T=12, S=12, N=4, K=2, H=16, is_causal=True, sliding_window=4),
    "window4": dict(B=1, T=12, S=12, N=4, K=2, H=16, sliding_window=4),
    "softcap30": dict(B=1, T=12, S=12, N=4, K=2, H=16, is_causal=True, logit_softcap=30.0),
    "softcap2-all": dict(B=2, T=12, S=12, N=4, K=2, H=16, is_causal=True, logit_softcap=2.0,
                         sliding_window=5, segment_ids=SEG3),
}


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("case", list(CASES))
def test_grads_match_reference(case, impl):
    _check(impl, **CASES[case])


@pytest.mark.parametrize("case", ["causal", "gqa8:1-causal", "T13-S29", "segments-unsorted", "window4", "softcap2-all"])
def test_dkdv_keys_first(case, monkeypatch):
    # dk/dv computing the transposed tiles S^T = K Q^T (the table's keys_first, chosen per
    # architecture and head dim): masks, segment ids, GQA groups and tails on the transpose.
    seen = []
    kernel = PA._dkdv_kernel
    monkeypatch.setattr(PA, "_dkdv_kernel", lambda *refs, **kw: (seen.append(kw["keys_first"]), kernel(*refs, **kw))[1])
    with _tuning.use({_tuning.arch(): {"attention_bwd_dkdv": {"keys_first": True}}}):
        _check("pallas", **CASES[case])
    assert seen and all(seen)


@pytest.mark.parametrize("split,H,keys_first,dtype", [(2, 64, False, "float32"), (2, 48, True, "float32"),
                                                     (4, 64, True, "float32"), (4, 40, False, "bfloat16")])
def test_head_split_between_programs(split, H, keys_first, dtype):
    # The head dim split into column parts on the grid's last axis (the table's head_split,
    # f32 forward and dq at head_dim 256 on sm_90/sm_100, the tangent pass on sm_100), each
    # part recomputing S (and dS) from all parts: GQA, causal + window + softcap with tails,
    # segment ids; H = 48 leaves the second part's last columns as padding, H = 40 in four
    # parts all of the last part (a program that stores nothing). Each program writes its own
    # columns only (one part the lse), and no load or store leaves its operand.
    parts = {"head_split": split}
    over = {_tuning.arch(): {"attention_fwd": parts, "attention_bwd_dq": parts, "attention_jvp": parts,
                             "attention_bwd_dkdv": {**parts, "keys_first": keys_first}}}
    kw = dict(is_causal=True, sliding_window=20, logit_softcap=30.0)
    with _tuning.use(over):
        _check("pallas", 2, 37, 29, 4, 2, H, dtype=dtype, blocks=(8, 8), **kw)
        _check("pallas", 2, 12, 12, 4, 2, H, dtype=dtype, blocks=(8, 8), is_causal=True, segment_ids=SEG3)
        q, k, v, ct = _inputs(1, 20, 20, 2, 1, H, dtype)
        f = lambda q, k, v: dot_product_attention(q, k, v, implementation="pallas", **kw)
        checked = set()
        with PA.block_sizes(8, 8):  # one launch hook at a time: two runs
            with testing.record_program_writes() as writes:
                jax.block_until_ready(jax.vjp(f, q, k, v)[1](ct))
            with testing.record_out_of_bounds(checked) as oob:
                jax.block_until_ready(jax.vjp(f, q, k, v)[1](ct))
    assert not oob and checked == set(KERNELS), (oob, checked)
    assert {w.kernel: w.grid[2:] for w in writes} == {k: (split,) for k in KERNELS}
    races = [w for w in writes if w.racy]
    assert not races, races
    if not FORWARD_MODE:
        return  # jax < 0.12: no tangent pass
    tangents = _inputs(1, 20, 20, 2, 1, H, dtype, seed=1)[:3]
    jvp = lambda *a: jax.jvp(f, a[:3], a[3:])
    f32 = lambda x: x.astype(jnp.float32)
    g = lambda q, k, v: ref.dot_product_attention(q, k, v, **kw)
    _, want = jax.jvp(g, tuple(map(f32, (q, k, v))), tuple(map(f32, tangents)))
    checked = set()
    with _tuning.use(over), PA.block_sizes(8, 8):
        _close(jax.jit(jvp)(q, k, v, *tangents)[1], want, TOL[dtype])
        with testing.record_program_writes() as writes:
            jax.block_until_ready(jvp(q, k, v, *tangents))
        with testing.record_out_of_bounds(checked) as oob:
            jax.block_until_ready(jvp(q, k, v, *tangents))
    assert not oob and checked == {"attention_fwd", "attention_jvp"}, (oob, checked)
    assert {w.kernel: w.grid[2:] for w in writes} == {"attention_fwd": (split,), "attention_jvp": (split,)}
    races = [w for w in writes if w.racy]
    assert not races, races


@pytest.mark.parametrize("kernel", KERNELS + ("attention_jvp",))
def test_head_split_must_leave_parts_of_16_columns(kernel):
    over = {_tuning.arch(): {kernel: {"head_split": 8}}}
    q = jnp.zeros((1, 16, 2, 64), jnp.float32)
    f = lambda q: dot_product_attention(q, q, q, implementation="pallas").sum()
    if kernel == "attention_jvp" and not FORWARD_MODE:
        pytest.skip("jax < 0.12: no forward mode, no tangent pass")
    run = (lambda: jax.jvp(f, (q,), (q,))) if kernel == "attention_jvp" else (lambda: jax.grad(f)(q))
    with _tuning.use(over), pytest.raises(ValueError, match=f"^{kernel}: head_split 8 must divide the padded "
                                          "head dim 64 into parts of at least 16 columns"):
        run()


def test_segment_block_bounds_skip_other_documents():
    seg = jnp.array([[0] * 8 + [1] * 8 + [2] * 4], jnp.int32)  # 20 tokens, blocks of 8
    bounds = PA.segment_block_bounds(seg, seg, 8, 8)
    np.testing.assert_array_equal(np.asarray(bounds), [[0, 1], [1, 2], [2, 3]])
    # ids 0..1 in the query block reach key blocks 0..2 when a key of id 1 sits in block 2.
    kseg = jnp.array([[0] * 8 + [2] * 8 + [1] * 4], jnp.int32)
    np.testing.assert_array_equal(np.asarray(PA.segment_block_bounds(seg, kseg, 8, 8))[:2], [[0, 1], [2, 3]])


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_default_blocks_single_tile(impl):
    # The default (non-overridden) blocks: one ragged tile per program.
    q, k, v, ct = _inputs(1, 13, 29, 4, 2, 16)
    f = lambda q, k, v: dot_product_attention(q, k, v, is_causal=True, implementation=impl)
    out, vjp = jax.vjp(f, q, k, v)
    want, vjp_ref = jax.vjp(lambda q, k, v: ref.dot_product_attention(q, k, v, is_causal=True), q, k, v)
    _close(out, want, 1e-5)
    _close(vjp(ct), vjp_ref(ct), 1e-5)


def test_default_blocks_multi_tile_bf16_head_dim_96():
    # Head dims over 64 with 16-bit inputs: dq runs 128 x 64 tiles (one warpgroup per 64
    # query rows on Hopper), dk/dv 64 x 64; 200 queries and 150 keys give several blocks
    # and ragged tails in every kernel, causal bounds included. f32 dq: 128 x 32.
    d = PA.Dims(1, 200, 150, 2, 1, 96, 96**-0.5, True, None, None, False)
    assert PA._blocks(d, "dq", jnp.bfloat16)[:2] == (128, 64)
    assert PA._blocks(d, "dq", jnp.float32)[:2] == (128, 32)
    _check("pallas", 1, 200, 150, 2, 1, 96, dtype="bfloat16", blocks=None, is_causal=True)


@pytest.mark.skipif(not FORWARD_MODE, reason="forward mode needs jax >= 0.12")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_jvp_kernel_default_blocks_multi_tile(dtype):
    # The tangent kernel's own tiling (the table's jvp tiles are smaller than the
    # forward's: seven operands share shared memory), over several query and key blocks
    # with ragged tails, causal, GQA.
    d = PA.Dims(1, 200, 150, 4, 2, 96, 96**-0.5, True, None, None, False)
    bm, bk = PA._blocks(d, "jvp", jnp.dtype(dtype))[:2]
    assert 200 % bm and 150 % bk and bm < 200 and bk < 150, (bm, bk)
    q, k, v, dq = _inputs(1, 200, 150, 4, 2, 96, dtype)
    _, dk, dv, _ = _inputs(1, 200, 150, 4, 2, 96, dtype, seed=1)
    f = lambda q, k, v: dot_product_attention(q, k, v, is_causal=True, implementation="pallas")
    jvp = lambda *a: jax.jvp(f, a[:3], a[3:])
    out, tangent = jax.jit(jvp)(q, k, v, dq, dk, dv)
    with config.use(interpret=False):
        assert "attention_jvp" in C.triton_kernel_names(C.lower_for_gpu(jvp, q, k, v, dq, dk, dv))
    f32 = lambda x: x.astype(jnp.float32)
    g = lambda q, k, v: ref.dot_product_attention(q, k, v, is_causal=True)
    want, want_t = jax.jvp(g, tuple(map(f32, (q, k, v))), tuple(map(f32, (dq, dk, dv))))
    assert tangent.dtype == q.dtype
    _close(out, want, TOL[dtype])
    _close(tangent, want_t, TOL[dtype])


@pytest.mark.skipif(not FORWARD_MODE, reason="forward mode needs jax >= 0.12")
def test_grad_through_a_jvp_runs_the_backward_kernels():
    # MeanFlow / consistency-model training: u, du = jvp(model, ...), loss on u with du under
    # stop_gradient, grad over the parameters. That grad reaches the op through its jvp's
    # primal side; it must run the backward kernels on the residuals (no T x S array), and
    # grad with respect to the jvp's input tangent the same (the tangent map's transpose).
    T = 40
    q, k, v, t = _inputs(1, T, T, 2, 1, 16)
    f = lambda q, k, v: dot_product_attention(q, k, v, is_causal=True, implementation="pallas")
    g = lambda q, k, v: ref.dot_product_attention(q, k, v, is_causal=True)

    def meanflow(fn):
        def loss(q, k, v):
            u, du = jax.jvp(lambda q: fn(q, k, v), (q,), (t,))
            return jnp.sum(jnp.sin(u) * jax.lax.stop_gradient(du))
        return loss

    def tangent_loss(fn):
        return lambda t: jnp.sum(jax.jvp(lambda q: fn(q, k, v), (q,), (t,))[1] ** 2)

    for loss, args in [(meanflow, (q, k, v)), (tangent_loss, (t,))]:
        argnums = tuple(range(len(args)))
        jaxpr = str(jax.make_jaxpr(jax.grad(loss(f), argnums))(*args))
        assert "attention_bwd_dq" in jaxpr and "attention_bwd_dkdv" in jaxpr
        assert f"{T},{T}]" not in jaxpr  # no [.., T, S] probabilities
        _close(jax.jit(jax.grad(loss(f), argnums))(*args), jax.grad(loss(g), argnums)(*args), 1e-5)


@pytest.mark.parametrize("H,blocks", [(64, (32, 16)), (80, (16, 32)), (96, (32, 16)), (128, (16, 32)),
                                      (192, (32, 16)), (256, (16, 16))])
def test_head_dims_multi_block_unmasked_and_diagonal(H, blocks):
    # Every head dim of the configs, causal, with unequal block sizes: the forward and dq
    # loops run unmasked blocks left of the diagonal and masked diagonal and tail blocks
    # (T = S = 70 leaves ragged tails); bf16 takes the split loops in dq as well.
    _check("pallas", 1, 70, 70, 2, 1, H, dtype="bfloat16", blocks=blocks, is_causal=True)


@pytest.mark.parametrize("H,dtype,arch,precision", [
    (256, "bfloat16", "sm_90", None), (256, "float32", "sm_90", None), (80, "float32", "sm_90", None),
    (64, "float32", "sm_90", None), (80, "float32", "sm_80", None), (64, "float32", "sm_80", None),
    (64, "bfloat16", "sm_80", None),
    (256, "float32", "sm_80", None), (128, "float32", "sm_90", "highest"), (256, "float32", "sm_80", "highest"),
    (64, "float32", "sm_80", "highest"), (64, "float32", "sm_90", "highest"), (80, "float32", "sm_100", None),
    (256, "bfloat16", "sm_100", None), (256, "float32", "sm_100", None),
    (80, "float32", "sm_100", "highest"), (64, "float32", "sm_100", "highest")])
def test_tuning_tables_own_tiles(H, dtype, arch, precision, monkeypatch):
    # The table's own tiles for one architecture (interpret mode: no block override), which
    # differ per kernel and between the two sides of dk/dv (e.g. 16 query x 64 key rows in
    # f32, 128 x 32 in the f32 forward and dq; S^T = K Q^T in f32 dk/dv at head dims 64
    # and 256 on sm_90, and 256 on sm_80, and in 16-bit dk/dv at 256 on sm_100; the head dim
    # split between programs in f32 at 256, in two (forward, dq) and, on sm_100, in four (the
    # tangent pass); under "highest", the 3xTF32 tiles): a window and softcap over several
    # blocks with ragged tails, forward, grads and jvp.
    monkeypatch.setattr(_tuning, "arch", lambda: arch)
    with jax.default_matmul_precision(precision) if precision else contextlib.nullcontext():
        _check_window_softcap_tangent(H, dtype)


def _check_window_softcap_tangent(H, dtype):
    kw = dict(is_causal=True, sliding_window=96, logit_softcap=30.0)
    _check("pallas", 1, 200, 200, 2, 1, H, dtype=dtype, blocks=None, **kw)
    if not FORWARD_MODE:
        return  # jax < 0.12: reverse mode only
    q, k, v, dq = _inputs(1, 200, 200, 2, 1, H, dtype)
    _, dk, dv, _ = _inputs(1, 200, 200, 2, 1, H, dtype, seed=1)
    f = lambda q, k, v: dot_product_attention(q, k, v, implementation="pallas", **kw)
    _, tangent = jax.jit(lambda *a: jax.jvp(f, a[:3], a[3:]))(q, k, v, dq, dk, dv)
    f32 = lambda x: x.astype(jnp.float32)
    g = lambda q, k, v: ref.dot_product_attention(q, k, v, **kw)
    _, want_t = jax.jvp(g, tuple(map(f32, (q, k, v))), tuple(map(f32, (dq, dk, dv))))
    _close(tangent, want_t, TOL[dtype])


def test_3xtf32_takes_its_own_tiles(monkeypatch):
    # Under "highest" the f32 kernels take the table's "/x3" entries where it has them, else
    # the f32 tiles capped at 64 x 32 (block sizes given to the "/x3" key by an override are
    # taken as they are); 16-bit inputs are not affected.
    monkeypatch.setattr(_tuning, "arch", lambda: "sm_90")
    att = lambda kind, H, dtype: _tuning.attention(kind, H, dtype, 4096, 4096)
    tiles = lambda c: (c.block_m, c.block_n, c.num_warps, c.num_stages, c.keys_first)
    with jax.default_matmul_precision("highest"):
        assert tiles(att("attention_fwd", 256, jnp.float32)) == (16, 32, 8, 1, False)
        assert tiles(att("attention_bwd_dkdv", 256, jnp.float32)) == (16, 16, 8, 1, False)
        assert tiles(att("attention_bwd_dq", 64, jnp.float32))[:2] == (64, 32)  # 128 x 32, capped
        with _tuning.use({"sm_90": {"attention_bwd_dq/h64/f32/x3": {"num_stages": 2}}}):
            assert tiles(att("attention_bwd_dq", 64, jnp.float32))[:4] == (64, 32, 8, 2)
        with _tuning.use({"sm_90": {"attention_bwd_dq/h64/f32/x3": {"block_m": 128}}}):
            assert tiles(att("attention_bwd_dq", 64, jnp.float32))[:2] == (128, 32)
        bf16 = tiles(att("attention_fwd", 128, jnp.bfloat16))
    assert bf16 == tiles(att("attention_fwd", 128, jnp.bfloat16))
    assert tiles(att("attention_bwd_dkdv", 256, jnp.float32)) == (32, 32, 8, 1, True)


def test_sm100_takes_its_own_tiles(monkeypatch):
    # sm_100 (B200) has entries of its own where sm_90's compiled worse for it, and sm_90's
    # elsewhere; its "/x3" entries, and the pinned 3xTF32 dk/dv tile its changed f32 entry
    # would otherwise cap into a new one.
    att = lambda kind, H, dtype: _tuning.attention(kind, H, dtype, 4096, 4096)
    tiles = lambda c: (c.block_m, c.block_n, c.num_warps, c.num_stages, c.keys_first)
    monkeypatch.setattr(_tuning, "arch", lambda: "sm_90")
    sm90_fwd = tiles(att("attention_fwd", 128, jnp.bfloat16))
    monkeypatch.setattr(_tuning, "arch", lambda: "sm_100")
    assert tiles(att("attention_fwd", 128, jnp.bfloat16)) == sm90_fwd
    assert tiles(att("attention_bwd_dkdv", 128, jnp.float32)) == (64, 64, 8, 1, False)
    assert tiles(att("attention_bwd_dkdv", 128, jnp.bfloat16)) == (64, 64, 4, 1, False)
    assert tiles(att("attention_bwd_dkdv", 256, jnp.bfloat16)) == (64, 64, 8, 1, True)
    assert tiles(att("attention_bwd_dq", 128, jnp.float32)) == (128, 32, 8, 2, False)
    assert tiles(att("attention_jvp", 256, jnp.bfloat16)) == (64, 32, 8, 2, False)
    with jax.default_matmul_precision("highest"):
        assert tiles(att("attention_fwd", 128, jnp.float32)) == (64, 32, 8, 1, False)
        assert tiles(att("attention_bwd_dkdv", 128, jnp.float32)) == (16, 32, 8, 1, False)
        assert tiles(att("attention_bwd_dkdv", 64, jnp.float32)) == (32, 64, 8, 1, True)
        assert tiles(att("attention_jvp", 64, jnp.float32)) == (64, 16, 8, 1, False)


def test_non_causal_key_tail_is_masked_only_in_the_last_block():
    # S = 37 over 16-key blocks: two unmasked blocks and one tail block per query block.
    _check("pallas", 2, 20, 37, 2, 2, 32, dtype="bfloat16", blocks=(16, 16))


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("case", ["T13-S29-causal", "softcap2-all"])
def test_bf16(case, impl):
    _check(impl, dtype="bfloat16", **CASES[case])


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_fully_masked_rows_give_zero_output_and_grads(impl):
    # Query segment 7 exists in no key: rows 8..11 see nothing; rows 4, 5 (segment 1) see
    # no key either under causality (segment-1 keys start at 6).
    qseg = jnp.array([[0] * 4 + [1] * 4 + [7] * 4], jnp.int32)
    kseg = jnp.array([[0] * 6 + [1] * 10], jnp.int32)
    out, (dq, dk, dv) = _check(impl, B=1, T=12, S=16, N=4, K=2, H=16, segment_ids=(qseg, kseg), is_causal=True)
    for rows in (slice(4, 6), slice(8, 12)):
        np.testing.assert_array_equal(np.asarray(out[:, rows]), 0.0)
        np.testing.assert_array_equal(np.asarray(dq[:, rows]), 0.0)
    # Keys 8..15 (segment 1, after every segment-1 query under causality) get no gradient.
    np.testing.assert_array_equal(np.asarray(dk[:, 8:]), 0.0)
    np.testing.assert_array_equal(np.asarray(dv[:, 8:]), 0.0)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_vmap_and_grads_of_vmap(impl):
    kw = dict(is_causal=True, segment_ids=SEG3[:1], sliding_window=6)
    q, k, v, _ = _inputs(3, 12, 12, 4, 2, 16)
    q, k, v = q[:, None], k[:, None], v[:, None]  # [3, 1, T, N, H]: vmapped extra axis
    f = lambda q, k, v: dot_product_attention(q, k, v, implementation=impl, **kw)
    r = lambda q, k, v: ref.dot_product_attention(q, k, v, **kw)
    sq = lambda fn: (lambda q, k, v: jnp.sum(fn(q, k, v) ** 2))
    total = lambda fn: (lambda q, k, v: jnp.sum(jax.vmap(fn)(q, k, v)))

    def everything(fn):
        return (
            jax.vmap(fn)(q, k, v),
            jax.vmap(jax.grad(sq(fn), argnums=(0, 1, 2)))(q, k, v),  # vmap of grad
            # grad of vmap with a loss whose cotangent is unbatched (sum -> broadcast ones).
            jax.grad(total(fn), argnums=(0, 1, 2))(q, k, v),
        )

    with PA.block_sizes(8, 8):
        got = jax.jit(lambda: everything(f))()
    want = jax.jit(lambda: everything(r))()
    _close(got, want, 1e-5)


def test_vmap_over_segment_ids():
    q, k, v, _ = _inputs(2, 12, 12, 4, 2, 16)
    seg = SEG3[:, None]  # [2, 1, 12]: one segment layout per vmapped example
    f = lambda q, k, v, s: dot_product_attention(q, k, v, segment_ids=s, implementation="pallas")
    out = jax.vmap(f)(q[:, None], k[:, None], v[:, None], seg)[:, 0]
    _close(out, ref.dot_product_attention(q, k, v, segment_ids=SEG3), 1e-5)


def _lower(B, T, N, K, H, dtype, **kw):
    sd = lambda s: jax.ShapeDtypeStruct(s, jnp.dtype(dtype))

    def fwd_bwd(q, k, v):
        out, vjp = jax.vjp(lambda q, k, v: dot_product_attention(q, k, v, implementation="pallas", **kw), q, k, v)
        return vjp(jnp.ones_like(out))

    with config.use(interpret=False):
        text = C.lower_for_gpu(fwd_bwd, sd((B, T, N, H)), sd((B, T, K, H)), sd((B, T, K, H)))
    return C.triton_kernel_names(text)


@pytest.mark.parametrize(
    "B,T,N,K,H,dtype,kw",
    [
        (1, 8192, 32, 8, 128, "bfloat16", dict(is_causal=True)),
        (1, 4096, 32, 8, 80, "bfloat16", dict(is_causal=True)),
        (2, 1000, 8, 8, 256, "float16", dict(sliding_window=128, logit_softcap=30.0)),
        (1, 777, 4, 1, 32, "float32", dict(is_causal=True, segment_ids=jnp.zeros((1, 777), jnp.int32))),
    ],
)
def test_lowers_for_cuda(B, T, N, K, H, dtype, kw):
    names = _lower(B, T, N, K, H, dtype, **kw)
    assert sorted(names) == sorted(KERNELS), names


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_residuals_are_linear_in_T(impl):
    B, T, N, K, H = 1, 2048, 2, 1, 16
    sd = lambda s, dt=jnp.float32: jax.ShapeDtypeStruct(s, dt)
    f = lambda q, k, v: dot_product_attention(q, k, v, is_causal=True, implementation=impl)
    # Shapes only: the residuals are the leaves of the vjp closure.
    res = jax.eval_shape(lambda q, k, v: jax.vjp(f, q, k, v)[1], sd((B, T, N, H)), sd((B, T, K, H)), sd((B, T, K, H)))
    leaves = [x for x in jax.tree_util.tree_leaves(res) if hasattr(x, "shape")]
    assert all(np.prod(x.shape) < T * T for x in leaves), [x.shape for x in leaves]
    saved = sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in leaves)
    inputs_and_out = 4 * (2 * B * T * N * H + 2 * B * T * K * H)
    assert saved <= inputs_and_out + 4 * B * N * T, (saved, [x.shape for x in leaves])


BAD = [
    ("head dim", lambda: (jnp.ones((1, 8, 4, 16)), jnp.ones((1, 8, 2, 32)), jnp.ones((1, 8, 2, 32))), {},
     ValueError, r"key must have shape \[B=1, S, K, H=16\].*got \(1, 8, 2, 32\)"),
    ("N % K", lambda: (jnp.ones((1, 8, 4, 16)), jnp.ones((1, 8, 3, 16)), jnp.ones((1, 8, 3, 16))), {},
     ValueError, r"N % K == 0.*got N=4, K=3"),
    ("segment shape", lambda: (jnp.ones((1, 8, 4, 16)),) + (jnp.ones((1, 8, 2, 16)),) * 2,
     {"segment_ids": jnp.zeros((1, 7), jnp.int32)}, ValueError, r"segment_ids must have shape \(1, 8\).*got \(1, 7\)"),
    ("segment T != S", lambda: (jnp.ones((1, 8, 4, 16)),) + (jnp.ones((1, 9, 2, 16)),) * 2,
     {"segment_ids": jnp.zeros((1, 8), jnp.int32)}, ValueError, r"segment_ids must be a pair"),
    ("segment dtype", lambda: (jnp.ones((1, 8, 4, 16)),) + (jnp.ones((1, 8, 2, 16)),) * 2,
     {"segment_ids": jnp.zeros((1, 8))}, TypeError, r"segment_ids must have an integer dtype.*got float32"),
    ("window 0", lambda: (jnp.ones((1, 8, 4, 16)),) + (jnp.ones((1, 8, 2, 16)),) * 2,
     {"sliding_window": 0}, ValueError, r"sliding_window must be an int >= 1, got 0"),
    ("window -3", lambda: (jnp.ones((1, 8, 4, 16)),) + (jnp.ones((1, 8, 2, 16)),) * 2,
     {"sliding_window": -3}, ValueError, r"sliding_window must be an int >= 1, got -3"),
    ("softcap 0", lambda: (jnp.ones((1, 8, 4, 16)),) + (jnp.ones((1, 8, 2, 16)),) * 2,
     {"logit_softcap": 0.0}, ValueError, r"logit_softcap must be a positive number, got 0.0"),
    ("rank", lambda: (jnp.ones((8, 4, 16)),) + (jnp.ones((1, 8, 2, 16)),) * 2, {}, ValueError, r"query must have rank 4"),
    ("int q", lambda: (jnp.ones((1, 8, 4, 16), jnp.int32),) + (jnp.ones((1, 8, 2, 16)),) * 2, {}, TypeError,
     r"query must have a floating dtype"),
    ("mixed dtypes", lambda: (jnp.ones((1, 8, 4, 16), jnp.bfloat16),) + (jnp.ones((1, 8, 2, 16)),) * 2, {}, TypeError,
     r"query, key, value must share one dtype"),
    ("empty head dim", lambda: (jnp.ones((1, 8, 4, 0)),) + (jnp.ones((1, 8, 2, 0)),) * 2, {}, ValueError,
     r"query must have a non-empty head dim H, got shape \(1, 8, 4, 0\)"),
]


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_windows_and_lengths_past_int32_mean_no_limit(impl):
    # A window wider than any query-key distance (the natural "no limit") and key lengths
    # past the sequence, up to and beyond int32 (64-bit with x64): the unwindowed result.
    q, k, v, _ = _inputs(1, 12, 12, 2, 1, 16, "float32")
    run = lambda **kw: dot_product_attention(q, k, v, implementation=impl, **kw)  # noqa: E731
    full, causal = run(), run(is_causal=True)
    for kw, want in [({"local_window_size": 2**31 - 1}, full), ({"local_window_size": (2**31 - 1, 0), "is_causal": True}, causal),
                     ({"local_window_size": (2**31 - 1, 3)}, run(local_window_size=(12, 3))), ({"sliding_window": 2**40}, full)]:
        _close(run(**kw), want, TOL["float32"])
    with jax.enable_x64(True):
        got = dot_product_attention(q, k, v, key_value_seq_lengths=jnp.array([2**32 + 1], jnp.int64), implementation=impl)
    _close(got, full, TOL["float32"])


@pytest.mark.parametrize("name,make,kw,error,match", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs(name, make, kw, error, match):
    with pytest.raises(error, match=match) as info:
        dot_product_attention(*make(), **kw)
    assert "dot_product_attention" in str(info.value)


@pytest.mark.parametrize("precision,want", [(None, "tf32"), ("tensorfloat32", "tf32"), ("highest", "tf32x3"), ("float32", "tf32x3")])
def test_f32_dots_follow_default_matmul_precision(precision, want):
    # f32 tiles run the tensor cores as XLA's f32 dots do: TF32 by default, 3xTF32 for
    # "highest"; read from the kernels' Triton IR.
    import re

    s = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.float32)

    def bwd(q):
        out, vjp = jax.vjp(lambda q: dot_product_attention(q, q, q, implementation="pallas"), q)
        return vjp(out)

    with config.use(interpret=False), jax.default_matmul_precision(precision):
        ir = C.triton_ir(C.lower_for_gpu(bwd, s))
    assert set(ir) == set(KERNELS)
    for name, text in ir.items():
        assert set(re.findall(r"inputPrecision = (\w+)", text)) == {want}, name


# ------------------------------------------------ jax.nn.dot_product_attention's signature
# The cases jax checks for its own attention (GQA groups, vmap over unbatched calls, bias,
# causal, padding by seq lengths, custom masks, their combinations, local windows, bias
# gradients), here against jax.nn.dot_product_attention itself (its XLA implementation).
def _vjp_all(f, args, dy):
    out, vjp = jax.vjp(f, *args)
    return out, vjp(dy)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("use_vmap", [False, True])
def test_jax_nn_gqa_and_vmap_over_unbatched(groups, use_vmap, dtype, impl):
    B, T, S, N, H = 2, 24, 24, 4, 16
    q, k, v, dy = _inputs(B, T, S, N, N // groups, H, dtype)
    ours = lambda q, k, v: dot_product_attention(q, k, v, implementation=impl)
    if use_vmap:  # each call sees unbatched [T, N, H] inputs, as jax.nn accepts
        ours = jax.vmap(ours)
    theirs = lambda q, k, v: jax.nn.dot_product_attention(q, k, v)
    tol = 2e-2 if dtype == "bfloat16" else 2e-5
    chex.assert_trees_all_close(_vjp_all(ours, (q, k, v), dy), _vjp_all(theirs, (q, k, v), dy), atol=tol, rtol=tol)


MASK_MODES = ["bias", "causal", "padding", "custom", ("causal", "padding"), ("custom", "padding"),
              ("bias", "causal"), ("causal", "window"), "window", "asym_window", ("padding", "window"),
              "kv_padding_empty"]


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("mode", MASK_MODES, ids=["+".join(m) if isinstance(m, tuple) else m for m in MASK_MODES])
def test_jax_nn_masks(mode, impl):
    mode = (mode,) if isinstance(mode, str) else mode
    B, T, S, N, H = 2, 16, 16, 2, 8
    q, k, v, dy = _inputs(B, T, S, N, N, H, seed=3)
    ks = jax.random.split(jax.random.PRNGKey(4), 2)
    bias = jax.random.normal(ks[0], (1, N, T, S)) if "bias" in mode else None
    mask = jnp.tril(jnp.ones((T, S), bool))[None, None] if "custom" in mode else None
    kw = {"is_causal": "causal" in mode}
    if "padding" in mode:
        kw.update(query_seq_lengths=jnp.array([T // 2, T // 4], jnp.int32),
                  key_value_seq_lengths=jnp.array([S // 4, S // 2], jnp.int32))
    if "kv_padding_empty" in mode:  # a batch row with no key at all: jax.nn gives mean(V)
        kw.update(key_value_seq_lengths=jnp.array([0, 5], jnp.int32))
    if "window" in mode:
        kw["local_window_size"] = (3, 2) if kw["is_causal"] else (3, 3)
    if "asym_window" in mode:  # non-causal with 0 < right != left: the dense XLA path
        kw["local_window_size"] = (1, 4)
    ours = lambda q, k, v, b: dot_product_attention(q, k, v, b, mask, **kw, implementation=impl)
    theirs = lambda q, k, v, b: jax.nn.dot_product_attention(q, k, v, b, mask, **kw)
    args = (q, k, v, bias)
    chex.assert_trees_all_close(_vjp_all(ours, args, dy), _vjp_all(theirs, args, dy), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_jax_nn_kernel_path_for_lengths_and_windows(impl):
    # Seq lengths and causal/symmetric local windows stay on the flash path: what the
    # forward saves is O(B*N*T) beyond the inputs, no [T, S] array (a dense bias saves one).
    B, T, N, H = 1, 64, 2, 8
    q, k, v, _ = _inputs(B, T, T, N, N, H)
    kw = dict(query_seq_lengths=jnp.array([40], jnp.int32), key_value_seq_lengths=jnp.array([50], jnp.int32))

    def saved(**extra):
        f = lambda q, k, v: dot_product_attention(q, k, v, **kw, **extra, implementation=impl)
        res = jax.eval_shape(lambda q, k, v: jax.vjp(f, q, k, v)[1], q, k, v)
        return [x.shape for x in jax.tree_util.tree_leaves(res) if hasattr(x, "shape")]

    for extra in ({"local_window_size": (5, 5)}, {"local_window_size": (5, 2), "is_causal": True}, {}):
        shapes = saved(**extra)
        assert all(np.prod(s) < T * T for s in shapes), shapes
    assert any(np.prod(s) >= T * T for s in saved(bias=jnp.zeros((1, N, T, T))))
    if impl == "pallas":
        f = lambda q, k, v: jnp.sum(dot_product_attention(q, k, v, **kw, local_window_size=3, implementation=impl))
        assert "attention_fwd" in str(jax.make_jaxpr(jax.grad(f))(q, k, v))


def test_jax_nn_bias_gradient_with_short_mask():
    # A 3-D mask [1, 1, S] gets leading dims, as jax.nn; the bias gets its gradient.
    B, S, N, H = 2, 16, 2, 8
    x = _inputs(B, S, S, N, N, H)[0]
    bias = jax.random.normal(jax.random.PRNGKey(7), (B, N, S, S))
    mask = jnp.ones((1, 1, S), bool).at[..., 3].set(False)
    ours = lambda x, b: dot_product_attention(x, x, x, b, mask)
    theirs = lambda x, b: jax.nn.dot_product_attention(x, x, x, b, mask)
    chex.assert_trees_all_close(_vjp_all(ours, (x, bias), x), _vjp_all(theirs, (x, bias), x), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_extras_keep_their_conventions_next_to_jax_arguments(impl):
    B, T, N, H = 2, 12, 2, 8
    q, k, v, _ = _inputs(B, T, T, N, N, H)
    # sliding_window=w is local_window_size=(w - 1, 0) under is_causal.
    a = dot_product_attention(q, k, v, is_causal=True, sliding_window=4, implementation=impl)
    b = dot_product_attention(q, k, v, is_causal=True, local_window_size=(3, 0), implementation=impl)
    chex.assert_trees_all_close(a, b, atol=1e-6, rtol=1e-6)
    # A row that only segment_ids leave without keys gives 0; key lengths add to segments.
    seg = (jnp.zeros((B, T), jnp.int32).at[:, -1].set(7), jnp.zeros((B, T), jnp.int32))
    out = dot_product_attention(q, k, v, segment_ids=seg, key_value_seq_lengths=jnp.array([5, 9], jnp.int32),
                                implementation=impl)
    np.testing.assert_array_equal(out[:, -1], 0.0)
    want = ref.dot_product_attention(q[:, :-1], k[:, :5], v[:, :5])
    chex.assert_trees_all_close(out[0, :-1], want[0], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
    "kw,error,match",
    [
        ({"local_window_size": (2, -1)}, ValueError, r"local_window_size must be an int >= 0 or a pair of them, got \(2, -1\)"),
        ({"local_window_size": 2, "sliding_window": 3}, ValueError, r"local_window_size .* or sliding_window, not both"),
        ({"mask": jnp.ones((1, 1, 8, 8))}, TypeError, r"mask must be a boolean array.*got float32"),
        ({"bias": jnp.ones((1, 3, 8, 8))}, ValueError, r"bias must broadcast to \[B, N, T, S\] = \(1, 4, 8, 8\), got \(1, 3, 8, 8\)"),
        ({"query_seq_lengths": jnp.array([3, 4], jnp.int32)}, ValueError, r"query_seq_lengths must have shape \(1,\)"),
        ({"key_value_seq_lengths": jnp.array([3.0])}, TypeError, r"key_value_seq_lengths must have an integer dtype"),
    ],
)
def test_jax_signature_bad_inputs(kw, error, match):
    with pytest.raises(error, match=match) as info:
        dot_product_attention(jnp.ones((1, 8, 4, 16)), jnp.ones((1, 8, 2, 16)), jnp.ones((1, 8, 2, 16)), **kw)
    assert "dot_product_attention" in str(info.value)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("mode", ["rank-raise", "x64-strict"])
def test_lengths_and_windows_under_strict_user_settings(impl, mode):
    """Sequence lengths and local windows (options the registry's first example leaves out)
    trace under ``jax.numpy_rank_promotion("raise")`` and under x64 with strict dtype
    promotion: forward, VJP and, with forward mode, JVP, lowered with the kernels traced."""
    with contextlib.ExitStack() as stack, config.use(interpret=True):
        if mode == "x64-strict":
            stack.enter_context(jax.enable_x64(True))
        q, k, v = (jax.random.normal(jax.random.PRNGKey(i), (2, 12, 2, 16), jnp.float32) for i in range(3))
        cases = [dict(query_seq_lengths=jnp.array([12, 5]), key_value_seq_lengths=jnp.array([9, 12])),
                 dict(local_window_size=(3, 0), is_causal=True),
                 dict(key_value_seq_lengths=jnp.array([9, 12]), local_window_size=(2, 2))]
        stack.enter_context(jax.numpy_rank_promotion("raise") if mode == "rank-raise"
                            else jax.numpy_dtype_promotion("strict"))
        for kw in cases:
            f = lambda q, k, v: dot_product_attention(q, k, v, implementation=impl, **kw)  # noqa: E731
            jax.jit(lambda *a: jax.vjp(f, *a)[1](jnp.ones_like(q))).lower(q, k, v)
            if FORWARD_MODE:
                jax.jit(lambda *a: jax.jvp(f, a, a)).lower(q, k, v)
