"""The one place jaxbwd uses Mosaic GPU's experimental Pallas API, and the pipeline helpers
the Mosaic kernels share.

Mosaic GPU's Pallas API (``jax.experimental.pallas.mosaic_gpu``) is documented as unstable.
Everything jaxbwd uses from it is imported here, so an API change is fixed in this file. It
was written against jax 0.12.0.1.

Execution model (Hopper): a kernel is a grid of CTAs; each CTA runs ``num_threads``
warpgroups (128 threads each) that see the same shared memory. jaxbwd's Mosaic kernels are
warp specialized in the manner of FlashAttention-3 (Shah et al. 2024, Section 3.1):
consumer warpgroups (``CONSUMERS`` unless a kernel asks for fewer) each own 64 rows of the
CTA's resident tile and run the wgmmas and the softmax; the last warpgroup is the producer,
which only issues TMA copies of the streamed blocks into a ring of ``stages`` shared-memory
slots. Per slot, one barrier per streamed array says "loaded" (TMA transaction count) and
one barrier with one arrival per consumer says "consumed", so the producer refills a slot only after every consumer is done
with it. Every warpgroup walks the same block range so that each waits every barrier phase
(Mosaic tracks barrier phases per thread, in order).
"""
from __future__ import annotations

import contextvars
import os
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax._src.state import types as state_types

from jaxbwd.pallas import _common as C

# wgmma's M is 64 rows per warpgroup; a CTA holds CONSUMERS of them (FA3's two consumer
# warpgroups, which let one warpgroup's softmax overlap the other's wgmma).
WG_ROWS = 64
CONSUMERS = 2
# 128-byte swizzle: shared-memory rows of 128 bytes (64 16-bit elements), the widest
# swizzle wgmma reads without bank conflicts.
SWIZZLE_BYTES = 128
# Register split between the consumer and producer warpgroups (setmaxnreg), as FA3:
# (2 x 232 + 40) x 128 threads = 64,512 of an SM's 65,536 registers. With jax 0.12.0.1 ptxas
# ignores it (C7504, "to maintain compatibility across compilation units": seen with
# ``python -m jaxbwd compile``), so each thread gets 65536 / threads; the kernels' tiles are
# sized for that. jax 0.12.1's ptxas honours it. Only two-consumer CTAs (384 threads, an even
# share of 168) ask for it: see ``split_registers``.
CONSUMER_REGISTERS = 232
PRODUCER_REGISTERS = 40

Layout = plgpu.Layout
ACC = plgpu.ACC
wgmma = plgpu.wgmma
barrier_wait = plgpu.barrier_wait
barrier_arrive = plgpu.barrier_arrive
copy_gmem_to_smem = plgpu.copy_gmem_to_smem
copy_smem_to_gmem = plgpu.copy_smem_to_gmem
commit_smem = plgpu.commit_smem
wait_smem_to_gmem = plgpu.wait_smem_to_gmem
load = plgpu.load
layout_cast = plgpu.layout_cast
broadcasted_iota = plgpu.broadcasted_iota
set_max_registers = plgpu.set_max_registers


def split_registers(consumers: int, producer: bool) -> None:
    """Moves registers from the producer warpgroup to the consumers (``setmaxnreg``) where an
    even share is too small: with two consumers, 168 per thread becomes 232 (consumers) and 40
    (producer). A one-consumer CTA (256 threads) already gets 255 per thread, and setmaxnreg
    could only lower that: its largest request below 256 is 248, and 256 makes ptxas drop every
    request in the module. Measured with ``python -m jaxbwd compile`` (jax 0.12.1, head dim
    256, bf16, bytes of stack per thread for dq/dk/dv): 256/216/8 asking 232, 160/152/0 asking
    248, 152/128/0 asking nothing (128/128/0 on jax 0.12.0.1, whose ptxas ignored requests)."""
    if consumers > 1:
        set_max_registers(PRODUCER_REGISTERS if producer else CONSUMER_REGISTERS,
                          action="decrease" if producer else "increase")


