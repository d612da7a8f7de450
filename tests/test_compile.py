"""Every Pallas kernel compiles for real GPUs (sm_90 H200, sm_80 A100, sm_100 B200) at the registry's
realistic shapes, in f32 and bf16, with XLA's deviceless GPU compiler; and the static
figures read from the compiled code hold the gates below.

The tests marked ``compile`` need the ``[compile]`` extra (jax 0.12's CUDA plugin and NVIDIA's
cuobjdump/nvdisasm): without it they are skipped with the missing packages named. The
parser and occupancy tests at the top run everywhere.
"""
from __future__ import annotations

import os
import re

import pytest

from jaxbwd import deviceless, registry

KERNEL_OPS = [s.name for s in registry.ops() if s.has_kernels]
X256 = "1x4096x16:8x256-causal-window-softcap"
# Kernels allowed a stack (bytes per thread), keyed (kernel, dtype, gpu[, case]); any other
# kernel that spills, or one of these that spills more, fails the gate. At the default
# precision there are none since rope_bwd took its sin/cos off libdevice.
KNOWN_SPILLS: dict[tuple[str, ...], int] = {
    # f32 attention at head_dim 256 under 3xTF32: the fewest bytes of any tile compiled (see
    # _tuning._ATTENTION_X3; before those tiles: 632-1576 B on H200, no compile on A100).
    **{(k, "float32", g, "highest:" + c): n for k, g, c, n in (
        ("attention_bwd_dq", "h200", X256, 24), ("attention_bwd_dq", "a100", X256, 40),
        ("attention_bwd_dkdv", "h200", X256, 72), ("attention_bwd_dkdv", "a100", X256, 88),
        ("attention_jvp", "h200", "jvp:" + X256, 888), ("attention_jvp", "a100", "jvp:" + X256, 872),
        # B200: sm_90's tiles (every other tile compiled spilled more, 96-1672 B).
        ("attention_bwd_dq", "b200", X256, 32), ("attention_bwd_dkdv", "b200", X256, 72),
        ("attention_jvp", "b200", "jvp:" + X256, 904))},
}
# Kernels whose exponentials must be MUFU.EX2 only (exp2 of base-2 logits), no libdevice expf,
# each without the subnormal-result fixup of PTX ex2.approx.f32 (_common.exp2's ftz form).
EXP2_ONLY = {"attention_fwd", "attention_bwd_dkdv", "attention_bwd_dq", "attention_jvp", "cross_entropy_fwd",
             "cross_entropy_stats",
             "linear_cross_entropy_fwd", "linear_cross_entropy_bwd_dx", "linear_cross_entropy_bwd_dw"}
# Kernels with no libdevice expf sequence at all (the scale pass of cross_entropy, group_norm).
NO_EXPF = EXP2_ONLY | {"cross_entropy_bwd", "group_norm_bwd"}
# Memory-bound ops: all of the case's kernels' operand+result bytes over the op's minimum
# (each input and the cotangent read once, each gradient written once). For these the
# instrument's figure may not exceed the bound. (embed is not here: its kernels write rows
# of a zero-filled gradient in place, and the instrument counts an aliased buffer as read
# and written whole by each kernel.) group_norm's two-pass reduction reads x and dy once per
# kernel: 5/3 of the minimum plus O(N * C) partials (the one-kernel layout before it did the
# same second read inside one kernel, where the instrument did not count it).
IO_OVER_MIN = {"group_norm": 1.75, "rope": 1.1, "pixel_shuffle": 1.1, "unpatchify": 1.1}
# cross_entropy: the forward kernel reads the logits once and writes the unit-cotangent
# gradient once, the op's minimum of two passes over [rows, V]; the backward's in-place scale
# moves nothing at cotangent 1 (the instrument counts it statically, as a third and fourth pass).
# The loss alone (a primal case: cross_entropy_stats) reads the logits once, the same bound.
CE_FWD_OVER_MIN = 1.02
TENSOR_CORE = {"h200": "HGMMA", "a100": "HMMA", "b200": "UTCMMA"}
# Ops whose kernels have dots (deviceless.MATMUL_OPS): their f32 cases compile twice, at the
# default precision (TF32) and under jax.default_matmul_precision("highest") (3xTF32, cases
# named "highest:...").
DOT_OPS = deviceless.MATMUL_OPS
# Kernels that run mma.sync (HMMA) on sm_90 and sm_100 at one registry case, not wgmma or
# tcgen05: dk/dv at head_dim 256 in f32 (TF32). Every wgmma tile (M >= 64 rows) spilled
# 300-4100 B per thread (compiled, H200, tiles in bench/results/), and so did dk/dv's with the
# head dim split in two (64-3176 B; in four, or split by output, it issues more instructions
# than on mma.sync); every tcgen05 tile asked for more than the B200's 512 tensor-memory columns
# or spilled. The table takes the unspilled mma.sync tiles there. (The forward and dq split the
# head dim in two and run wgmma/tcgen05.) (kernel, dtype, case)
MMA_SYNC = {("attention_bwd_dkdv", "float32", X256)}
# The same on sm_90 alone: the tangent pass at head_dim 256 in f32, whose only wgmma tile
# without spills (the head dim in four) issues more instructions per unique S element than
# mma.sync (583 against 487); on sm_100 the head dim in four runs tcgen05 at fewer (346 against
# 472.5).
MMA_SYNC_SM90 = {("attention_jvp", "float32", "jvp:" + X256)}
# Under 3xTF32 (twice the operands per tile) the same on sm_90 and sm_100 for attention's dq,
# dk/dv and tangent pass at head_dim 80-256 and the forward at 256: their 64-row wgmma and
# tcgen05 tiles spilled (_tuning._ATTENTION_X3, the sm_100 entries).
X128, X80 = "1x8192x32:8x128-causal", "1x4096x32:8x80-causal"
MMA_SYNC |= {(k, "float32", "highest:" + c) for k in ("attention_bwd_dq", "attention_bwd_dkdv")
             for c in (X80, X128, X256)}
