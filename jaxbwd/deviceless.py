"""Compile jaxbwd's Pallas kernels for real GPUs on a machine without one, and read their
machine code (``python -m jaxbwd compile``).

XLA's GPU compiler runs *deviceless*: given a target description of a GPU (a
``GpuTargetConfigProto``: SM count, compute capability, shared memory, registers), the CUDA
PJRT plugin compiles a jitted function for that GPU on a CPU-only machine, running XLA's
bundled Triton for the Pallas kernels and linking with nvJitLink, exactly as it would on the
GPU. This module drives that compiler over the registry's realistic lowering shapes and reads
every figure from what XLA wrote:

- the kernel cache file XLA writes (``xla_gpu_kernel_cache_file``): for each kernel its
  launch grid, threads per block, dynamic shared memory, the Triton configuration
  (``num_warps``, ``num_stages``) and the cubin;
- ``cuobjdump -res-usage`` of that cubin: registers per thread, stack frame (where spills
  go), static shared memory and local memory;
- ``cuobjdump -sass``: the SASS instruction mix (tensor-core ``HGMMA``/``HMMA``/``UTC*MMA``,
  ``MUFU.EX2``, spill stores ``STL``, libdevice ``expf`` sequences).

Occupancy (blocks and warps per SM, and what limits them) and waves over the SM count are
computed from those figures and the target's published limits with CUDA's occupancy rules
(register allocation per warp in units of 256, four SM sub-partitions, 1 KiB of shared
memory reserved per block); ``bytes``/``flops`` are the kernel's own ``pallas_call`` cost
estimate next to the kernel's minimum bytes (each operand read once and each result written
once).

What it needs: the CUDA PJRT plugin and three small NVIDIA wheels (``pip install -e
".[compile]"``: jax-cuda13-plugin/pjrt, nvJitLink, cuobjdump, nvdisasm, about 195 MB to
download), on Python >= 3.12 with jax 0.12.1. XLA's flags are per process, so compiles run
in worker processes (``jobs`` of them); each compile writes its own kernel cache file.

This is the one module that knows about XLA's GPU compiler, its cache format and NVIDIA's
tools; the registry stays the single list of what is compiled.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib.util
import json
import math
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from typing import Any, Callable, Iterable, Optional, Sequence

# ----------------------------------------------------------------------------- targets


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """A GPU to compile for, described by its published limits.

    Figures from NVIDIA's H100/H200/A100/B200 datasheets and the CUDA C++ Programming Guide's
    table of compute-capability limits (max 2048 threads, 32 blocks and 64K 32-bit registers
    per SM on sm_80/sm_90/sm_100).
    """

    name: str
    device_kind: str
    sm: int  # compute capability major*10 + minor
    arch: str  # the architecture XLA compiles for ("sm_90a")
    core_count: int  # SMs
    smem_per_sm: int  # bytes of shared memory an SM can give to blocks
    smem_per_block_optin: int  # bytes one block may use (opt-in limit)
    memory_bandwidth: int  # bytes/s
    clock_rate_ghz: float
    l2_cache_size: int
    device_memory_size: int
    regs_per_sm: int = 65536
    max_threads_per_sm: int = 2048
    max_blocks_per_sm: int = 32
    reserved_smem_per_block: int = 1024

    @property
    def max_warps_per_sm(self) -> int:
        return self.max_threads_per_sm // 32

    def target_config(self) -> str:
        """The ``stream_executor.GpuTargetConfigProto`` text XLA compiles against."""
        major, minor = divmod(self.sm, 10)
        return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {self.smem_per_sm}
  threads_per_core_limit: {self.max_threads_per_sm}
  core_count: {self.core_count}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {self.memory_bandwidth}
  l2_cache_size: {self.l2_cache_size}
  clock_rate_ghz: {self.clock_rate_ghz}
  device_memory_size: {self.device_memory_size}
  shared_memory_per_block_optin: {self.smem_per_block_optin}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: {self.regs_per_sm}
  registers_per_block_limit: 65536
  thread_dim_limit_x: 1024
  thread_dim_limit_y: 1024
  thread_dim_limit_z: 64
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 10 patch: 0 }}
device_description_str: "{self.device_kind}"
"""


GPUS: dict[str, GpuTarget] = {
    t.name: t
    for t in (
        GpuTarget("h200", "NVIDIA H200", 90, "sm_90a", 132, 233472, 232448, 4_800_000_000_000, 1.98,
                  50 * 2**20, 141 * 10**9),
        GpuTarget("h100", "NVIDIA H100 80GB HBM3", 90, "sm_90a", 132, 233472, 232448, 3_350_000_000_000, 1.98,
                  50 * 2**20, 80 * 2**30),
        GpuTarget("a100", "NVIDIA A100-SXM4-80GB", 80, "sm_80", 108, 167936, 166912, 2_039_000_000_000, 1.41,
                  40 * 2**20, 80 * 2**30),
        GpuTarget("b200", "NVIDIA B200", 100, "sm_100a", 148, 233472, 232448, 8_000_000_000_000, 1.965,
                  126 * 2**20, 180 * 10**9),
    )
}

# --------------------------------------------------------------------- requirements

# (import name, pip package) of what a deviceless compile needs.
_REQUIRED = (
    ("jax_plugins.xla_cuda13", "jax-cuda13-pjrt"),
    ("jax_cuda13_plugin", "jax-cuda13-plugin"),
)
_TOOLS = (("cuobjdump", "nvidia-cuda-cuobjdump"), ("nvdisasm", "nvidia-cuda-nvdisasm"))
_LIBS = (("libnvJitLink.so", "nvidia-nvjitlink"),)
INSTALL_HINT = 'pip install -e ".[compile]"  (Python >= 3.12; brings jax 0.12.1\'s CUDA plugin and NVIDIA\'s cuobjdump/nvdisasm/nvJitLink)'


def _nvidia_dirs(sub: str) -> list[str]:
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return []
    out = []
    for root in spec.submodule_search_locations:
        for d in sorted(os.listdir(root)):
            p = os.path.join(root, d, sub)
            if os.path.isdir(p):
                out.append(p)
    return out


def tool_path(name: str) -> Optional[str]:
    """Path of NVIDIA tool ``name`` from its pip wheel (``nvidia/cu*/bin``) or the PATH."""
    for d in _nvidia_dirs("bin"):
        p = os.path.join(d, name)
        if os.access(p, os.X_OK):
            return p
    return shutil.which(name)


def missing_requirements() -> list[str]:
    """The pip packages a deviceless compile needs that are not installed ([] when ready)."""
    missing = []
    for mod, pkg in _REQUIRED:
        try:
            found = importlib.util.find_spec(mod) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            missing.append(pkg)
    for tool, pkg in _TOOLS:
        if tool_path(tool) is None:
            missing.append(pkg)
    for lib, pkg in _LIBS:
        if not any(f.startswith(lib) for d in _nvidia_dirs("lib") for f in os.listdir(d)):
            missing.append(pkg)
    if sys.version_info < (3, 12):
        missing.append("Python >= 3.12 (jax 0.12's CUDA plugin)")
    return missing


