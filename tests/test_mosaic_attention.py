"""dot_product_attention under ``pallas_backend="mosaic"``: the attention contract run through
the Mosaic GPU kernels in Mosaic's interpreter with race detection, the backend switch, and
lowering for CUDA.

Mosaic GPU's interpreter (``plgpu.InterpretGPUParams(detect_races=True)``) simulates shared
memory, TMA, mbarriers and wgmma with one CPU thread per warpgroup (two consumers and the
producer) and raises on a data race. The Mosaic kernels take 16-bit inputs
(``config.MOSAIC_KERNELS``), so the contract cases run in bfloat16 (tolerance 2e-2 of the
largest value, as tests/test_attention.py). ``block_k(64)`` makes the multi-block cases
stream several key (or query) blocks through the two-slot ring, so it wraps.

Mosaic's interpreter runs each warpgroup as an XLA computation whose barrier waits block a
thread of XLA:CPU's pool; with the 2-thread pool of a 2-CPU machine runs deadlocked. The
kernels refuse a pool of fewer than warpgroups + 2 threads with a clear error
(``_mgpu.check_interpreter_threads``), and tests/conftest.py sizes it with NPROC.
"""
from __future__ import annotations

import contextlib
import math
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import test_attention as TA  # the attention contract's cases and checker
from jaxbwd import config, deviceless
from jaxbwd.pallas import attention as PA
from jaxbwd.pallas.mosaic import attention as MA
from jaxbwd.vjp.attention import dot_product_attention

MOSAIC = ("attention_fwd_mosaic", "attention_bwd_dkdv_mosaic", "attention_bwd_dq_mosaic")
# Above head dim 128 dk and dv run as two kernels (pallas/mosaic/attention.py, _plan).
MOSAIC_SPLIT = ("attention_fwd_mosaic", "attention_bwd_dk_mosaic", "attention_bwd_dv_mosaic", "attention_bwd_dq_mosaic")


def _names(f, *args):
    found = set(re.findall(r"name=(\w+)", str(jax.make_jaxpr(f)(*args))))
    return found & set(MOSAIC + MOSAIC_SPLIT + TA.KERNELS)


def _fwd_bwd(impl, **kw):
    f = lambda q, k, v: dot_product_attention(q, k, v, implementation=impl, **kw)

    def fwd_bwd(q, k, v, ct):
        out, vjp = jax.vjp(f, q, k, v)
        return out, vjp(ct)
    return fwd_bwd


needs_mosaic = pytest.mark.skipif(not config.MOSAIC_AVAILABLE, reason="the Mosaic GPU kernels need jax >= 0.12")

# Each case takes 3-10 s in Mosaic's interpreter on 2 cores (three simulated warpgroups per
# CTA, race detection on). Three cases that cover GQA, head-dim padding, causal bounds,
# segment ids and the softcap are the quick selection; the rest (windows among them, also
# in the multi-block cases) are marked slow (deselect with -m "not slow").
FAST = ("mha-H20-pad", "segments3-causal", "softcap30")


@needs_mosaic
@pytest.mark.parametrize("case", [c if c in FAST else pytest.param(c, marks=pytest.mark.slow) for c in TA.CASES])
def test_contract_cases_bf16(case):
    kw = dict(TA.CASES[case])
    with config.use(pallas_backend="mosaic"):
        q, k, v, ct = TA._inputs(*(kw.pop(x) for x in "BTSNKH"), "bfloat16")
        f = _fwd_bwd("pallas", **kw)
        assert _names(f, q, k, v, ct) == set(MOSAIC)
    _compare(q, k, v, ct, kw)


def _compare(q, k, v, ct, kw, bk=None):
    with config.use(pallas_backend="mosaic"), (MA.block_k(bk) if bk else contextlib.nullcontext()):
        out, grads = jax.jit(_fwd_bwd("pallas", **kw))(q, k, v, ct)
    f32 = lambda x: x.astype(jnp.float32)

    @jax.jit
    def truth(q, k, v, ct):
        want, vjp_ref = jax.vjp(lambda q, k, v: TA.ref.dot_product_attention(q, k, v, **kw), q, k, v)
        return want, vjp_ref(ct)

    want, want_grads = truth(f32(q), f32(k), f32(v), f32(ct))
    assert out.dtype == q.dtype and out.shape == q.shape
    for g, x in zip(grads, (q, k, v)):
        assert g.dtype == x.dtype and g.shape == x.shape
        assert bool(jnp.all(jnp.isfinite(f32(g))))
    TA._close(out, want, TA.TOL["bfloat16"])
    TA._close(grads, want_grads, TA.TOL["bfloat16"])