def swizzle_elems(dtype) -> int:
    return SWIZZLE_BYTES // jnp.dtype(dtype).itemsize


def tile_smem(shape: Sequence[int], dtype) -> Any:
    """Shared memory for wgmma operands: (8, 64)-element tiles, 128-byte swizzle."""
    transforms = (plgpu.TilingTransform((8, swizzle_elems(dtype))), plgpu.SwizzleTransform(SWIZZLE_BYTES))
    return plgpu.SMEM(tuple(shape), dtype, transforms=transforms)


def vec_smem(shape: Sequence[int], dtype) -> Any:
    """Shared memory for per-row vectors (lse, delta, segment ids): plain, TMA-able."""
    return plgpu.SMEM(tuple(shape), dtype)


def stage_smem(shape: Sequence[int], dtype, interpret: bool, consumers: int = CONSUMERS) -> Any:
    """Per-consumer staging tiles for register wgmma operands, allocated only when
    interpreting (see :func:`matmul`); ``None`` (no shared memory) when compiled."""
    return tile_smem((consumers, *shape), dtype) if interpret else None


def barriers(n: int, arrivals: int = 1) -> Any:
    return plgpu.Barrier(num_arrivals=arrivals, num_barriers=n)


def interpret_params(consumers: int = CONSUMERS, detect_races: bool = True) -> Any:
    """Mosaic GPU interpret mode: simulated shared memory, TMA, barriers and wgmma on CPU;
    with ``detect_races`` a happens-before race detector raises on any data race."""
    return plgpu.InterpretGPUParams(detect_races=detect_races, num_cores_or_threads=consumers + 1)


# Mosaic's interpreter (jax 0.12) runs each simulated warpgroup as its own XLA computation
# on its own Python thread, and the kernel's launch waits for them inside a host callback.
# XLA:CPU runs host callbacks, and work a computation hands off, on its intra-op thread
# pool, sized when jax creates its CPU client (PJRT_NPROC, else NPROC, else the CPU count);
# a barrier wait blocks the thread it runs on. On 2 CPUs the pool filled with blocked
# callbacks (the launch and one warpgroup's barrier wait) while the other warpgroups waited
# in XLA's execute for a free pool thread: the runs hung (py-spy and gdb stacks). At most
# warpgroups - 1 wait at once (all of them waiting would be the kernel's own deadlock), the
# launch holds one thread and the warpgroup that makes progress may need one: warpgroups + 1
# threads suffice, and the check asks one more as margin. The interpreter runs one kernel at
# a time per device; a program over several CPU devices runs one per device at once and
# needs that many times more.
POOL_THREADS_OVER_WARPGROUPS = 2
_POOL_THREAD_NAME = "tf_XLAEigen"  # XLA:CPU's intra-op pool (tsl::thread::ThreadPool "XLAEigen")