# ----------------------------------------------------------------------------- cases


@dataclasses.dataclass(frozen=True)
class Case:
    """One compile: an op's lowering example, its float inputs cast to ``dtype``, for ``gpu``.

    ``mode`` "vjp" compiles the forward and the backward (the op's ``kernels``); "jvp" the
    forward and the tangent pass of ``jax.jvp`` (its ``jvp_kernels``), whose shape name
    starts with ``jvp:``; "primal" the op evaluated alone, not differentiated (its
    ``primal_kernels``), whose shape name starts with ``primal:``. ``precision`` (f32 only), when set, is the
    ``jax.default_matmul_precision`` the case is traced under, and its shape name starts with
    it: ``highest:`` compiles the f32 dots as 3xTF32 (``_common.dot``).
    """

    op: str
    example: int  # index into the op's ``lowering`` examples
    shape_name: str
    dtype: str
    gpu: str
    mode: str = "vjp"
    precision: Optional[str] = None

    @property
    def id(self) -> str:
        return f"{self.op}/{self.shape_name}/{self.dtype}/{self.gpu}"

    @property
    def kernels(self) -> tuple[str, ...]:
        """The registry's kernel names this case must produce."""
        from jaxbwd import registry

        spec = registry.get(self.op)
        return {"jvp": spec.jvp_kernels, "primal": spec.primal_kernels}.get(self.mode, spec.kernels)


DTYPES = ("float32", "bfloat16")


def _shape_name(name: str) -> str:
    # Lowering examples carry their own dtype in their name; the case's dtype column replaces it.
    return re.sub(r"-?(bf16|f32|f16|bfloat16|float32|float16)(?=-|$)", "", name).strip("-") or name


# jax.default_matmul_precision values a case may be compiled under (besides the default),
# and the ops whose kernels have f32 dots (_common.dot), the only ones it changes.
PRECISIONS = ("highest",)
MATMUL_OPS = ("dot_product_attention", "conv2d", "linear_cross_entropy")


def cases(ops: Optional[Sequence[str]] = None, dtypes: Sequence[str] = DTYPES,
          gpus: Sequence[str] = ("h200",), precisions: Sequence[Optional[str]] = (None,)) -> list[Case]:
    """Every (op, lowering example, dtype, gpu) to compile, from the registry: the forward
    and backward of each, the forward and tangent pass of ops with ``jvp_kernels``, and the
    op alone of ops with ``primal_kernels``;
    the f32 cases of ``MATMUL_OPS`` once per ``precisions`` entry (``None``: the default,
    TF32 dots; ``"highest"``: 3xTF32), every other case once, at the default.

    Examples that differ only in dtype collapse into one case per dtype. Raises ValueError
    for a precision not in ``PRECISIONS``.
    """
    bad = [p for p in precisions if p is not None and p not in PRECISIONS]
    if bad:
        raise ValueError(f"jaxbwd compile: unknown precision {bad[0]!r}; known: default, {', '.join(PRECISIONS)}")
    from jaxbwd import registry

    out, seen, names = [], set(), set()
    for spec in registry.ops(ops):
        if not spec.has_kernels:
            continue
        for i, ex in enumerate(spec.lowering):
            args, kwargs = ex.make(None, None)
            key = (spec.name, tuple(getattr(a, "shape", a) for a in args), repr(sorted(kwargs.items())))
            if key in seen:
                continue
            seen.add(key)
            name = _shape_name(ex.name)
            if (spec.name, name) in names:  # same shapes, other params
                name += "-" + ",".join(f"{k}={v}" for k, v in sorted(kwargs.items()))
            names.add((spec.name, name))
            for dt in dtypes:
                for p in (precisions if dt == "float32" and spec.name in MATMUL_OPS else (None,)):
                    at = f"{p}:" if p else ""
                    for g in gpus:
                        out.append(Case(spec.name, i, at + name, dt, g, precision=p))
                        if spec.jvp_kernels:
                            out.append(Case(spec.name, i, f"{at}jvp:{name}", dt, g, mode="jvp", precision=p))
                        if spec.primal_kernels:
                            out.append(Case(spec.name, i, f"{at}primal:{name}", dt, g, mode="primal", precision=p))
    return out


# ------------------------------------------------------------- reading XLA's outputs


def _varint(b: bytes, i: int) -> tuple[int, int]:
    r = s = 0
    while True:
        c = b[i]
        i += 1
        r |= (c & 0x7F) << s
        s += 7
        if not c & 0x80:
            return r, i


def _fields(b: bytes) -> list[tuple[int, Any]]:
    """Protobuf wire format: [(field number, int | bytes)] (no schema needed)."""
    out, i = [], 0
    while i < len(b):
        key, i = _varint(b, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            v, i = _varint(b, i)
        elif wire == 2:
            n, i = _varint(b, i)
            v, i = b[i:i + n], i + n
        elif wire == 1:
            v, i = b[i:i + 8], i + 8
        elif wire == 5:
            v, i = b[i:i + 4], i + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        out.append((num, v))
    return out


@dataclasses.dataclass
class CachedKernel:
    """One Triton kernel from XLA's kernel cache file (``CompilationCacheProto``)."""

    key: str  # the cache entry's name (unique in the module)
    name: str  # the pallas_call's name
    grid: tuple[int, int, int]
    num_warps: int
    num_stages: int
    threads_per_block: int
    dynamic_smem: int
    cubin: bytes


def read_kernel_cache(path: str) -> list[CachedKernel]:
    """The Triton kernels in an XLA kernel cache file.

    Layout (``xla/service/gpu/kernel_reuse_cache.proto``): entries ``map<string, Entry>``
    (field 1); an entry holds its fingerprint (1: for a Triton call, the call's configuration
    text with ``grid_*``, ``name``, ``num_warps``, ``num_stages``), launch dimensions (2:
    blocks, threads per block), cluster dimensions (3), dynamic shared memory (4) and the
    cubin (5). XLA's own fusions (no ``name = "..."`` in the fingerprint) are left out.

    Raises: OSError (FileNotFoundError...) when ``path`` cannot be read; ValueError for
    bytes that are not such a protobuf (an unsupported wire type).
    """
    with open(path, "rb") as f:
        data = f.read()
    kernels = []
    for num, entry in _fields(data):
        if num != 1 or not isinstance(entry, bytes):
            continue
        kv = dict(_fields(entry))
        key, val = kv.get(1, b"").decode(errors="replace"), dict(_fields(kv.get(2, b"")))
        fp = val.get(1, b"")
        name = re.search(rb'name = "([^"]+)"', fp)
        if name is None:
            continue
        grid = tuple(int(re.search(rb"grid_%s = (\d+)" % a, fp).group(1)) for a in (b"x", b"y", b"z"))
        launch = dict(_fields(val.get(2, b"")))
        kernels.append(CachedKernel(
            key=key, name=name.group(1).decode(), grid=grid,
            num_warps=int(re.search(rb"num_warps = (\d+)", fp).group(1)),
            num_stages=int(re.search(rb"num_stages = (\d+)", fp).group(1)),
            threads_per_block=int(launch.get(2, 0)), dynamic_smem=int(val.get(4, 0)),
            cubin=val.get(5, b""),
        ))
    return kernels


def resource_usage(cubin_path: str, function: str) -> dict[str, int]:
    """``cuobjdump -res-usage``: REG, STACK, SHARED, LOCAL of ``function`` in the cubin.

    A cubin may hold helper device functions too (sm_80's ``__cuda_sm70_shflsync_*``); only
    the kernel's own entry counts.

    Returns: ``{"registers", "stack", "static_smem", "local"}`` as ints (registers per
    thread; the others in bytes).

    Raises: FileNotFoundError when ``cuobjdump`` is not installed; RuntimeError when it
    fails or lists no resource line for ``function``.
    """
    out = _run_tool("cuobjdump", "-res-usage", cubin_path)
    m = re.search(r"Function %s:\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)" % re.escape(function), out)
    if m is None:
        raise RuntimeError(f"cuobjdump -res-usage has no resource line for {function}:\n{out}")
    return dict(zip(("registers", "stack", "static_smem", "local"), map(int, m.groups())))


_SASS_LINE = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)", re.M)