# Several 128-row CTAs, several key blocks of 64 through the two-slot ring (it wraps), ragged
# tails in T and S, GQA, head dims padded to 64 and 128.
SEG_LONG = jnp.array([[0] * 60 + [1] * 50 + [2] * 40], jnp.int32)
MULTI = {
    "T150-S200-gqa2-causal-H64": dict(B=1, T=150, S=200, N=2, K=1, H=64, is_causal=True),
    "T70-S200-H128": dict(B=1, T=70, S=200, N=2, K=1, H=128),
    "T150-gqa2-segments-window-softcap-H40": dict(B=1, T=150, S=150, N=2, K=1, H=40, is_causal=True,
                                                 segment_ids=SEG_LONG, sliding_window=90, logit_softcap=20.0),
}


@needs_mosaic
@pytest.mark.slow
@pytest.mark.parametrize("case", list(MULTI))
def test_multi_block_pipeline_bf16(case):
    kw = dict(MULTI[case])
    q, k, v, ct = TA._inputs(*(kw.pop(x) for x in "BTSNKH"), "bfloat16")
    _compare(q, k, v, ct, kw, bk=64)


# Head dims over 128: one consumer warpgroup per CTA in the forward and dq, dk and dv as two
# kernels; several query and key blocks, ragged tails, GQA, every mask, head dim padded 160->192.
WIDE = {
    "T150-S200-gqa2-causal-window-softcap-H256": dict(B=1, T=150, S=200, N=2, K=1, H=256, is_causal=True,
                                                     sliding_window=120, logit_softcap=30.0),
    "T150-gqa2-segments-H160": dict(B=1, T=150, S=150, N=2, K=1, H=160, segment_ids=SEG_LONG),
}


@needs_mosaic
@pytest.mark.parametrize("case", list(WIDE))
def test_wide_head_dims_split_dk_dv_bf16(case):
    kw = dict(WIDE[case])
    q, k, v, ct = TA._inputs(*(kw.pop(x) for x in "BTSNKH"), "bfloat16")
    with config.use(pallas_backend="mosaic"):
        assert _names(_fwd_bwd("pallas", **kw), q, k, v, ct) == set(MOSAIC_SPLIT)
    _compare(q, k, v, ct, kw, bk=64)


@needs_mosaic
def test_repeated_eager_calls_compile_nothing():
    """Mosaic kernels launched outside ``jax.jit`` run through the same per-launch jit cache as
    the Triton ones (``_common.call``): a repeated eager forward and grad compile nothing
    (2 and 6 compilations per call before)."""
    import test_eager

    q = jax.random.normal(jax.random.PRNGKey(0), (1, 128, 2, 64), jnp.bfloat16)
    att = lambda q: dot_product_attention(q, q, q, is_causal=True, implementation="pallas:mosaic")  # noqa: E731
    for call in (lambda: att(q), lambda: jax.grad(lambda q: att(q).astype(jnp.float32).sum())(q)):
        for _ in range(2):
            jax.block_until_ready(call())
        with test_eager._compiles() as count:
            jax.block_until_ready(call())
        assert count[0] == 0


@needs_mosaic
def test_residuals_shared_with_triton():
    # Same residual contract: the Mosaic forward's lse equals the Triton forward's, and the
    # Mosaic backward from Triton's residuals matches the Triton backward.
    B, T, S, N, K, H = 1, 70, 90, 2, 1, 64
    d = PA.Dims(B, T, S, N, K, H, H ** -0.5, True, None, None, False)
    q, k, v, do = TA._inputs(B, T, S, N, K, H, "bfloat16")
    q2, k2, v2, do2 = q.reshape(B * T, N * H), k.reshape(B * S, K * H), v.reshape(B * S, K * H), do.reshape(B * T, N * H)
    o_t, lse_t = PA.attention_fwd(q2, k2, v2, None, None, d, interpret=True)
    o_m, lse_m = MA.attention_fwd(q2, k2, v2, None, None, d, interpret=True)
    assert lse_m.shape == lse_t.shape == (B * N, T) and lse_m.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(lse_m), np.asarray(lse_t), rtol=1e-5, atol=1e-5)
    TA._close(o_m, o_t.astype(jnp.float32), 2e-2)
    want = PA.attention_bwd(q2, k2, v2, None, None, o_t, lse_t, do2, d, interpret=True)
    got = MA.attention_bwd(q2, k2, v2, None, None, o_t, lse_t, do2, d, interpret=True)
    TA._close(got, tuple(w.astype(jnp.float32) for w in want), 2e-2)