def cpu_pool_threads() -> int:
    """The threads of XLA:CPU's intra-op pool, which runs host callbacks: counted by name
    where the OS lists a process's threads (Linux, once jax's CPU client exists), else what
    XLA sizes the pool from (``PJRT_NPROC``, else ``NPROC``, else the usable CPUs)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        tasks = []
    count = 0
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                count += f.read().strip() == _POOL_THREAD_NAME
        except OSError:  # the thread ended meanwhile
            pass
    if count:
        return count
    for var in ("PJRT_NPROC", "NPROC"):
        try:
            return max(1, int(os.environ[var]))
        except (KeyError, ValueError):
            pass
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def check_interpreter_threads(name: str, warpgroups: int) -> None:
    """Raises ``RuntimeError`` if XLA:CPU's thread pool is too small for Mosaic's
    interpreter to run a kernel of ``warpgroups`` warpgroups without deadlocking."""
    need, have = warpgroups + POOL_THREADS_OVER_WARPGROUPS, cpu_pool_threads()
    if have < need:
        raise RuntimeError(
            f"{name}: Mosaic GPU's interpreter runs its {warpgroups} warpgroups on XLA's CPU thread "
            f"pool, where barrier waits block threads; it needs at least {need} pool threads and has "
            f"{have}, and could deadlock. Start Python with NPROC={max(need, 8)} (or PJRT_NPROC) in "
            f"the environment, which sizes the pool when jax starts, or use the Triton backend.")


_INTERPRETING: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxbwd_mosaic_interpreting", default=False)


def kernel(body: Callable[..., None], *, name: str, out_type: Any, grid: Sequence[int],
           grid_names: Sequence[str], scratch: Sequence[Any], interpret: bool,
           consumers: int = CONSUMERS) -> Callable[..., Any]:
    """A warp-specialized Mosaic GPU kernel: ``consumers + 1`` warpgroups per CTA (thread
    axis ``"wg"``; the last one is the producer), fast math (``approx_math``: MUFU
    exp2/rcp), run in Mosaic's interpreter with race detection when ``interpret``."""
    body.__name__ = name
    if interpret:
        check_interpreter_threads(name, consumers + 1)
    call = plgpu.kernel(
        body, out_type=out_type, grid=tuple(int(g) for g in grid), grid_names=tuple(grid_names),
        num_threads=consumers + 1, thread_name="wg", scratch_types=list(scratch),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret_params(consumers) if interpret else None,
    )

    key = C._launch_key(body, name, out_type, grid, grid_names, scratch, interpret, consumers)

    def launch(*args):
        token = _INTERPRETING.set(bool(interpret))
        try:
            return C.run_cached(key, call, args)  # eager launches compile once: see _common.call
        finally:
            _INTERPRETING.reset(token)

    return launch


def wg_index():
    return lax.axis_index("wg")


def when(cond):
    return pl.when(cond)


# Grid and loop indices are int32, but under jax_enable_x64 a Python int divisor is int64, and
# lax's integer ops take no mixed widths: the divisor takes the index's dtype.
def div(a, b):
    """Integer quotient of non-negative ``a`` by ``b`` (lax.div: truncating), in a's dtype."""
    return lax.div(a, lax.convert_element_type(b, jnp.result_type(a)))


def rem(a, b):
    """Remainder of non-negative ``a`` by ``b``, in a's dtype."""
    return lax.rem(a, lax.convert_element_type(b, jnp.result_type(a)))


def ds(start, size: int):
    return pl.ds(start, size)


def _is_ref(x) -> bool:
    if isinstance(x, state_types.TransformedRef):
        return True
    return isinstance(jax.typeof(x), state_types.AbstractRef)


def matmul(a, b, shape, acc=None, stage=None, after_issue=None):
    """``acc + a @ b`` by one wgmma, f32 accumulator [shape] in the WGMMA register layout.
    ``a`` is a shared-memory ref or a 16-bit register array; ``b`` a shared-memory ref
    (``.T`` of a ref is a transposed view, free for 16-bit types). ``after_issue()``, if
    given, runs between issuing the (asynchronous) wgmma and reading its result.

    Mosaic's interpreter (jax 0.12) takes only shared-memory wgmma operands and does not
    interpret ``run_state`` over an initialized accumulator, so when interpreting a register
    ``a`` is staged through shared memory and ``acc`` is added in registers: the same sums
    as the compiled path, which keeps P/dS in registers (FA3) and accumulates in place.
    ``stage`` is that staging buffer (:func:`stage_smem`; allocations inside a warpgroup's
    branch are not allowed).
    """
    interpreting = _INTERPRETING.get()
    if interpreting and not _is_ref(a):
        stage[...] = a
        plgpu.commit_smem()
        return matmul(stage, b, shape, acc, after_issue=after_issue)
    if interpreting and acc is not None:
        return acc + matmul(a, b, acc.shape, after_issue=after_issue)

    def issue(ref):
        plgpu.wgmma(ref, a, b)
        if after_issue is not None:
            after_issue()
    if acc is None:
        def f(ref):
            issue(ref)
            return ref[...]
        return pl.run_scoped(f, plgpu.ACC(tuple(shape), jnp.float32))
    return pl.run_state(issue)(plgpu.ACC.init(acc))