def sass_mix(cubin_path: str, function: str) -> dict[str, int]:
    """Static SASS instruction counts of ``function`` (``cuobjdump -sass``), NOPs excluded.

    ``expf``: libdevice ``expf`` call sites, counted by the ``FFMA.RM`` of their range
    reduction (``exp2`` maps to a bare ``MUFU.EX2`` and has none). ``ex2_subnormal``: the
    ``MUFU.EX2`` that PTX ``ex2.approx.f32`` (``jnp.exp2``) brings with its subnormal-result
    fixup, counted by that fixup's compare of the argument against -126 (``ex2.approx.ftz``,
    ``_common.exp2``, has none). ``spill_stores`` and
    ``spill_loads`` count ``STL``/``LDL``: local-memory traffic, which in these kernels is
    register spilling.

    Raises: FileNotFoundError when ``cuobjdump`` is not installed; RuntimeError when it
    fails or shows no function ``function``.
    """
    sass = _run_tool("cuobjdump", "-sass", cubin_path)
    parts = re.split(r"^\s*Function : (\S+)\s*$", sass, flags=re.M)
    body = dict(zip(parts[1::2], parts[2::2])).get(function)
    if body is None:
        raise RuntimeError(f"cuobjdump -sass shows no function {function}")
    ops = [o for o in _SASS_LINE.findall(body) if o != "NOP"]
    base = Counter(o.split(".")[0] for o in ops)
    loop = main_loop(body) or {"loop_sass": 0, "loop_tc": 0, "loop_ex2": 0}
    return {
        **loop,
        "sass": len(ops),
        "hgmma": base["HGMMA"],  # sm_90 warpgroup MMA (wgmma)
        "hmma": base["HMMA"],  # sm_80-style warp MMA (mma.sync)
        "utcmma": sum(n for op, n in base.items() if _is_utcmma(op)),  # sm_100 tcgen05
        "ex2": sum(o.startswith("MUFU.EX2") for o in ops),
        "expf": sum(o.startswith("FFMA.RM") for o in ops),
        "ex2_subnormal": len(_EX2_SUBNORMAL_CHECK.findall(body)),
        "spill_stores": base["STL"],
        "spill_loads": base["LDL"],
    }


_EX2_SUBNORMAL_CHECK = re.compile(
    r"\bFSETP\.GEU\.AND\s+U?P\d+,\s*U?PT,\s*\|?-?R\d+(?:\.reuse)?\|?,\s*-126,\s*U?PT\b")
_SASS_INSTR = re.compile(
    r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);", re.M)


def _is_utcmma(base: str) -> bool:
    """sm_100's tcgen05 MMAs: ``UTCHMMA`` (16-bit), ``UTCQMMA``, ... (``UTC*MMA``)."""
    return base.startswith("UTC") and base.endswith("MMA")


def _is_tensor_core_op(op: str) -> bool:
    """A SASS opcode of the tensor cores: sm_90 wgmma (``HGMMA``), mma.sync (``HMMA``) or tcgen05."""
    base = op.split(".")[0]
    return base in ("HGMMA", "HMMA") or _is_utcmma(base)


def main_loop(sass_body: str) -> Optional[dict[str, int]]:
    """The kernel's main loop in its SASS, or ``None`` when no loop holds a tensor-core op.

    Counting rule: a loop is a backward branch (``BRA`` to a lower address) and its body
    the instructions from the target to the branch, inclusive. The main loop is the
    innermost loop whose body holds a tensor-core op (``HGMMA``, ``HMMA``, sm_100's
    ``UTC*MMA``; no smaller such loop inside it);
    where a kernel has several (an unmasked and a masked copy of its loop), the one with the
    fewest instructions, which is the copy that runs on all but the edge blocks. Its
    instruction count (NOPs excluded) is what every thread issues per iteration.
    """
    instrs = [(int(a, 16), op, rest) for a, op, rest in _SASS_INSTR.findall(sass_body)]
    loops = []
    for addr, op, rest in instrs:
        if op.split(".")[0] == "BRA":
            m = re.search(r"0x([0-9a-f]+)", rest)
            if m and int(m.group(1), 16) < addr:
                loops.append((int(m.group(1), 16), addr))
    tc = [a for a, op, _ in instrs if _is_tensor_core_op(op)]
    with_tc = [(lo, hi) for lo, hi in loops if any(lo <= a <= hi for a in tc)]
    if not with_tc:
        return None
    innermost = [(lo, hi) for lo, hi in with_tc
                 if not any((l2, h2) != (lo, hi) and lo <= l2 and h2 <= hi for l2, h2 in with_tc)]
    lo, hi = min(innermost, key=lambda r: r[1] - r[0])
    body = [op for a, op, _ in instrs if lo <= a <= hi and op != "NOP"]
    return {"loop_sass": len(body), "loop_tc": sum(map(_is_tensor_core_op, body)),
            "loop_ex2": sum(op.startswith("MUFU.EX2") for op in body)}


def _run_tool(tool: str, *args: str) -> str:
    path = tool_path(tool)
    if path is None:
        raise FileNotFoundError(f"{tool} not found; install it: {INSTALL_HINT}")
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(path) + os.pathsep + env.get("PATH", "")  # cuobjdump finds nvdisasm
    r = subprocess.run([path, *args], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"{tool} {' '.join(args)} failed: {r.stderr.strip()}")
    return r.stdout