# ------------------------------------------------------------------------- the switch
def _kernels_for(impl, dtype="bfloat16", H=16, **use):
    q, k, v, ct = TA._inputs(1, 12, 12, 2, 1, H, dtype)
    with config.use(**use):
        return _names(_fwd_bwd(impl, is_causal=True), q, k, v, ct)


def test_triton_is_the_default():
    assert config.pallas_backend() == "triton"
    assert _kernels_for("pallas") == set(TA.KERNELS)


@needs_mosaic
def test_settings_choose_mosaic_per_op_and_fall_back_to_triton():
    assert _kernels_for("pallas", pallas_backend="mosaic") == set(MOSAIC)
    # No Mosaic kernel for f32 inputs: the settings-wide choice runs Triton. Head dims over
    # 128 (up to the kernels' 256) run the split dk/dv kernels.
    assert _kernels_for("pallas", "float32", pallas_backend="mosaic") == set(TA.KERNELS)
    assert _kernels_for("pallas", H=192, pallas_backend="mosaic") == set(MOSAIC_SPLIT)
    # Per call, in both directions.
    assert _kernels_for("pallas:mosaic") == set(MOSAIC)
    assert _kernels_for("pallas:triton", pallas_backend="mosaic") == set(TA.KERNELS)


def test_without_jax_0_12_settings_run_triton_and_per_call_mosaic_raises(monkeypatch):
    monkeypatch.setattr(config, "MOSAIC_AVAILABLE", False)
    assert _kernels_for("pallas", pallas_backend="mosaic") == set(TA.KERNELS)
    with pytest.raises(ValueError, match=r"dot_product_attention: implementation='pallas:mosaic' needs jax >= 0\.12 "
                                         r"\(the Mosaic GPU kernels use its Pallas API\), got jax "):
        _kernels_for("pallas:mosaic")


@needs_mosaic
def test_per_call_mosaic_without_a_kernel_raises():
    with pytest.raises(ValueError, match=r"dot_product_attention: implementation='pallas:mosaic' has no Mosaic "
                                         r"GPU kernel for float32 inputs with last dim 16 on sm_90; its Mosaic kernels "
                                         r"cover sm_90: bfloat16/float16 inputs, last dim <= 256 \(use 'pallas' for "
                                         r"the Triton kernels\)"):
        _kernels_for("pallas:mosaic", "float32")
    # Too wide for the Mosaic kernels: no advice to use Triton's, which refuse it too.
    with pytest.raises(ValueError, match=r"for bfloat16 inputs with last dim 320 on sm_90; its Mosaic kernels "
                                         r"cover sm_90: bfloat16/float16 inputs, last dim <= 256$"):
        config.resolve_pallas_backend("pallas:mosaic", "dot_product_attention", jnp.bfloat16, 90, 320)


@needs_mosaic
def test_per_call_mosaic_for_an_op_without_a_mosaic_kernel_says_so():
    import jaxbwd

    with pytest.raises(ValueError, match=r"jaxbwd.relu: implementation='pallas:mosaic': relu has no Mosaic GPU "
                                         r"kernel \(Mosaic kernels exist for \['dot_product_attention'\]\); use "
                                         r"'pallas' for its Triton kernels$"):
        jaxbwd.relu(jnp.ones((4, 8)), implementation="pallas:mosaic")


@needs_mosaic
def test_per_call_mosaic_on_an_op_without_kernels_says_so():
    # Such ops resolve their implementation without operands; the message once spoke of
    # "float64 inputs with last dim None".
    import jaxbwd

    with pytest.raises(ValueError, match=r"jaxbwd.matmul: implementation='pallas:mosaic' has no Mosaic GPU "
                                         r"kernel: this op has no Pallas kernels \(its work is XLA's by design\)"):
        jaxbwd.matmul(jnp.ones((2, 3)), jnp.ones((3, 4)), implementation="pallas:mosaic")