MMA_SYNC |= {("attention_jvp", "float32", "highest:jvp:" + c) for c in (X80, X128, X256)}
MMA_SYNC |= {("attention_fwd", "float32", "highest:" + c) for c in (X256, "jvp:" + X256)}
# Kernels that run some of their dots on mma.sync beside wgmma/tcgen05 (a 16- or 32-row
# operand tile, under wgmma's M = 64), with the HMMA count allowed: (kernel, dtype, case, gpu).
# Any other sm_90/sm_100 kernel of DOT_OPS has none.
_LCE_DENSE = ("4093x2048@32000", "8192x2048@128256", "8192x2048@256000", "8192x4096@151936")
MIXED_MMA_SYNC = {
    ("attention_bwd_dkdv", "bfloat16", X256, "h200"): 64,  # S, dP on 32 query rows
    **{("attention_bwd_dkdv", "float32", c, "h200"): 32 for c in (X80, X128)},  # 16 query rows
    **{("linear_cross_entropy_bwd_dw", "float32", "highest:" + c, "b200"): 96 for c in _LCE_DENSE},  # 16-wide D chunks
}
# Main-loop SASS instructions per unique score element (deviceless.main_loop's counting rule)
# at head_dim 128, bf16, H200 and B200: at most 18 in the forward, 27 in dk/dv, 22 in dq.
INST_PER_S = {"attention_fwd": 18, "attention_bwd_dkdv": 27, "attention_bwd_dq": 22}
# Persistent grids, sized by _tuning.split from the occupancy the tuning table records: the
# compiled kernels must reach it (else the grid is more than one wave) and fill most of a wave.
# (group_norm_bwd, which shares group_norm_bwd_sums's grid with more blocks per SM, fills
# 0.64-0.96 of a wave.)
PERSISTENT = {"rms_norm_bwd", "layer_norm_bwd", "bias_add_dbias", "group_norm_bwd_sums"}
# linear_cross_entropy's dw with f32 operands (16-bit takes one program per SM by design, for
# its slabs' memory: half a wave on the H200).
PERSISTENT_BY_DTYPE = {("linear_cross_entropy_bwd_dw", "float32")}
GPUS = ("h200", "a100", "b200")
MISSING = deviceless.missing_requirements()
needs_compiler = pytest.mark.skipif(
    bool(MISSING), reason=f"needs {', '.join(MISSING)}: {deviceless.INSTALL_HINT}")


# ------------------------------------------------------------- no compiler needed


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(num: int, value) -> bytes:
    if isinstance(value, int):
        return _varint(num << 3) + _varint(value)
    return _varint(num << 3 | 2) + _varint(len(value)) + value