def occupancy(target: GpuTarget, *, registers: int, threads_per_block: int, smem_per_block: int) -> dict[str, Any]:
    """Resident blocks and warps per SM and the limiting resource (CUDA occupancy rules).

    Registers are allocated per warp in units of 256 and per SM sub-partition (four of
    ``regs_per_sm / 4``); each block also takes ``reserved_smem_per_block`` of shared memory.
    """
    warps = max(1, math.ceil(threads_per_block / 32))
    regs_per_warp = math.ceil(max(registers, 1) * 32 / 256) * 256
    warps_by_regs = 4 * ((target.regs_per_sm // 4) // regs_per_warp)
    smem = smem_per_block + target.reserved_smem_per_block
    limits = {
        "registers": warps_by_regs // warps,
        "shared memory": target.smem_per_sm // smem if smem_per_block else target.max_blocks_per_sm,
        "threads": target.max_warps_per_sm // warps,
        "blocks": target.max_blocks_per_sm,
    }
    if smem_per_block > target.smem_per_block_optin:
        limits["shared memory"] = 0
    blocks = min(limits.values())
    # On a tie the hard per-SM caps are named first: they cannot be tuned away.
    limiter = min(("threads", "blocks", "registers", "shared memory"), key=lambda k: limits[k])
    return {"blocks_per_sm": blocks, "warps_per_sm": blocks * warps,
            "occupancy": blocks * warps / target.max_warps_per_sm, "limiter": limiter}


# -------------------------------------------------------------- compiling one case


def _nbytes(aval) -> int:
    return math.prod(aval.shape) * aval.dtype.itemsize if hasattr(aval, "shape") else 0


def hijax_expansion(eqn):
    """The jaxpr a hijax primitive's equation expands to (jaxbwd's ops under forward mode,
    ``_Fwd`` and ``_Tangent``, keep their kernels there; printed jaxprs do not show it), or
    ``None`` for any other equation. Traced from shapes and dtypes only: the avals carry the
    mesh of their own trace, not the one in context."""
    import jax

    prim = eqn.params.get("_prim")
    if not (hasattr(prim, "expand") and hasattr(prim, "in_tree")):
        return None
    leaves = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]
    return jax.make_jaxpr(prim.expand)(*jax.tree_util.tree_unflatten(prim.in_tree, leaves)).jaxpr


def _kernel_calls(jaxpr) -> list[dict[str, Any]]:
    """Every ``pallas_call`` in a (closed) jaxpr, nested jaxprs included: its name, grid,
    cost estimate and minimum bytes (operands read once, results written once)."""
    from jax.extend import core as jex_core

    found = []

    def walk(jx):
        for eqn in jx.eqns:
            if eqn.primitive.name == "pallas_call":
                p = eqn.params
                info = p.get("name_and_src_info")
                cost = p.get("cost_estimate")
                gm = p.get("grid_mapping")
                found.append({
                    "name": getattr(info, "name", None) or p.get("name", "?"),
                    "grid": tuple(int(g) for g in getattr(gm, "grid", ())),
                    "flops": int(getattr(cost, "flops", 0) or 0),
                    "bytes_accessed": int(getattr(cost, "bytes_accessed", 0) or 0),
                    "io_bytes": sum(_nbytes(v.aval) for v in eqn.invars) + sum(_nbytes(v.aval) for v in eqn.outvars),
                    "metadata": dict(p.get("metadata") or {}),
                })
            expansion = hijax_expansion(eqn)
            if expansion is not None:
                walk(expansion)
            for v in eqn.params.values():
                for sub in v if isinstance(v, (tuple, list)) else (v,):
                    if isinstance(sub, jex_core.ClosedJaxpr):
                        walk(sub.jaxpr)
                    elif isinstance(sub, jex_core.Jaxpr):
                        walk(sub)

    walk(jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") else jaxpr)
    return found


def _case_function(case: Case):
    """``bwd(*arrays, ct)``: the op's forward and backward (its vjp applied to the cotangent
    ``ct``); its inputs as ShapeDtypeStructs; the op's minimum bytes.

    The cotangent is an argument, as in training, so that XLA does not fold a constant into
    the backward and the op's minimum bytes are well defined: every array input and ``ct``
    read once, every gradient written once. For a "jvp" case the function is
    ``jvp(*arrays, *tangents) -> (out, tangent_out)`` and the minimum bytes are the inputs and
    tangents read once, the output and its tangent written once. For a "primal" case the
    function is the op alone, its minimum bytes the inputs read and the output written once.
    """
    import jax
    import jax.numpy as jnp

    from jaxbwd import registry

    spec = registry.get(case.op)
    args, kwargs = spec.lowering[case.example].make(None, None)
    dt = jnp.dtype(case.dtype)

    def place(a):
        if isinstance(a, jax.ShapeDtypeStruct):
            d = dt if jnp.issubdtype(a.dtype, jnp.floating) else a.dtype
            return jax.ShapeDtypeStruct(a.shape, d)
        return a

    args = [place(a) for a in args]
    array_idx = [i for i, a in enumerate(args) if isinstance(a, jax.ShapeDtypeStruct)]

    def forward(*arrays):
        full = list(args)
        for i, a in zip(array_idx, arrays):
            full[i] = a
        return spec.bind(full, kwargs, implementation="pallas"), [full[i] for i in spec.diff_argnums]

    def bwd(*arrays_and_ct):
        *arrays, ct = arrays_and_ct
        f, diff = forward(*arrays)
        _, vjp = jax.vjp(f, *diff)
        return vjp(ct)

    def primal(*arrays):
        f, diff = forward(*arrays)
        return f(*diff)

    def jvp(*arrays_and_tangents):
        arrays, tangents = arrays_and_tangents[:len(array_idx)], arrays_and_tangents[len(array_idx):]
        f, diff = forward(*arrays)
        return jax.jvp(f, tuple(diff), tuple(tangents))

    from jaxbwd import config

    arrays = [args[i] for i in array_idx]
    # Shapes only: no kernel is built for a device here. Both backends give the same shapes;
    # Triton's interpreter is traced, as Mosaic's would refuse a small CPU pool
    # (pallas/mosaic/_mgpu.py, check_interpreter_threads) although nothing runs.
    with config.use(interpret=True, pallas_backend="triton"):
        if case.mode == "jvp":
            _, diff = forward(*arrays)
            arrays += [jax.ShapeDtypeStruct(d.shape, d.dtype) for d in diff]
            outs = jax.eval_shape(jvp, *arrays)
            return jvp, arrays, sum(_nbytes(a) for a in arrays) + sum(_nbytes(o) for o in outs)
        out = jax.eval_shape(primal, *arrays)
        if case.mode == "primal":
            return primal, arrays, sum(_nbytes(a) for a in arrays) + _nbytes(out)
        arrays.append(jax.ShapeDtypeStruct(out.shape, out.dtype))
        grads = jax.eval_shape(bwd, *arrays)
    op_min_bytes = sum(_nbytes(a) for a in arrays) + sum(_nbytes(g) for g in grads)
    return bwd, arrays, op_min_bytes


_TOPOLOGIES: dict[str, Any] = {}


def _device(target: GpuTarget):
    from jax.experimental import topologies

    if target.name not in _TOPOLOGIES:
        _TOPOLOGIES[target.name] = topologies.get_topology_desc(
            platform="cuda", target_config=target.target_config(), topology="1x1x1")
    return _TOPOLOGIES[target.name].devices[0]


@contextlib.contextmanager
def _targeting(target: GpuTarget):
    """While active, traces build the Pallas kernels for ``target`` (not interpreted); yields
    the sharding that places a jitted function's arguments on its abstract device."""
    import warnings

    import jax

    from jaxbwd import config
    from jaxbwd.pallas import _common

    mesh = jax.sharding.Mesh([_device(target)], ("x",))
    with config.use(interpret=False), _common.abstract_gpu(target.device_kind, target.core_count), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        yield jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def compile_for(fn, *args, gpu: str = "h200"):
    """``jax.jit(fn)`` compiled for ``gpu`` (a key of :data:`GPUS`) by XLA's GPU compiler on
    this machine, with the Pallas kernels built for that GPU: the compiled executable, e.g.
    for ``.memory_analysis()``. Nothing runs. ``args``: arrays or ``jax.ShapeDtypeStruct``s.
    Needs the ``[compile]`` extra; raises ``KeyError`` for an unknown ``gpu``."""
    import jax

    with _targeting(GPUS[gpu]) as sharding:
        return jax.jit(fn, in_shardings=sharding).trace(*args).lower().compile()


def _s_tile(call) -> Optional[list[int]]:
    """The [rows, cols] of the score tile S one main-loop iteration computes, as an attention
    kernel declares it (``pallas_call`` metadata ``s_tile = "RxC"``), else ``None``."""
    tile = (call.get("metadata") or {}).get("s_tile")
    return [int(v) for v in tile.split("x")] if tile else None


def _inst_per_s(mix, threads: int, call) -> Optional[float]:
    """Main-loop SASS instructions per unique S element: the loop's instructions per thread
    per iteration (``main_loop``) over the S elements each thread owns uniquely, R*C/threads
    (a warpgroup that recomputes another's rows owns none of its own: the figure doubles),
    times the programs that compute the same tile (metadata ``s_repeats``: an attention
    kernel whose head dim is split between programs, each recomputing S)."""
    tile = _s_tile(call)
    if not tile or not mix.get("loop_sass"):
        return None
    repeats = int((call.get("metadata") or {}).get("s_repeats", 1))
    return round(mix["loop_sass"] * threads * repeats / (tile[0] * tile[1]), 1)


# Mosaic GPU kernels (``pallas_backend="mosaic"``) are not in XLA's kernel cache: jaxlib's
# Mosaic compiler turns each one into PTX and runs ptxas (for sm_90a) while the program is
# lowered, and the ``mosaic_gpu_v2`` custom call carries the result. Its own dump switches
# (read per compile) write what ptxas reported, the PTX and the shared-memory plan.
_MOSAIC_DUMP_ENV = ("MOSAIC_GPU_DUMP_PTX", "MOSAIC_GPU_DUMP_PTXAS", "MOSAIC_GPU_DUMP_RESOURCES")


def mosaic_rows(dump_dir: str) -> list[dict[str, Any]]:
    """Per Mosaic GPU kernel found in ``dump_dir`` (``MOSAIC_GPU_DUMP_TO``): its name, threads
    per block (PTX ``.maxntid``), registers, stack, spill bytes and static shared memory
    (ptxas), dynamic shared memory (Mosaic's resource plan) and, counted in the PTX,
    ``wgmma.mma_async`` (-> ``hgmma``), ``ex2.approx`` (``ex2_subnormal``: those without
    ``.ftz``, which ptxas wraps in the subnormal fixup) and ``tanh.approx`` (MUFU.TANH, a
    softcap's tanh under ``approx_math``) instructions. No SASS: there is no
    cubin to read, so ``sass``/``expf`` are not known and the spill counts are ptxas's bytes."""
    files = sorted(os.listdir(dump_dir)) if os.path.isdir(dump_dir) else []
    kernel_of = lambda f: re.sub(r"_\d+\.[a-z_.]+$", "", f)  # noqa: E731  "attention_fwd_mosaic_0.ptx"
    rows = {}
    for f in files:
        path = os.path.join(dump_dir, f)
        name = kernel_of(f)
        row = rows.setdefault(name, {"kernel": name})
        if f.endswith(".ptxas"):
            text = open(path, errors="replace").read()
            num = lambda pat: int(m.group(1)) if (m := re.search(pat, text)) else 0  # noqa: E731
            # "used N registers" (jax 0.12.0.1's Mosaic GPU), "Used N registers" (0.12.1's).
            row.update(registers=num(r"(?i)used (\d+) registers"), stack=num(r"(\d+) bytes stack frame"),
                       spill_stores=num(r"(\d+) bytes spill stores"), spill_loads=num(r"(\d+) bytes spill loads"),
                       static_smem=num(r"(?i)info\s+: used .* (\d+) bytes smem"), local=0,
                       wgmma_serialized="wgmma.mma_async instructions are serialized" in text,
                       setmaxnreg_ignored="'setmaxnreg' ignored" in text)
        elif f.endswith(".ptx"):
            text = open(path, errors="replace").read()
            m = re.search(r"\.maxntid (\d+)", text)
            row.update(threads=int(m.group(1)) if m else 0, hgmma=text.count("wgmma.mma_async"),
                       ex2=text.count("ex2.approx"), ex2_subnormal=text.count("ex2.approx.f32"),
                       tanh_approx=text.count("tanh.approx"))
        elif f.endswith(".resources.txt"):
            m = re.search(r"smem_scratch_bytes=(\d+)", open(path).read())
            row["dynamic_smem"] = int(m.group(1)) if m else 0
    return [r for r in rows.values() if "registers" in r]


def compile_case(case: Case, workdir: str) -> list[dict[str, Any]]:
    """Compiles one case for its GPU without a GPU and returns one row per Pallas kernel
    (Triton kernels from XLA's kernel cache, Mosaic GPU kernels from Mosaic's dumps)."""
    import jax

    target = GPUS[case.gpu]
    with jax.default_matmul_precision(case.precision) if case.precision else contextlib.nullcontext():
        return _compile_case(case, workdir, target)


def _compile_case(case: Case, workdir: str, target: GpuTarget) -> list[dict[str, Any]]:
    import jax

    fn, arrays, op_min_bytes = _case_function(case)
    cache = os.path.join(workdir, re.sub(r"[^A-Za-z0-9_.-]", "_", case.id) + f".{time.monotonic_ns()}.kcache")
    mosaic_dir = os.path.join(workdir, "mosaic")
    shutil.rmtree(mosaic_dir, ignore_errors=True)
    os.makedirs(mosaic_dir)
    os.environ.update({k: "1" for k in _MOSAIC_DUMP_ENV}, MOSAIC_GPU_DUMP_TO=mosaic_dir)
    with _targeting(target) as sharding:
        # keep_unused: a backward that never reads an input (bias_add's x) still takes it.
        traced = jax.jit(fn, in_shardings=sharding, keep_unused=True).trace(*arrays)
        calls = _kernel_calls(traced.jaxpr)
        t0 = time.perf_counter()
        traced.lower().compile(compiler_options={"xla_gpu_kernel_cache_file": cache})
        seconds = time.perf_counter() - t0
    rows = []
    for k in read_kernel_cache(cache):
        cubin = cache + "." + re.sub(r"[^A-Za-z0-9_.-]", "_", k.key) + ".cubin"
        with open(cubin, "wb") as f:
            f.write(k.cubin)
        res, mix = resource_usage(cubin, k.name), sass_mix(cubin, k.name)
        same = [c for c in calls if c["name"] == k.name]
        call = next((c for c in same if math.prod(c["grid"] or (1,)) == math.prod(k.grid)), same[0] if same else {})
        smem = k.dynamic_smem + res["static_smem"]
        occ = occupancy(target, registers=res["registers"], threads_per_block=k.threads_per_block, smem_per_block=smem)
        grid_blocks = math.prod(k.grid)
        per_wave = occ["blocks_per_sm"] * target.core_count
        rows.append({
            "op": case.op, "case": case.shape_name, "dtype": case.dtype, "gpu": case.gpu, "arch": target.arch,
            "kernel": k.name, "grid": list(k.grid), "blocks": grid_blocks,
            "num_warps": k.num_warps, "num_stages": k.num_stages, "threads": k.threads_per_block,
            **res, "smem": smem, **occ,
            "waves": grid_blocks / per_wave if per_wave else math.inf,
            **mix,
            "tensor_core": next((kind for kind, key in (("HGMMA", "hgmma"), ("UTCMMA", "utcmma"), ("HMMA", "hmma"))
                                 if mix[key]), "none"),
            "s_tile": _s_tile(call), "inst_per_s": _inst_per_s(mix, k.threads_per_block, call),
            "flops": call.get("flops"), "bytes_accessed": call.get("bytes_accessed"),
            "io_bytes": call.get("io_bytes"), "op_min_bytes": op_min_bytes,
            "compile_s": round(seconds, 2),
        })
    for m in mosaic_rows(mosaic_dir):
        smem = m.get("dynamic_smem", 0) + m["static_smem"]
        threads = m.get("threads", 0)
        occ = occupancy(target, registers=m["registers"], threads_per_block=threads, smem_per_block=smem)
        same = [c for c in calls if c["name"] == m["kernel"]]
        call = same[0] if same else {}
        rows.append({
            "op": case.op, "case": case.shape_name, "dtype": case.dtype, "gpu": case.gpu, "arch": target.arch,
            "kernel": m["kernel"], "grid": list(call.get("grid") or ["?"]), "blocks": 0,
            "num_warps": threads // 32, "num_stages": "mgpu", "threads": threads,
            "registers": m["registers"], "stack": m["stack"], "static_smem": m["static_smem"], "local": 0,
            "smem": smem, **occ, "waves": math.nan,
            "sass": "-", "hgmma": m.get("hgmma", 0), "hmma": 0, "utcmma": 0, "ex2": m.get("ex2", 0), "expf": "-",
            "ex2_subnormal": m.get("ex2_subnormal", 0), "tanh_approx": m.get("tanh_approx", 0),
            "spill_stores": m["spill_stores"], "spill_loads": m["spill_loads"],
            "wgmma_serialized": m["wgmma_serialized"], "setmaxnreg_ignored": m["setmaxnreg_ignored"],
            "tensor_core": "HGMMA" if m.get("hgmma") else "none",
            "flops": call.get("flops"), "bytes_accessed": call.get("bytes_accessed"),
            "io_bytes": call.get("io_bytes"), "op_min_bytes": op_min_bytes, "compile_s": round(seconds, 2),
        })
    shutil.rmtree(mosaic_dir, ignore_errors=True)
    total_io = sum(c["io_bytes"] for c in calls)
    for r in rows:
        r["op_io_bytes"] = total_io
    for f in os.listdir(workdir):
        if f.startswith(os.path.basename(cache)):
            os.remove(os.path.join(workdir, f))
    return rows


# ------------------------------------------------------------------ worker processes


_READY = '{"ready": true}'  # a worker's first line, once its imports are done


def _worker_main(workdir: str) -> int:
    """A compile worker: says ``{"ready": true}`` once its imports are done, then reads one
    JSON case per stdin line and answers one JSON line each. ``workdir`` is made and removed
    by the parent: a worker killed for a timeout or a signal cleans nothing up itself."""
    # The protocol goes through a private copy of fd 1; fd 1 itself (print, and C-level writes
    # of XLA, ptxas or a user module's extension) is pointed at stderr, so nothing else
    # printed can break it.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    import jax

    from jaxbwd import registry

    # Imports and the CPU backend before "ready": a case's timer starts then, and pays for none of it.
    importlib.import_module("jaxbwd.pallas")
    registry.load_from_env()  # user ops named by import path in the parent (--ops module:ATTR)
    jax.devices()
    out.write(_READY + "\n")
    out.flush()
    for line in sys.stdin:
        case = Case(**json.loads(line))
        try:
            msg = {"case": case.id, "rows": compile_case(case, workdir)}
        except Exception as e:  # reported per case; the run goes on
            msg = {"case": case.id, "error": f"{type(e).__name__}: {e}".strip()[:2000]}
        out.write(json.dumps(msg) + "\n")
        out.flush()
    return 0


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "JAX_PLATFORMS": "cpu",  # the host runs on CPU; the GPU exists only as a target
        "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1",  # no CUDA driver to check against
        "TF_CPP_MIN_LOG_LEVEL": env.get("TF_CPP_MIN_LOG_LEVEL", "2"),
        "JAXBWD_INTERPRET": "0",
    })
    env.pop("JAXBWD_IMPLEMENTATION", None)
    return env