def zeros(shape, layout=None):
    layout = Layout.WGMMA if layout is None else layout
    return plgpu.layout_cast(jnp.zeros(tuple(shape), jnp.float32), layout)


def full(shape, value, layout):
    return plgpu.layout_cast(jnp.full(tuple(shape), value, jnp.float32), layout)


def iota(shape, dim: int):
    return plgpu.broadcasted_iota(jnp.int32, tuple(shape), dim, layout=Layout.WGMMA)


def row_vector(ref):
    """A [rows] vector from shared memory laid out to broadcast along a WGMMA tile's rows."""
    return plgpu.load(ref, layout=Layout.WGMMA.reduce(1))


def col_vector(ref):
    """A [cols] vector from shared memory laid out to broadcast along a WGMMA tile's columns."""
    return plgpu.load(ref, layout=Layout.WGMMA.reduce(0))


# ----------------------------------------------------------------------- the shared ring
def produce(lo, hi, stages: int, sources, consumed, consumers: int) -> None:
    """The producer warpgroup: TMA-loads streamed blocks ``lo .. hi-1`` into ``stages`` slots.

    ``sources``: (``src(step)`` -> GMEM ref view of that block, SMEM ring [stages, ...],
    "loaded" barriers [stages]). Slot ``s`` is refilled after the consumers' ``stages``-th
    previous step arrived on ``consumed[s]``.
    """
    split_registers(consumers, producer=True)

    @pl.loop(lo, hi)
    def _(step):
        slot = rem(step - lo, stages)

        @pl.when(step - lo >= stages)
        def _():
            plgpu.barrier_wait(consumed.at[slot])

        for src, ring, loaded in sources:
            plgpu.copy_gmem_to_smem(src(step), ring.at[slot], loaded.at[slot])

    # Drain: wait the last ``stages`` "consumed" phases too, so that the CTA ends with every
    # barrier phase waited (no phase is left pending at exit).
    @pl.loop(jnp.maximum(lo, hi - stages), hi)
    def _(step):
        plgpu.barrier_wait(consumed.at[rem(step - lo, stages)])


# FA3's ping-pong schedule (Shah et al. 2024, Section 3.1): two consumer warpgroups take
# turns on the tensor cores, so that one's softmax runs while the other's wgmmas do. One
# barrier with an arrival per consumer: a consumer takes a turn once its q k^T wgmma is
# issued, arrives again when its softmax is done and waits that phase before issuing p v.
# Consumer 1 takes one extra turn before its loop and consumer 0 one after, which offsets
# them by half a step: one's p v and next q k^T run while the other computes its softmax.
# Both walk the same blocks, so both pass the same number of phases.
def take_turn(schedule) -> None:
    """Arrive on the ping-pong barrier and wait for the other consumer's arrival."""
    plgpu.barrier_arrive(schedule)
    plgpu.barrier_wait(schedule)


def consume(lo, hi, stages: int, consumed, body: Callable, carry, base=None):
    """A consumer warpgroup's loop over streamed blocks ``lo .. hi-1``: ``body(step, slot,
    carry) -> carry`` waits the "loaded" barriers of what it reads; afterwards this
    warpgroup arrives on ``consumed[slot]``. ``base``: the first block the producer streamed
    (default ``lo``), when one walk is split over several loops."""
    base = lo if base is None else base

    def step_fn(step, carry):
        slot = rem(step - base, stages)
        carry = body(step, slot, carry)
        plgpu.barrier_arrive(consumed.at[slot])
        return carry

    return lax.fori_loop(lo, hi, step_fn, carry)