def test_kernel_cache_reader_keeps_triton_kernels(tmp_path):
    fingerprint = (b'{debug = false, grid_x = 264 : i32, grid_y = 3 : i32, grid_z = 1 : i32, ir = "\\00\\01", '
                   b'name = "rms_norm_bwd", num_stages = 3 : i32, num_warps = 8 : i32}')
    triton = _field(1, b"rms_norm_bwd") + _field(2, _field(1, fingerprint) + _field(2, _field(1, 264) + _field(2, 256))
                                                 + _field(4, 8192) + _field(5, b"\x7fELFcubin"))
    fusion = _field(1, b"loop_add_fusion") + _field(2, _field(1, b"MlirKernelFusion(...)") + _field(2, _field(1, 64))
                                                    + _field(5, b"\x7fELF"))
    path = tmp_path / "cache.bin"
    path.write_bytes(_field(1, triton) + _field(1, fusion) + _field(2, 3))
    (k,) = deviceless.read_kernel_cache(str(path))
    assert (k.name, k.grid, k.num_warps, k.num_stages) == ("rms_norm_bwd", (264, 3, 1), 8, 3)
    assert (k.threads_per_block, k.dynamic_smem, k.cubin) == (256, 8192, b"\x7fELFcubin")


@pytest.mark.parametrize("regs,threads,smem,blocks,limiter", [
    (32, 256, 0, 8, "threads"),         # 2048 threads per SM
    (255, 256, 0, 1, "registers"),      # 255 -> 256 per thread: 64K registers = one 8-warp block
    (128, 128, 0, 4, "registers"),      # 128 regs x 32 = 4096 per warp; 16 warps per SM
    (64, 128, 100 * 1024, 2, "shared memory"),  # (100 + 1) KiB per block on 228 KiB
    (16, 32, 0, 32, "blocks"),          # at most 32 blocks per SM
])
def test_occupancy_rules(regs, threads, smem, blocks, limiter):
    occ = deviceless.occupancy(deviceless.GPUS["h200"], registers=regs, threads_per_block=threads,
                               smem_per_block=smem)
    assert (occ["blocks_per_sm"], occ["limiter"]) == (blocks, limiter)
    assert occ["warps_per_sm"] == blocks * threads // 32


_SASS = """
        /*0100*/                   MOV R1, c[0x0][0x28] ;
        /*0110*/                   HGMMA.64x64x16.F32.BF16 R8, gdesc[UR4], RZ ;
        /*0120*/                   FMUL R2, R2, R3 ;
        /*0130*/                   NOP ;
        /*0140*/                   MUFU.EX2 R4, R2 ;
        /*0150*/                   HGMMA.64x64x16.F32.BF16 R8, gdesc[UR4], R8 ;
        /*0160*/               @P0 BRA 0x120 ;
        /*0170*/                   FADD R2, R2, R3 ;
        /*0180*/                   HGMMA.64x64x16.F32.BF16 R8, gdesc[UR4], R8 ;
        /*0190*/                   MUFU.EX2 R4, R2 ;
        /*01a0*/               @P1 BRA 0x170 ;
        /*01b0*/                   ISETP.NE.AND P0, PT, R0, RZ, PT ;
        /*01c0*/               @P0 BRA 0x110 ;
        /*01d0*/                   EXIT ;
        /*01e0*/                   BRA 0x1e0;
"""


def test_main_loop_is_the_smallest_innermost_tensor_core_loop():
    # Loops: [0x120, 0x160] (HGMMA, 4 instructions without the NOP), [0x170, 0x1a0] (4),
    # [0x110, 0x1c0] (encloses both), the self-branch at 0x1e0 (no body). Innermost with
    # tensor-core ops: the first two; the tie goes to the first.
    loop = deviceless.main_loop(_SASS)
    assert loop == {"loop_sass": 4, "loop_tc": 1, "loop_ex2": 1}
    assert deviceless.main_loop(_SASS.replace("HGMMA", "FFMA")) is None
    # sm_100's tcgen05 MMA (operands in shared and tensor memory) counts as well.
    tcgen05 = "UTCHMMA gdesc[UR4], gdesc[UR10], tmem[UR8], tmem[UR28], idesc[UR29], UPT"
    assert deviceless.main_loop(re.sub(r"HGMMA[^;]*", tcgen05, _SASS)) == loop
    for other in ("UTCBAR", "UTCATOMSWS.AND", "UTCATOMSWS.FIND_AND_SET.ALIGN"):  # tcgen05 ops that are no MMA
        assert deviceless.main_loop(re.sub(r"HGMMA[^;]*", other + " R4, UR8", _SASS)) is None