# The worker's command line; its working folder is appended. A module attribute, so that the
# tests can put a stand-in worker here and test the process handling without the compiler.
WORKER_CMD = [sys.executable, "-c",
              "import sys; from jaxbwd import deviceless; sys.exit(deviceless._worker_main(sys.argv[1]))"]


class _Worker:
    """One compile worker process, its working folder (made here, removed when the process
    is reaped, however it ended) and a thread that queues its answer lines ("" at its end)."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="jaxbwd-compile-")
        try:
            self.proc = subprocess.Popen([*WORKER_CMD, self.dir], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, text=True, env=_worker_env())
        except BaseException:  # no process to reap: the folder goes now
            shutil.rmtree(self.dir, ignore_errors=True)
            raise
        self.lines: "queue.Queue[str]" = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")

    def answer(self, timeout: float) -> Optional[str]:
        """The next line, "" when the worker has ended, None after ``timeout`` seconds."""
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self, kill: bool = False) -> Optional[int]:
        """Ends the worker (closing its stdin lets it finish; ``kill`` does not wait for
        that), reaps it, removes its folder; its exit code. Safe to call twice."""
        if kill:
            self.proc.kill()  # nothing once it has been reaped
        else:
            with contextlib.suppress(OSError):  # a dead worker's pipe
                self.proc.stdin.close()
        code = self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
        return code


# Seconds a worker may take to start (import jax and jaxbwd) when ``timeout`` is shorter: a
# timeout sized for one case's compile must not fail a start-up slowed by a busy machine.
STARTUP_TIMEOUT = 300.0


def worker_count(jobs: Optional[int], n_cases: int) -> int:
    """How many worker processes :func:`run` starts for ``n_cases`` cases."""
    return max(1, min(jobs or os.cpu_count() or 1, n_cases or 1))


class Stopped(SystemExit):
    """:func:`run` ended by SIGTERM or SIGHUP; ``code`` is 128 + the signal's number, the
    default action's exit status, and ``signame`` its name (the command line prints it once
    its progress bar is closed)."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signame = signal.Signals(signum).name