@needs_mosaic
def test_interpreter_refuses_a_cpu_pool_that_would_deadlock(monkeypatch):
    from jaxbwd.pallas.mosaic import _mgpu

    q, k, v, ct = TA._inputs(1, 16, 16, 1, 1, 16, "bfloat16")
    monkeypatch.setattr(_mgpu, "cpu_pool_threads", lambda: 4)
    with config.use(pallas_backend="mosaic"), pytest.raises(
            RuntimeError, match=r"attention_fwd_mosaic: Mosaic GPU's interpreter runs its 3 warpgroups on XLA's CPU "
                                r"thread pool, .* needs at least 5 pool threads and has 4, .* NPROC=8 \(or PJRT_NPROC\)"):
        jax.eval_shape(_fwd_bwd("pallas"), q, k, v, ct)
    monkeypatch.setattr(_mgpu, "cpu_pool_threads", lambda: 5)
    with config.use(pallas_backend="mosaic"):
        out, grads = jax.eval_shape(_fwd_bwd("pallas"), q, k, v, ct)
    assert out.shape == q.shape and [g.shape for g in grads] == [q.shape, k.shape, v.shape]


@needs_mosaic
@pytest.mark.parametrize("env,want", [({"NPROC": "3"}, 3), ({"PJRT_NPROC": "5", "NPROC": "3"}, 5)])
def test_cpu_pool_threads_counts_the_pool_jax_built(env, want):
    code = ("import jax.numpy as jnp; jnp.ones(1).block_until_ready(); "
            "from jaxbwd.pallas.mosaic import _mgpu; print(_mgpu.cpu_pool_threads())")
    base = {k: v for k, v in os.environ.items() if k not in ("NPROC", "PJRT_NPROC")}
    out = subprocess.run([sys.executable, "-c", code], env=dict(base, JAX_PLATFORMS="cpu", **env),
                         capture_output=True, text=True, check=True).stdout
    assert int(out.split()[-1]) == want


def test_bad_backend_names():
    with pytest.raises(ValueError, match=r"pallas_backend must be None, 'auto', 'triton' or 'mosaic', got 'cuda'"):
        with config.use(pallas_backend="cuda"):
            pass
    with pytest.raises(ValueError, match=r"implementation must be None, 'auto', 'pallas', 'xla', 'pallas:triton' "
                                         r"or 'pallas:mosaic', got 'mosaic'$"):
        dot_product_attention(*TA._inputs(1, 4, 4, 1, 1, 16)[:3], implementation="mosaic")
    # None and "auto" name the default backend, as JAXBWD_PALLAS_BACKEND=auto does
    with config.use(pallas_backend="mosaic"):
        for default in (None, "auto"):
            with config.use(pallas_backend=default):
                assert config.pallas_backend() == "triton"