def test_instructions_per_score_element_count_every_program_of_a_tile():
    # 4 loop instructions x 128 threads over a 64 x 16 tile: 0.5 per element; a kernel whose
    # head dim is split between two programs (metadata s_repeats) computes each tile twice.
    mix = {"loop_sass": 4}
    call = {"metadata": {"s_tile": "64x16"}}
    assert deviceless._inst_per_s(mix, 128, call) == 0.5
    assert deviceless._inst_per_s(mix, 128, {"metadata": {**call["metadata"], "s_repeats": "2"}}) == 1.0
    assert deviceless._inst_per_s(mix, 128, {"metadata": {}}) is None


def test_ex2_subnormal_fixup_is_recognised():
    # PTX ex2.approx.f32 (jnp.exp2): ptxas compares the argument with -126 and halves it and
    # squares the result where lower; ex2.approx.ftz.f32 is the MUFU.EX2 alone.
    fixup = """
        /*0150*/                   FSETP.GEU.AND P0, PT, R0, -126, PT ;
        /*0160*/              @!P0 FMUL R0, R0, 0.5 ;
        /*0170*/                   MUFU.EX2 R12, R0 ;
        /*0180*/              @!P0 FMUL R12, R12, R12 ;
        /*0190*/                   FSETP.GEU.AND P1, PT, |R27|, 1.175494350822287508e-38, PT ;
        /*01a0*/                   FSETP.GEU.AND P6, PT, R93.reuse, -126, PT ;
"""
    assert len(deviceless._EX2_SUBNORMAL_CHECK.findall(fixup)) == 2
    assert not deviceless._EX2_SUBNORMAL_CHECK.findall(_SASS)


def test_smem_over_the_opt_in_limit_fits_no_block():
    occ = deviceless.occupancy(deviceless.GPUS["a100"], registers=32, threads_per_block=128,
                               smem_per_block=200 * 1024)
    assert occ["blocks_per_sm"] == 0 and occ["limiter"] == "shared memory"


def test_every_kernel_op_has_cases_in_both_dtypes():
    cs = deviceless.cases(dtypes=("float32", "bfloat16"), gpus=GPUS)
    for op in KERNEL_OPS:
        mine = [c for c in cs if c.op == op]
        assert mine, f"{op} has Pallas kernels but nothing to compile"
        for dt in ("float32", "bfloat16"):
            for g in GPUS:
                assert any(c.dtype == dt and c.gpu == g for c in mine), (op, dt, g)
    assert len({c.id for c in cs}) == len(cs), "case ids must be unique"


def test_f32_cases_once_per_precision():
    cs = deviceless.cases(["dot_product_attention"], gpus=("a100",), precisions=(None, "highest"))
    f32 = [c for c in cs if c.dtype == "float32"]
    assert len(f32) == 2 * len([c for c in cs if c.dtype == "bfloat16"])
    assert {c.shape_name.split(":")[0] for c in f32 if c.precision} == {"highest"}
    assert {c.mode for c in f32 if c.shape_name.startswith("highest:jvp:")} == {"jvp"}
    # Ops without dots compile once, at the default; ids stay unique under a prefix (gelu has
    # two examples of one shape, told apart by their parameters).
    for precisions in ((None, "highest"), ("highest",)):
        cs = deviceless.cases(dtypes=("float32",), precisions=precisions)
        assert len({c.id for c in cs}) == len(cs), "case ids must be unique"
        assert all(c.op in deviceless.MATMUL_OPS for c in cs if c.precision)
        assert {c.op for c in cs if c.precision} == set(deviceless.MATMUL_OPS)
    with pytest.raises(ValueError, match="unknown precision 'fastest'; known: default, highest"):
        deviceless.cases(["dot_product_attention"], precisions=("fastest",))


def test_target_configs_name_the_architecture():
    for t in deviceless.GPUS.values():
        text = t.target_config()
        assert f"core_count: {t.core_count}" in text
        assert f"major: {t.sm // 10} minor: {t.sm % 10}" in text


# ---------------------------------------------------------------- the compiler


def _op_cases(ops):
    """The cases of ``ops``; the f32 ones of ops with dots also under ``"highest"`` (3xTF32)."""
    return deviceless.cases(list(ops), dtypes=("float32", "bfloat16"), gpus=GPUS, precisions=(None, "highest"))