def _raise_exit(signum, frame):
    for s in (signal.SIGTERM, signal.SIGHUP):  # a second signal must not interrupt run's cleanup
        signal.signal(s, signal.SIG_IGN)
    raise Stopped(signum)


def _answer(line: str) -> Optional[dict]:
    """A worker's JSON answer (``{"rows": ...}`` or ``{"error": ...}``), or None for anything else."""
    try:
        msg = json.loads(line)
    except ValueError:
        return None
    return msg if isinstance(msg, dict) and ("rows" in msg or "error" in msg) else None


def run(case_list: Sequence[Case], *, jobs: Optional[int] = None, timeout: float = 900.0,
        progress: Optional[Callable[[Case, dict], None]] = None) -> dict[str, Any]:
    """Compiles ``case_list`` in ``jobs`` worker processes (default: one per CPU core).

    Returns ``{"rows": [...], "failures": [{"case", "error"}], "meta": {...}}``; a case whose
    worker crashed or ran past ``timeout`` seconds is a failure, and the run goes on. A case's
    time starts once its worker is ready (its imports done); a worker's start-up has its own
    limit, the larger of ``timeout`` and :data:`STARTUP_TIMEOUT`. ``progress(case, message)`` is called after each case.

    However the call ends (Ctrl-C, an exception, or SIGTERM or SIGHUP, which raise
    :class:`Stopped`), every worker is killed and its folder removed. A signal ignored when
    the call starts (SIGHUP under ``nohup``) stays ignored.

    Raises:
      RuntimeError: the compile requirements are missing (the message names the packages).
    """
    missing = missing_requirements()
    if missing:
        raise RuntimeError(f"jaxbwd compile needs {', '.join(missing)}: {INSTALL_HINT}")
    jobs = worker_count(jobs, len(case_list))
    todo: "queue.Queue[Case]" = queue.Queue()
    for c in case_list:
        todo.put(c)
    results: "queue.Queue[tuple[Case, dict]]" = queue.Queue()
    live: set[_Worker] = set()
    lock, stop = threading.Lock(), threading.Event()

    def start():
        """A ready worker, or the error message why there is none (None: the run is stopping)."""
        with lock:  # no worker starts once the run is stopping: it would outlive the parent
            if stop.is_set():
                return None
            w = _Worker()
            live.add(w)
        line = w.answer(max(timeout, STARTUP_TIMEOUT))
        if line and line.strip() == _READY:
            return w
        code = w.close(kill=True)
        live.discard(w)
        return (f"the compile worker did not start within {max(timeout, STARTUP_TIMEOUT):g} s" if line is None
                else f"the compile worker died starting (exit code {code})")

    def serve():
        w = None
        try:
            while not stop.is_set():
                try:
                    case = todo.get_nowait()
                except queue.Empty:
                    return
                if w is None:
                    w = start()
                    if w is None:
                        return
                    if isinstance(w, str):
                        results.put((case, {"case": case.id, "error": w}))
                        w = None
                        continue
                try:
                    w.proc.stdin.write(json.dumps(dataclasses.asdict(case)) + "\n")
                    w.proc.stdin.flush()
                    line = w.answer(timeout)  # the case's time: from here, the worker being ready
                except OSError:  # its pipe: the worker has ended
                    line = ""
                msg = _answer(line) if line else None
                if msg is None:  # timed out, died or garbled: the next case gets a fresh worker
                    code = w.close(kill=line != "")  # a garbled worker may still be busy
                    live.discard(w)
                    w = None
                    msg = {"case": case.id, "error": f"timed out after {timeout:g} s" if line is None
                           else f"the compile worker died (exit code {code})" if line == ""
                           else f"the compile worker answered {line.strip()[:200]!r}, not a JSON result"}
                results.put((case, msg))
        except Exception as e:  # a bug here must fail cases, never leave the main loop waiting
            failed.append(e)
            results.put((None, {"error": f"{type(e).__name__}: {e}"}))
        finally:
            if w is not None:
                w.close()
                live.discard(w)

    # A job scheduler's SIGTERM (or a closed terminal's SIGHUP) ends the run as Ctrl-C does,
    # through the cleanup below; by default the parent would die and leave its workers
    # compiling. Only while compiling, and only where handlers can be set (the main thread).
    # A signal set to be ignored (nohup's SIGHUP) stays ignored.
    signals = [s for s in (signal.SIGTERM, signal.SIGHUP) if signal.getsignal(s) is not signal.SIG_IGN]
    old = ({s: signal.signal(s, _raise_exit) for s in signals}
           if threading.current_thread() is threading.main_thread() else {})
    failed: list[Exception] = []
    threads = [threading.Thread(target=serve, daemon=True) for _ in range(jobs)]
    rows, failures, start_time = [], [], time.time()
    try:
        for t in threads:
            t.start()
        for _ in range(len(case_list)):
            case, msg = results.get()
            if failed:
                raise RuntimeError(f"jaxbwd compile: a worker thread failed: {failed[0]!r}") from failed[0]
            if "error" in msg:
                failures.append({"case": case.id, "error": msg["error"]})
            else:
                rows.extend(msg["rows"])
            if progress is not None:
                progress(case, msg)
        for t in threads:
            t.join()
    finally:
        for s in old:  # a signal now must not interrupt the cleanup and orphan workers
            signal.signal(s, signal.SIG_IGN)
        with lock:
            stop.set()
            stopping = list(live)
        for w in stopping:  # none left after a complete run
            w.close(kill=True)
        for s, handler in old.items():  # None: a handler not set from Python, which cannot be put back
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
    return {"meta": _meta(case_list, jobs, time.time() - start_time), "rows": rows, "failures": failures}