def test_environment_variable():
    code = ("from jaxbwd import config; print(config.pallas_backend()); "
            "print(config.resolve_pallas_backend(None, 'dot_product_attention', 'bfloat16', 90)); "
            "print(config.resolve_pallas_backend(None, 'rms_norm', 'bfloat16', 90)); "
            "print(config.resolve_pallas_backend(None, 'dot_product_attention', 'bfloat16', 80))")
    env = dict(os.environ, JAXBWD_PALLAS_BACKEND="mosaic", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["mosaic", "mosaic" if config.MOSAIC_AVAILABLE else "triton", "triton", "triton"]
    env["JAXBWD_PALLAS_BACKEND"] = "rocm"
    bad = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and ("JAXBWD_PALLAS_BACKEND must be one of auto, none, triton, mosaic or unset, got 'rocm'"
                                    in bad.stderr)


# --------------------------------------------------------------------------- lowering
@needs_mosaic
@pytest.mark.parametrize("kw", [dict(is_causal=True), dict(sliding_window=512, logit_softcap=30.0, segments=True),
                                dict(is_causal=True, sliding_window=1024, logit_softcap=50.0, H=256),
                                dict(is_causal=True, x64=True), dict(is_causal=True, H=256, x64=True)],
                         ids=["causal", "window-softcap-segments", "gemma2-H256", "causal-x64", "H256-x64"])
def test_lowers_for_cuda_at_realistic_shapes(kw):
    # T = 4096, head dim 128 (GQA 32:8) or 256 (Gemma 2's 16:8), bf16: the forward and the
    # backward kernels (dk and dv split at 256) become mosaic_gpu_v2 custom calls, emitted
    # without a GPU. Under jax_enable_x64 the kernels' int32 grid indices meet int64 Python
    # ints (a lax.div of the two failed before _mgpu.div).
    kw = dict(kw)
    segments = kw.pop("segments", False)
    H = kw.pop("H", 128)
    x64 = kw.pop("x64", False)
    sds = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
    q, k = (sds(1, 4096, 32, 128), sds(1, 4096, 8, 128)) if H == 128 else (sds(1, 4096, 16, H), sds(1, 4096, 8, H))
    seg = jax.ShapeDtypeStruct((1, 4096), jnp.int32)

    def loss(q, k, v, seg):
        out = dot_product_attention(q, k, v, segment_ids=seg if segments else None, **kw)
        return out.astype(jnp.float32).sum()

    with config.use(implementation="pallas", interpret=False, pallas_backend="mosaic"), jax.enable_x64(x64):
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, k, seg).lower(
            lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call @mosaic_gpu_v2") == (3 if H == 128 else 4)
    assert "__gpu$xla.gpu.triton" not in text


@needs_mosaic
def test_forward_mode_tangent_from_mosaic_residuals():
    # Forward mode keeps the Triton tangent kernel; under the Mosaic backend it reads the
    # Mosaic forward's out and lse.
    kw = dict(is_causal=True, logit_softcap=20.0)
    q, k, v, _ = TA._inputs(1, 12, 12, 4, 2, 16, "bfloat16")
    tq, tk, tv, _ = TA._inputs(1, 12, 12, 4, 2, 16, "bfloat16", seed=1)
    f = lambda q, k, v: dot_product_attention(q, k, v, implementation="pallas", **kw)
    with config.use(pallas_backend="mosaic"):
        # The kernels sit inside the op's forward-mode primitives: read their expansions too.
        jaxpr = jax.make_jaxpr(lambda *a: jax.jvp(f, a[:3], a[3:]))(q, k, v, tq, tk, tv).jaxpr
        text = str(jaxpr) + "".join(str(deviceless.hijax_expansion(e)) for e in jaxpr.eqns)
        found = set(re.findall(r"name=(\w+)", text))
        assert "attention_fwd_mosaic" in found and "attention_jvp" in found and "attention_fwd" not in found
        out, tangent = jax.jit(lambda *a: jax.jvp(f, a[:3], a[3:]))(q, k, v, tq, tk, tv)
    f32 = lambda *xs: [x.astype(jnp.float32) for x in xs]
    want, want_t = jax.jvp(lambda q, k, v: TA.ref.dot_product_attention(q, k, v, **kw), f32(q, k, v), f32(tq, tk, tv))
    TA._close(out, want, TA.TOL["bfloat16"])
    TA._close(tangent, want_t, TA.TOL["bfloat16"])


# ------------------------------------------------------------- compiled figures
@pytest.mark.parametrize("used", ["used", "Used"])  # jax 0.12.0.1's ptxas, 0.12.1's
def test_compile_instrument_reads_mosaic_dumps(tmp_path, used):
    # What Mosaic's compiler writes with MOSAIC_GPU_DUMP_{PTX,PTXAS,RESOURCES} (abridged).
    (tmp_path / "attention_fwd_mosaic_0.ptxas").write_text(
        "ptxas info    : (C7504) Potential Performance Loss: 'setmaxnreg' ignored to maintain compatibility\n"
        "ptxas         .     16 bytes stack frame, 12 bytes spill stores, 8 bytes spill loads\n"
        f"info    : {used} 150 registers, used 16 barriers, 16 stack, 1025 bytes smem, 1088 bytes cmem[0], 0 bytes lmem\n")
    (tmp_path / "attention_fwd_mosaic_0.ptx").write_text(
        ".maxntid 384, 1, 1\nwgmma.mma_async.sync\nwgmma.mma_async.sync\nex2.approx.ftz.f32\nex2.approx.f32\n"
        "tanh.approx.f32\n")
    (tmp_path / "attention_fwd_mosaic_1.resources.txt").write_text("Resources(smem_scratch_bytes=101376, tmem=0)")

    (row,) = deviceless.mosaic_rows(str(tmp_path))
    assert row == {"kernel": "attention_fwd_mosaic", "registers": 150, "stack": 16, "spill_stores": 12,
                   "spill_loads": 8, "static_smem": 1025, "local": 0, "wgmma_serialized": False,
                   "setmaxnreg_ignored": True, "threads": 384, "hgmma": 2, "ex2": 2, "ex2_subnormal": 1,
                   "tanh_approx": 1, "dynamic_smem": 101376}


@needs_mosaic
def test_compile_instrument_traces_shapes_without_interpreter_threads(monkeypatch):
    # The instrument traces each case once for shapes in interpret mode; nothing runs, so a
    # small CPU pool must not stop `JAXBWD_PALLAS_BACKEND=mosaic python -m jaxbwd compile`.
    from jaxbwd.pallas.mosaic import _mgpu

    monkeypatch.setattr(_mgpu, "cpu_pool_threads", lambda: 2)
    case = next(c for c in deviceless.cases(["dot_product_attention"], ["bfloat16"], ["h200"])
                if c.id.startswith("dot_product_attention/1x8192x32:8x128-causal/"))
    with config.use(pallas_backend="mosaic"):
        _, arrays, op_min_bytes = deviceless._case_function(case)
    nbytes = [math.prod(a.shape) * a.dtype.itemsize for a in arrays]  # q, k, v, the cotangent
    assert op_min_bytes == sum(nbytes) + sum(nbytes[:3])  # ... and dq, dk, dv


def test_compile_instrument_counts_split_dk_dv_kernels():
    # `python -m jaxbwd compile` checks that every registry kernel was compiled; above head
    # dim 128 the Mosaic dk and dv kernels together stand for attention_bwd_dkdv.

    (c,) = [c for c in deviceless.cases(["dot_product_attention"], dtypes=("bfloat16",), gpus=("h200",))
            if "x256" in c.shape_name and c.mode == "vjp"]
    report = lambda names: {"rows": [dict(op=c.op, case=c.shape_name, dtype=c.dtype, gpu=c.gpu, kernel=k)
                                     for k in names], "failures": []}
    assert deviceless.missing_kernels(report(MOSAIC_SPLIT), [c]) == []
    assert deviceless.missing_kernels(report(MOSAIC_SPLIT[:-2]), [c]) == [f"{c.id}: attention_bwd_dkdv",
                                                                          f"{c.id}: attention_bwd_dq"]


@pytest.mark.compile
def test_mosaic_kernels_compile_for_h200(monkeypatch):
    # Lowering runs Mosaic's compiler (PTX, then ptxas for sm_90a) on this CPU machine: every
    # kernel at the registry's head dim 128 and 256 shapes compiles, uses wgmma and fits
    # shared memory; none spills at 128.

    missing = deviceless.missing_requirements()
    if missing:
        pytest.skip(f"needs {', '.join(missing)}: {deviceless.INSTALL_HINT}")
    monkeypatch.setenv("JAXBWD_PALLAS_BACKEND", "mosaic")
    cases = [c for c in deviceless.cases(["dot_product_attention"], dtypes=("bfloat16",), gpus=("h200",))
             if ("x128" in c.shape_name or "x256" in c.shape_name) and c.mode == "vjp"]  # forward mode stays on Triton
    report = deviceless.run(cases, jobs=1)
    assert not report["failures"], report["failures"]
    for wide in (False, True):
        rows = [r for r in report["rows"] if ("x256" in r["case"]) == wide]
        assert {r["kernel"] for r in rows} == set(MOSAIC_SPLIT if wide else MOSAIC)
        for r in rows:
            assert r["tensor_core"] == "HGMMA" and r["smem"] <= deviceless.GPUS["h200"].smem_per_block_optin, r
            budget = MOSAIC_H256_SPILLS.get(r["kernel"], 0) if wide else 0
            assert r["stack"] <= budget, r
            # The precision the README states (Mosaic GPU): every exponential is the .ftz
            # MUFU.EX2, and the head dim 256 case's softcap takes tanh from MUFU.TANH.
            assert r["ex2"] > 0 and r["ex2_subnormal"] == 0, r
            assert (r["tanh_approx"] > 0) == wide, r  # only the head dim 256 case has a softcap


# At head dim 256 one consumer warpgroup holds a [64, 256] f32 accumulator (128 of its 255
# registers) beside the [64, 64] score tiles; dq and dk spill (bytes of stack per thread,
# measured 2026-12-06 with `python -m jaxbwd compile` on jax 0.12.1, Gemma 2's causal +
# window + softcap case; 0.12.0.1: 128 and 128). The forward and dv do not.
MOSAIC_H256_SPILLS = {"attention_bwd_dq_mosaic": 152, "attention_bwd_dk_mosaic": 128}