@pytest.fixture(scope="module")
def compiled(request):
    """The cases of every op this session selected, compiled in one pool of workers (one
    per core, each reused from case to case), once: a pool per op would start fresh
    workers, a jax import each, for every op. Under pytest-xdist, None: each xdist worker
    compiles its own ops in one process."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return None
    ops = sorted({it.callspec.params["op"] for it in request.session.items
                  if it.originalname == "test_kernels_compile_for_gpus"})
    return deviceless.run(_op_cases(ops))


@pytest.mark.compile
@needs_compiler
@pytest.mark.parametrize("op", KERNEL_OPS)
def test_kernels_compile_for_gpus(op, compiled):
    cs = _op_cases([op])
    if compiled is None:
        report = deviceless.run(cs, jobs=1)
    else:
        ids = {c.id for c in cs}
        report = {"rows": [r for r in compiled["rows"] if r["op"] == op],
                  "failures": [f for f in compiled["failures"] if f["case"] in ids]}
    assert not report["failures"], report["failures"]
    assert not deviceless.missing_kernels(report, cs)
    spec = registry.get(op)
    if spec.jvp_kernels:
        assert any(c.mode == "jvp" for c in cs), f"{op}'s tangent kernels are not compiled"
    if spec.primal_kernels:
        assert any(c.mode == "primal" for c in cs), f"{op}'s primal kernels are not compiled"
    for r in report["rows"]:
        where = f"{r['kernel']} {r['case']} {r['dtype']} {r['gpu']}"
        target = deviceless.GPUS[r["gpu"]]
        # a jvp case runs the op's forward kernel too, then the tangent kernel; a primal case
        # (the op alone, not differentiated) its primal kernels
        allowed = (spec.kernels + spec.jvp_kernels if "jvp:" in r["case"] else
                   spec.primal_kernels if "primal:" in r["case"] else spec.kernels)
        assert r["kernel"] in allowed, f"unexpected kernel {where}"
        # Figures read from XLA's kernel cache and cuobjdump: consistent with each other.
        assert r["threads"] == 32 * r["num_warps"], where
        assert 1 <= r["registers"] <= 255, where
        assert r["sass"] > 0 and r["blocks"] >= 1, where
        assert r["smem"] <= target.smem_per_block_optin, where
        assert r["blocks_per_sm"] >= 1, f"{where}: no block fits an SM"
        assert r["arch"] == target.arch
        # Gates that hold today, so that a change cannot lose them unnoticed.
        key = (r["kernel"], r["dtype"], r["gpu"])
        budget = KNOWN_SPILLS.get(key + (r["case"],), KNOWN_SPILLS.get(key, 0))
        assert r["stack"] <= budget, f"{where} spills {r['stack']} B per thread (allowed {budget})"
        if not budget:
            assert r["spill_stores"] == 0, f"{where}: {r['spill_stores']} spill stores"
        if r["kernel"] in EXP2_ONLY:
            assert r["ex2"] > 0, f"{where}: no MUFU.EX2"
            assert r["ex2_subnormal"] == 0, f"{where}: {r['ex2_subnormal']} MUFU.EX2 with the subnormal fixup"
        if r["kernel"] in NO_EXPF:
            assert r["expf"] == 0, f"{where}: {r['expf']} libdevice expf sequences"
        if op in IO_OVER_MIN:
            ratio = r["op_io_bytes"] / r["op_min_bytes"]
            assert ratio <= IO_OVER_MIN[op], f"{where}: kernels move {ratio:.2f}x the op's minimum bytes"
        if r["kernel"] in ("cross_entropy_fwd", "cross_entropy_stats"):
            ratio = r["io_bytes"] / r["op_min_bytes"]
            assert ratio <= CE_FWD_OVER_MIN, f"{where}: the kernel moves {ratio:.2f}x the op's minimum bytes"
        if r["kernel"] in INST_PER_S and r["gpu"] in ("h200", "b200") and r["dtype"] == "bfloat16" and "x128" in r["case"]:
            assert r["inst_per_s"] is not None and r["inst_per_s"] <= INST_PER_S[r["kernel"]], (
                f"{where}: {r['inst_per_s']} main-loop instructions per S element (at most {INST_PER_S[r['kernel']]})")
        if r["kernel"] in PERSISTENT or (r["kernel"], r["dtype"]) in PERSISTENT_BY_DTYPE:
            assert 0.75 <= r["waves"] <= 1.0, f"{where}: persistent grid of {r['waves']:.2f} waves"
        if op in DOT_OPS:  # bf16, and f32 through TF32 or 3xTF32
            want = TENSOR_CORE[r["gpu"]]
            key = (r["kernel"], r["dtype"], r["case"])
            if want != "HMMA" and (key in MMA_SYNC or (r["gpu"] == "h200" and key in MMA_SYNC_SM90)):
                want = "HMMA"
            assert r["tensor_core"] == want, f"{where}: dots compile to {r['tensor_core']}, want {want}"
            if want != "HMMA":
                allowed = MIXED_MMA_SYNC.get((r["kernel"], r["dtype"], r["case"], r["gpu"]), 0)
                assert r["hmma"] <= allowed, f"{where}: {r['hmma']} mma.sync beside {want} (allowed {allowed})"


@pytest.mark.compile
@needs_compiler
def test_linear_cross_entropy_head_memory_on_h200():
    """The fused LM head's memory target: value and grad of the loss at T=8192, D=2048,
    V=32000 (bf16), compiled for an H200 with the Pallas kernels, take under 5% of the
    temporary memory of ``matmul`` + ``cross_entropy`` (33 vs 1000 MiB on 2026-12-02; the
    fused op's figure does not grow with V)."""
    import jax
    import jax.numpy as jnp

    import jaxbwd

    T, D, V = 8192, 2048, 32000
    args = (jax.ShapeDtypeStruct((T, D), jnp.bfloat16), jax.ShapeDtypeStruct((D, V), jnp.bfloat16),
            jax.ShapeDtypeStruct((T,), jnp.int32))

    def temp(loss):
        step = jax.value_and_grad(loss, argnums=(0, 1))
        return deviceless.compile_for(step, *args, gpu="h200").memory_analysis().temp_size_in_bytes

    fused = temp(lambda x, w, y: jaxbwd.linear_cross_entropy(x, w, y, implementation="pallas"))
    unfused = temp(lambda x, w, y: jaxbwd.cross_entropy(jaxbwd.matmul(x, w, implementation="pallas"), y,
                                                        implementation="pallas"))
    assert unfused > T * V * 2  # at least the bf16 logits
    assert fused < 0.05 * unfused, (fused / 2**20, unfused / 2**20)


SLOW_OP = '''
import time
import jax, jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
import jaxbwd
from jaxbwd.registry import Example


def fwd(x):
    if x.shape[0] == 4096:  # this case's compile hangs
        time.sleep(600)
    return x * x


def kernel(x_ref, dy_ref, dx_ref):
    dx_ref[...] = 2 * x_ref[...] * dy_ref[...]


def pallas_bwd(res, dy, *, interpret):
    b = pl.BlockSpec((8, 128), lambda i, j: (i, j))
    return (pl.pallas_call(kernel, name="hang_test_bwd", grid=(res[0].shape[0] // 8, res[0].shape[1] // 128),
                           in_specs=[b, b], out_specs=b, out_shape=jax.ShapeDtypeStruct(dy.shape, dy.dtype),
                           interpret=interpret, compiler_params=pltriton.CompilerParams(num_warps=4))(res[0], dy),)


op = jaxbwd.define_op("hang_test", forward=fwd, backward=lambda res, dy: (2 * res[0] * dy,),
                      pallas_backward=pallas_bwd, kernels=("hang_test_bwd",))
SPEC = op.spec(reference=lambda x: x * x, examples=[Example("8x128", lambda k, dt: ((jnp.ones((8, 128), dt),), {}))],
               lowering=[Example(f"{r}x1024", lambda k, d, r=r: ((jax.ShapeDtypeStruct((r, 1024), jnp.float32),), {}))
                         for r in (4096, 1024)])
'''


@pytest.mark.compile
@needs_compiler
def test_a_timed_out_case_does_not_fail_the_next(tmp_path, monkeypatch):
    """The worker of a timed-out case is killed; the next case gets a fresh one (it was sent
    to the killed process and reported as a crash)."""
    (tmp_path / "hang.py").write_text(SLOW_OP)
    monkeypatch.setattr(registry, "REGISTRY", dict(registry.REGISTRY))
    monkeypatch.setenv(registry.LOADED_ENV, "")
    registry.load(f"{tmp_path / 'hang.py'}:SPEC")
    case_list = deviceless.cases(["hang_test"], dtypes=("float32",), gpus=("h200",))
    assert [c.shape_name for c in case_list] == ["4096x1024", "1024x1024"]
    report = deviceless.run(case_list, jobs=1, timeout=20)
    assert report["failures"] == [{"case": case_list[0].id, "error": "timed out after 20 s"}]
    assert {r["kernel"] for r in report["rows"]} == {"hang_test_bwd"}