def _meta(case_list, jobs, seconds) -> dict[str, Any]:
    import jax

    try:
        from importlib.metadata import version

        plugin = version("jax-cuda13-plugin")
    except Exception:
        plugin = None
    return {
        "date": datetime.date.today().isoformat(), "jax": jax.__version__, "cuda_plugin": plugin,
        "gpus": sorted({c.gpu for c in case_list}), "cases": len(case_list), "jobs": jobs,
        "seconds": round(seconds, 1),
    }


def missing_kernels(report: dict[str, Any], case_list: Iterable[Case]) -> list[str]:
    """``case id: kernel`` for every registry kernel a case's compile did not produce (its
    Mosaic GPU counterparts count under ``pallas_backend="mosaic"``: ``<kernel>_mosaic``, or
    for ``attention_bwd_dkdv`` above head dim 128 both ``attention_bwd_dk_mosaic`` and
    ``attention_bwd_dv_mosaic``)."""
    got = {(r["op"], r["case"], r["dtype"], r["gpu"], r["kernel"]) for r in report["rows"]}
    failed = {f["case"] for f in report["failures"]}
    split = {"attention_bwd_dkdv": ("attention_bwd_dk_mosaic", "attention_bwd_dv_mosaic")}

    def produced(c, k):
        at = lambda name: (c.op, c.shape_name, c.dtype, c.gpu, name)  # noqa: E731
        return (at(k) in got or at(f"{k}_mosaic") in got
                or (k in split and all(at(s) in got for s in split[k])))

    return [f"{c.id}: {k}" for c in case_list if c.id not in failed for k in c.kernels if not produced(c, k)]


# ------------------------------------------------------------------------- reporting

COLUMNS = (
    # (header, key or function of a row, help)
    ("op", "op", "registry op"),
    ("case", "case", "lowering example (shapes; the dtype column overrides its dtype)"),
    ("dtype", lambda r: _short_dtype(r["dtype"]), "input dtype"),
    ("gpu", "gpu", "target GPU"),
    ("kernel", "kernel", "pallas_call name"),
    ("grid", lambda r: "x".join(str(g) for g in r["grid"] if g != 1) or "1", "launch grid (blocks)"),
    ("w/s", lambda r: f"{r['num_warps']}/{r['num_stages']}", "Triton num_warps / num_stages"),
    ("reg", "registers", "registers per thread"),
    ("spill", lambda r: r["stack"], "stack frame bytes per thread (spills land here; 0 = none)"),
    ("smem", lambda r: _kib(r["smem"]), "shared memory per block (static + dynamic)"),
    ("blk/SM", lambda r: f"{r['blocks_per_sm']} {_SHORT[r['limiter']]}", "resident blocks per SM and the limiting resource"),
    ("occ", lambda r: f"{r['occupancy']:.0%}", "resident warps / max warps per SM"),
    ("waves", lambda r: f"{r['waves']:.2f}", "grid blocks / (blocks per SM x SMs)"),
    ("TC", lambda r: f"{r['tensor_core']}:{r[r['tensor_core'].lower()]}" if r["tensor_core"] != "none" else "-",
     "tensor-core instructions in the SASS, kind:count (HGMMA sm_90 wgmma, UTCMMA sm_100 tcgen05, HMMA mma.sync)"),
    ("ex2", "ex2", "MUFU.EX2 instructions"),
    ("expf", "expf", "libdevice expf sequences"),
    ("sass", "sass", "static SASS instructions (NOPs excluded)"),
    ("i/S", lambda r: f"{r['inst_per_s']:.1f}" if r.get("inst_per_s") else "-",
     "main-loop SASS instructions per unique score element (attention): the innermost loop holding "
     "the tensor-core ops, instructions per thread per iteration / (S tile elements / threads)"),
    ("MB", lambda r: f"{r['io_bytes'] / 1e6:.0f}" if r.get("io_bytes") else "-",
     "the kernel's operands and results, MB (its minimum traffic: each read once, each written once)"),
    ("io/min", lambda r: f"{r['op_io_bytes'] / r['op_min_bytes']:.2f}" if r.get("op_min_bytes") else "-",
     "all of the case's kernels' operand+result bytes over the op's minimum (fwd+bwd inputs and the "
     "cotangent read once, gradients written once); > 1 means intermediates go through HBM"),
)


def _short_dtype(dtype: str) -> str:
    return {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}.get(dtype, dtype)


def _kib(n: int) -> str:
    # Below 1 KiB in bytes: rounded to KiB, a few hundred bytes of static smem would read "0K".
    return f"{n}B" if n < 1024 else f"{n / 1024:.0f}K"


_SHORT = {"registers": "reg", "shared memory": "smem", "threads": "thr", "blocks": "blk"}


def _cell(row, key):
    return key(row) if callable(key) else row[key]


def table_rows(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Headers and string cells of the report's rows, in a stable order."""
    order = sorted(report["rows"], key=lambda r: (r["gpu"], r["op"], r["case"], r["dtype"], r["kernel"]))
    return [h for h, _, _ in COLUMNS], [[str(_cell(r, k)) for _, k, _ in COLUMNS] for r in order]


def markdown(report: dict[str, Any]) -> str:
    """The report as a Markdown document: the table, a legend and any failures."""
    headers, rows = table_rows(report)
    m = report["meta"]
    lines = [
        f"# Compiled kernels, {m['date']}", "",
        f"jax {m['jax']}, CUDA plugin {m['cuda_plugin']}, deviceless compile for {', '.join(m['gpus'])}; "
        f"{plural(m['cases'], 'case')} in {m['seconds']} s on {plural(m['jobs'], 'process', 'es')}.", "",
        "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers),
    ]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += ["", "Columns:"] + [f"- **{h}**: {d}" for h, _, d in COLUMNS]
    if report["failures"]:
        lines += ["", "Failures:"] + [f"- `{f['case']}`: {f['error']}" for f in report["failures"]]
    return "\n".join(lines) + "\n"


COMPARED = (("reg", "registers"), ("spill", "stack"), ("blk/SM", "blocks_per_sm"), ("waves", "waves"),
            ("sass", "sass"), ("i/S", "inst_per_s"), ("ex2", "ex2"), ("expf", "expf"), ("TC", "tensor_core"))


def compare(baseline: dict[str, Any], report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Before/after cells for every kernel compiled in both reports: ``before -> after`` where
    a figure changed, the value alone where it did not."""
    key = lambda r: (r["op"], r["case"], r["dtype"], r["gpu"], r["kernel"])  # noqa: E731
    old = {key(r): r for r in baseline["rows"]}
    headers = ["op", "case", "dtype", "gpu", "kernel"] + [h for h, _ in COMPARED]
    rows = []
    for r in sorted(report["rows"], key=key):
        b = old.get(key(r))
        if b is None:
            continue
        cells = []
        for _, k in COMPARED:
            fmt = lambda v: "-" if v is None else f"{v:.2f}" if k == "waves" else str(v)  # noqa: E731
            old_v, new_v = b.get(k), r.get(k)
            cells.append(fmt(new_v) if old_v == new_v else f"{fmt(old_v)} -> {fmt(new_v)}")
        rows.append([r["op"], r["case"], _short_dtype(r["dtype"]), r["gpu"], r["kernel"]] + cells)
    return headers, rows


def summary(report: dict[str, Any]) -> str:
    """One line: kernels compiled, spills, tensor-core use, failures."""
    rows = report["rows"]
    spilled = sorted({f"{r['kernel']}({r['dtype']})" for r in rows if r["stack"] or r["spill_stores"]})
    tc = sum(r["tensor_core"] != "none" for r in rows)
    return (f"{plural(len(rows), 'kernel compile')} from "
            f"{plural(report['meta']['cases'] - len(report['failures']), 'case')} "
            f"({len(report['failures'])} failed) in {report['meta']['seconds']} s; "
            f"{len(spilled)} {'kernel spills' if len(spilled) == 1 else 'kernels spill'}"
            f"{': ' + ', '.join(spilled) if spilled else ''}; {tc} use{'s' * (tc == 1)} tensor cores")


def plural(n: int, word: str, suffix: str = "s") -> str:
    """``1 case``, ``2 cases``; ``plural(n, "process", "es")``."""
    return f"{n} {word}{'' if n == 1 else suffix}"


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1]))
