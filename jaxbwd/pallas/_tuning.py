"""Launch configurations of jaxbwd's hot kernels, per GPU architecture, in one table.

A kernel asks for its configuration with the shapes it was given; a heuristic here turns
the shapes into a *variant* (e.g. ``"16bit"``, ``"h128/16bit"``, ``"d8192"``) and the table
gives the block sizes, warps and pipeline stages for the current architecture
(``_common.sm_version``): ``sm_90`` (H100/H200), ``sm_80`` (A100) and ``sm_100`` (B200:
sm_90's entries, except where they compiled worse for it).

``blocks_per_sm`` is the occupancy the compiled kernel reaches at that configuration, read
from its registers and shared memory by ``python -m jaxbwd compile`` (column ``blk/SM``;
the lowest over the registry's shapes). Grids that are persistent or split along a reduction
are sized from it and the SM count by one helper, :func:`split` (linear_cross_entropy's dw,
one program per slot, takes ``blocks_per_sm * num_sms`` directly); the compile gates
(``tests/test_compile.py``) check that the persistent grids of the norms, bias_add,
group_norm's sums and linear_cross_entropy's f32 dw still reach the occupancy the table
assumes (they stay within one wave). The other grids sized from the table are not gated:
a kernel that compiles to fewer blocks per SM than its entry says runs more waves.

A JSON file of measured winners (``bench/gpu_check.sh`` writes one) overrides entries:
``{"sm_90": {"conv2d_dgrad/16bit": {"block_k": 128, "num_stages": 4}}}``; it is read from
``$JAXBWD_TUNING`` at import, by :func:`load`, or applied for a block with :func:`use`. An
override's key is a key the heuristics ask for (:func:`requests`) or a prefix of some at a
"/" (``"attention_fwd/h128"``: every head_dim-128 forward), and applies to each key it is a
prefix of; any other key (a misspelt kernel or variant, which would apply nowhere) is
refused with the variants that could follow, and so is a field the kernels under the key do
not read (:func:`fields`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
from typing import Iterator, Mapping

import jax.numpy as jnp
from jax import lax

from jaxbwd.pallas import _common as C


@dataclasses.dataclass(frozen=True)
class Config:
    """One kernel's launch configuration.

    ``block_m``/``block_n``/``block_k``: the tile of the kernel's main product or loop
    (each kernel's docstring says which dimension is which); ``num_warps``/``num_stages``:
    Triton's; ``blocks_per_sm``: resident blocks per SM of the compiled kernel;
    ``keys_first`` (attention dk/dv only): the score tile is computed transposed,
    S^T = K Q^T, so that the key block is the M dimension of all four of its dots;
    ``head_split`` (attention forward, dk/dv, dq and the tangent pass): the grid's last axis splits the
    head dim of the kernel's accumulator and results into that many column parts, each
    program recomputing the whole score tile (see ``attention._parts``).
    """

    block_m: int = 0
    block_n: int = 0
    block_k: int = 0
    num_warps: int = 4
    num_stages: int = 3
    blocks_per_sm: int = 1
    keys_first: bool = False
    head_split: int = 1


_ = Config
# Attention: block_m = query rows, block_n = key rows, 2 stages (as compiled so far; more
# stages are among the configurations bench/tune.py sweeps on a GPU). 8 warps from head_dim
# 65, except where two warpgroups would compute the same 64 rows (see attention._config).
_ATTENTION = {
    "attention_fwd/h64": _(128, 64, num_warps=4, num_stages=2),
    "attention_fwd/h128": _(128, 64, num_warps=8, num_stages=2),
    "attention_fwd/h256": _(64, 32, num_warps=8, num_stages=2),
    "attention_bwd_dkdv/h64": _(64, 64, num_warps=4, num_stages=2),
    "attention_bwd_dkdv/h128": _(64, 64, num_warps=8, num_stages=2),
    "attention_bwd_dkdv/h256": _(32, 32, num_warps=8, num_stages=2),
    "attention_bwd_dq/h64": _(64, 64, num_warps=4, num_stages=2),
    "attention_bwd_dq/h128": _(64, 64, num_warps=8, num_stages=2),
    "attention_bwd_dq/h256": _(32, 32, num_warps=8, num_stages=2),
    # jax.jvp's tangent pass: the forward's loop with twice the tiles (k, v, dk, dv per key
    # block; q, dq, o per query block) and twice the live score tiles (P and dS). The
    # forward's 128 x 64 tiles need 288 KB of shared memory in f32 and spill on sm_80 and at
    # 4 warps (compiled, H200 and A100); 16-bit on sm_90 at head_dim <= 128 keeps them.
    "attention_jvp/h64": _(64, 32, num_warps=4, num_stages=2),
    "attention_jvp/h128": _(64, 32, num_warps=8, num_stages=2),
    "attention_jvp/h256": _(64, 32, num_warps=8, num_stages=2),
}

# f32 attention under 3xTF32 (jax.default_matmul_precision("highest"): each f32 dot is three
# TF32 products of split operands, so each tile holds twice the operands). The TF32 tiles
# capped at 64 x 32 (``attention``'s default for "/x3") spilled 64-1576 B per thread (A100:
# every head dim; H200: 80-256), and on A100 at 256 the case did not compile (213 KB of shared
# memory). Chosen from a sweep of 16-128 x 16-64 tiles on 2-16 warps, 1-2 stages (compiled):
# the fewest main-loop instructions per score element among those without spills. At
# head_dim 256 none is without spills except the forward; these are the fewest bytes
# (tests/test_compile.py lists them).
_ATTENTION_X3 = {
    "attention_fwd/h256/f32/x3": _(16, 32, num_warps=8, num_stages=1),
    "attention_bwd_dq/h256/f32/x3": _(16, 16, num_warps=8, num_stages=1),
    "attention_bwd_dkdv/h256/f32/x3": _(16, 16, num_warps=8, num_stages=1),
    "attention_jvp/h256/f32/x3": _(16, 16, num_warps=8, num_stages=2),
}
_ATTENTION_X3_SM90 = {
    **_ATTENTION_X3,
    "attention_fwd/h128/f32/x3": _(64, 16, num_warps=4, num_stages=1),  # wgmma, 242 registers
    "attention_bwd_dq/h128/f32/x3": _(16, 32, num_warps=4, num_stages=1),
    "attention_jvp/h128/f32/x3": _(16, 16, num_warps=8, num_stages=2),
    # S^T = K Q^T on 64 key rows keeps every dk/dv dot on wgmma here too (129 instructions
    # per S element; 144 on mma.sync at the capped 32 x 32).
    "attention_bwd_dkdv/h64/f32/x3": _(16, 64, num_warps=4, num_stages=1, keys_first=True),
    # The tangent pass at head_dim 64: the f32 tile with two stages spilled 8 B under jax
    # 0.12.1's compiler (window + softcap); one stage: 255 registers, no spills, the same 117
    # main-loop instructions per score element (64 x 16 on two stages: 154).
    "attention_jvp/h64/f32/x3": _(64, 32, num_warps=4, num_stages=1),
}
_ATTENTION_X3_SM80 = {
    **_ATTENTION_X3,
    "attention_fwd/h128/f32/x3": _(32, 64, num_warps=8, num_stages=1),
    "attention_bwd_dq/h128/f32/x3": _(16, 32, num_warps=4, num_stages=1),
    "attention_jvp/h128/f32/x3": _(16, 16, num_warps=8, num_stages=1),
    "attention_bwd_dq/h64/f32/x3": _(32, 64, num_warps=8, num_stages=1),
    "attention_jvp/h64/f32/x3": _(16, 16, num_warps=8, num_stages=1),
}

# linear_cross_entropy (its kernels' docstrings): block_m tokens, block_n vocabulary columns,
# block_k the D chunk of the logit dots; one warpgroup on 64-token tiles, since a second would
# compute the same rows again (wgmma splits M between warpgroups only from M = 128).
# Compiled 2026-12-01/02 at the registry shapes, no spills (``python -m jaxbwd compile``).
_LCE_SM90 = {
    # 16-bit: 64 x 128 tiles from 64-wide D chunks, 174-255 registers (2 blocks per SM); the
    # table layout takes 32-wide chunks (its dw's [128, 64] tiles spilled 56 B at 64), which
    # leave its forward at 166 registers (3 blocks).
    "linear_cross_entropy_fwd/16bit": _(64, 128, 64, num_warps=4, num_stages=2, blocks_per_sm=2),
    "linear_cross_entropy_fwd/16bit/table": _(64, 128, 32, num_warps=4, num_stages=2, blocks_per_sm=3),
    "linear_cross_entropy_bwd_dx/16bit": _(64, 128, 64, num_warps=4, num_stages=2, blocks_per_sm=2),
    "linear_cross_entropy_bwd_dx/16bit/table": _(64, 128, 32, num_warps=4, num_stages=2, blocks_per_sm=2),
    # dw: 128 tokens x 64 columns per step (the per-program slab of running sums halves; 128
    # tokens double the flops per byte of its read-modify-write), 254-255 registers.
    "linear_cross_entropy_bwd_dw/16bit": _(128, 64, 64, num_warps=4, num_stages=2, blocks_per_sm=2),
    "linear_cross_entropy_bwd_dw/16bit/table": _(128, 64, 32, num_warps=4, num_stages=2, blocks_per_sm=2),
    # f32 (TF32): 64 x 64 tiles from 32-wide chunks (64 x 128 spilled 8 B at two shapes; dw
    # at 128 tokens about 1 KB); 128-166 registers in the forward (3-4 blocks per SM),
    # 167-255 in the backward (2-3).
    "linear_cross_entropy_fwd/f32": _(64, 64, 32, num_warps=4, num_stages=2, blocks_per_sm=3),
    "linear_cross_entropy_bwd_dx/f32": _(64, 64, 32, num_warps=4, num_stages=2, blocks_per_sm=2),
    # dw's x^T dz dot has the D chunk as its M: 32-wide chunks ran it on mma.sync (64 HMMA,
    # 192 under 3xTF32). 64-wide chunks put it on wgmma; with two stages they spilled about
    # 1 KB, with one: 194 registers (228 under 3xTF32), no spills, main loop 179 -> 247
    # instructions per step for twice the D (2026-12-06). The table layout keeps 32 (all
    # wgmma there already, two stages).
    "linear_cross_entropy_bwd_dw/f32": _(64, 64, 64, num_warps=4, num_stages=1, blocks_per_sm=2),
    "linear_cross_entropy_bwd_dw/f32/table": _(64, 64, 32, num_warps=4, num_stages=2, blocks_per_sm=2),
    # Under 3xTF32 the table layout's dw spilled 8 B; 16-wide D chunks: 202 registers.
    "linear_cross_entropy_bwd_dw/f32/table/x3": _(64, 64, 16, num_warps=4, num_stages=2, blocks_per_sm=2),
}
# sm_80 (mma.sync is per warp, nothing is duplicated): 8 warps spread the 64 x 128 tile over
# twice the registers (4 warps spilled up to 200 B in the forward); 167-246 registers, one
# block per SM. dw keeps its 16-bit 128 x 64 step.
_LCE_SM80 = {
    "linear_cross_entropy_fwd": _(64, 128, 64, num_warps=8, num_stages=2, blocks_per_sm=1),
    "linear_cross_entropy_bwd_dx": _(64, 128, 64, num_warps=8, num_stages=2, blocks_per_sm=1),
    "linear_cross_entropy_bwd_dw": _(64, 128, 64, num_warps=8, num_stages=2, blocks_per_sm=1),
    "linear_cross_entropy_bwd_dw/16bit": _(128, 64, 64, num_warps=8, num_stages=2, blocks_per_sm=1),
    # 3xTF32: the f32 tiles spilled 272-2768 B per thread (dx the most); 64 x 64 tiles from
    # 16-wide D chunks on 8 warps: 168-255 registers, no spills, one block per SM.
    **{f"linear_cross_entropy_{k}/f32{t}/x3": _(64, 64, 16, num_warps=8, num_stages=2, blocks_per_sm=1)
       for k in ("fwd", "bwd_dx", "bwd_dw") for t in ("", "/table")},
}

# group_norm's two kernels (sums, then dx) share one grid of (sample, spatial chunk) programs:
# block_n = elements of one [block_s, C] tile (4096 f32 values keep x, dy and the recomputed
# terms in registers; half with the fused SiLU, whose extra terms would otherwise leave one
# block per SM), blocks_per_sm = the fewer of the two kernels' (compiled, H200 and A100: 72-137
# registers; the 16-bit sums kernel fits 2 blocks, the fused-SiLU f32 kernels 5).
_GROUP_NORM = {
    "group_norm_bwd/16bit": _(0, 4096, num_warps=8, blocks_per_sm=2),
    "group_norm_bwd/f32": _(0, 4096, num_warps=8, blocks_per_sm=3),
    "group_norm_bwd/silu/16bit": _(0, 2048, num_warps=8, blocks_per_sm=3),
    "group_norm_bwd/silu/f32": _(0, 2048, num_warps=8, blocks_per_sm=5),
}

TABLE: dict[str, dict[str, Config]] = {
    "sm_90": {
        **_ATTENTION,
        **_ATTENTION_X3_SM90,
        **_LCE_SM90,
        **_GROUP_NORM,
        # 16-bit dq at 128 query rows: no warpgroup replica, no spills (compiled, H200).
        "attention_bwd_dq/h128/16bit": _(128, 64, num_warps=8, num_stages=2),
        # 16-bit dk/dv: one warpgroup on its 64 key rows instead of two computing the same
        # rows (compiled, H200, head_dim 128: 255 registers, no spills, 2 blocks per SM;
        # main loop 41.9 -> 19.6 instructions per S element, HGMMA 40 -> 24).
        "attention_bwd_dkdv/h128/16bit": _(64, 64, num_warps=4, num_stages=2),
        "attention_jvp/h128/16bit": _(128, 64, num_warps=8, num_stages=2),
        # f32 (TF32) at head_dim <= 128 (compiled, H200): the 16-bit tiles spilled 88-456 B
        # (not the forward at head_dim 128, which keeps them: 254 registers, no spills).
        # 128 query rows over the two warpgroups for the forward and dq; dk/dv with 16 query
        # x 64 key rows, one stage (mma.sync for the 16-row S and dP tiles, wgmma for dk and
        # dv). No spills at 160-250 registers.
        "attention_fwd/h64/f32": _(128, 32, num_warps=8, num_stages=2),
        "attention_bwd_dq/h64/f32": _(128, 32, num_warps=8, num_stages=1),
        # At head_dim 64 dk/dv computes S^T = K Q^T (keys_first): every dot is wgmma on its 64
        # key rows, 32 query rows per step, 244 registers, no spills (16 x 64 with S's M = 16
        # on mma.sync before: main loop 90.1 -> 53.6 instructions per S element).
        "attention_bwd_dkdv/h64/f32": _(32, 64, num_warps=4, num_stages=1, keys_first=True),
        "attention_bwd_dq/h128/f32": _(128, 32, num_warps=8, num_stages=1),
        "attention_bwd_dkdv/h128/f32": _(16, 64, num_warps=8, num_stages=1),
        # The f32 tangent pass at head_dim 80-128: 64 x 32 spilled 24 B; 16-key blocks on 8
        # warps keep wgmma with no spills (248-255 registers).
        "attention_jvp/h128/f32": _(64, 16, num_warps=8, num_stages=1),
        # head_dim 256, 16-bit (compiled, H200, Gemma 2's window + softcap): the 64 x 32 /
        # 32 x 32 tiles gave replicated wgmma (forward) and mma.sync (backward). 128 query
        # rows split between the two warpgroups; dk/dv's 64 key rows on 8 warps, one stage to
        # fit the shared memory: 244 registers, so the two [64, 256] f32 accumulators (256
        # registers per thread on one warpgroup) are split between the warpgroups by head dim
        # (inferred from the count, not read from the SASS). No spills; all HGMMA except
        # dk/dv's 32 x 64 S and dP tiles (M = 32 < 64: mma.sync).
        "attention_fwd/h256/16bit": _(128, 64, num_warps=8, num_stages=2),
        "attention_bwd_dq/h256/16bit": _(128, 32, num_warps=8, num_stages=2),
        "attention_bwd_dkdv/h256/16bit": _(32, 64, num_warps=8, num_stages=1),
        # f32 at head_dim 256 (TF32): every wgmma tile (64 rows or more) of the whole head dim
        # spilled. The forward and dq split the head dim of their accumulator in two
        # (head_split: the grid's last axis; each half recomputes S, and dq dP): on wgmma,
        # no spills; main-loop instructions per unique S element, both halves counted,
        # forward 122.6 -> 104.9 (128 x 32 on 8 warps, 244 registers; mma.sync 32 x 32
        # before), dq 249.2 -> 189.0 (64 x 16 on 4 warps, 255 registers). dk/dv holds two
        # [block_k, 256] f32 accumulators and f32 K/V tiles; split in two it spilled 64-3176 B
        # at every wgmma tile, and in four (no spills) it issued 423 instructions per unique S
        # element against 289: it stays on mma.sync. Computing S = Q K^T, 16 x 16 on 8 warps
        # was the first tile without spills (1912 B at 32 x 32); computing S^T = K Q^T (keys_first),
        # 32 x 32 is: 253 registers, main loop 988 -> 290 instructions per S element, Q and dO
        # read once per 32 keys instead of 16. Still mma.sync: every tile with 64 key rows
        # (wgmma's M) spilled 376-1600 B (K and V held in registers as wgmma's A operand:
        # inferred from the counts, not read from the SASS).
        "attention_fwd/h256/f32": _(128, 32, num_warps=8, num_stages=2, head_split=2),
        "attention_bwd_dq/h256/f32": _(64, 16, num_warps=4, num_stages=2, head_split=2),
        "attention_bwd_dkdv/h256/f32": _(32, 32, num_warps=8, num_stages=1, keys_first=True),
        # The tangent pass at head_dim 256 (twice the tiles): 64 x 32 needed 299 KB of shared
        # memory in f32 (over the limit: jax.jvp failed to compile) and spilled 224 B in
        # 16-bit on 8 warps. With two stages (the loads are pipelined through shared memory
        # instead of held in registers): 16-bit 64 x 16 on one warpgroup, wgmma without a
        # replica, 251 registers, no spills (16 x 32 on mma.sync before, 170 registers, 2
        # blocks per SM; chosen from the compiled figures, not timed); f32 16 x 16 on 4
        # warps, 197 registers, no spills, 2 blocks per SM (40 B at 8 warps and 1 stage;
        # every 64-row wgmma tile in f32 spilled 504-4088 B; with the head dim in four parts
        # (head_split) 64 x 16 on 4 warps compiles without spills, on wgmma, but issues 583
        # main-loop instructions per unique S element against 487, for 2.8x the MMA work).
        "attention_jvp/h256/16bit": _(64, 16, num_warps=4, num_stages=2),
        "attention_jvp/h256/f32": _(16, 16, num_warps=4, num_stages=2),
        # conv2d: dgrad M = input pixels, N = input channels, K = (tap, output channel);
        # wgrad M = input channels, N = output channels, K = output pixels.
        # Compiled at the registry's UNet shapes (H200): 16-bit 96-118 registers, 2 blocks per
        # SM (98 KB of shared memory each); f32 (TF32) 128-145 registers, 1 block.
        "conv2d_dgrad/16bit": _(128, 128, 64, num_warps=8, num_stages=3, blocks_per_sm=2),
        "conv2d_dgrad/f32": _(128, 128, 32, num_warps=8, num_stages=3, blocks_per_sm=1),
        "conv2d_dgrad/depthwise": _(64, 128, num_warps=4, num_stages=3, blocks_per_sm=4),
        "conv2d_wgrad/16bit": _(128, 128, 64, num_warps=8, num_stages=3, blocks_per_sm=2),
        "conv2d_wgrad/f32": _(128, 128, 32, num_warps=8, num_stages=3, blocks_per_sm=1),
        "conv2d_wgrad/depthwise": _(64, 128, num_warps=4, num_stages=3, blocks_per_sm=4),
        # Norm backward: block_n columns (one column chunk) per row, 16 elements per thread
        # and operand; wider rows are chunked (compiled at 16 warps: 113-128 registers).
        "norm_bwd": _(1, 8192, num_warps=16, blocks_per_sm=1),
        "norm_bwd/rms/c4096": _(1, 8192, num_warps=16, blocks_per_sm=2),  # 117-123 registers
        # bias_add: block_m rows x block_n columns per step; 64 / 91 registers.
        "bias_add_dbias/16bit": _(32, 256, num_warps=4, blocks_per_sm=8),
        "bias_add_dbias/f32": _(32, 256, num_warps=4, blocks_per_sm=5),
        "bias_dropout_add_bwd/16bit": _(16, 256, num_warps=4, blocks_per_sm=5),  # 95-96 registers
        "bias_dropout_add_bwd/f32": _(16, 256, num_warps=4, blocks_per_sm=4),  # 101-107 registers
        # batch_norm's two column sums: block_m rows x block_n channels per step; 80-114
        # registers (4-6 blocks per SM).
        "batch_norm_bwd_reduce": _(32, 128, num_warps=4, blocks_per_sm=4),
    },
    "sm_80": {
        **_ATTENTION,
        **_ATTENTION_X3_SM80,
        **_LCE_SM80,
        **_GROUP_NORM,
        # head_dim 64 with a window and softcap (compiled, A100): the sm_90 tiles spilled
        # 32-1400 B in f32 and 40-48 B in 16-bit. 128 query rows on 8 warps for the forward
        # and dq (mma.sync is per warp: 16 rows each), f32 dk/dv at 16 x 32 on 4 warps.
        "attention_fwd/h64/16bit": _(128, 32, num_warps=8, num_stages=2),
        "attention_bwd_dq/h64/16bit": _(128, 32, num_warps=8, num_stages=1),
        "attention_fwd/h64/f32": _(128, 32, num_warps=8, num_stages=2),
        "attention_bwd_dq/h64/f32": _(128, 32, num_warps=8, num_stages=1),
        "attention_bwd_dkdv/h64/f32": _(16, 32, num_warps=4, num_stages=1),
        "attention_bwd_dkdv/h128/f32": _(16, 64, num_warps=8, num_stages=1),  # was 2352 B of spills
        # The tangent pass at head_dim 80-128 (A100): 64 x 32 on 8 warps spilled 624 B (f32)
        # and 56 B (16-bit); these compile without spills at 192-255 registers.
        "attention_jvp/h128/f32": _(16, 64, num_warps=8, num_stages=1),
        "attention_jvp/h128/16bit": _(32, 64, num_warps=8, num_stages=1),
        # and at head_dim 64 in f32 (jax 0.12.1's compiler): 64 x 32 on 4 warps spilled 8 B
        # with a window and softcap; 32 x 32 compiles at 226 registers, no spills, 81 main-loop
        # instructions per score element against 95.
        "attention_jvp/h64/f32": _(32, 32, num_warps=4, num_stages=2),
        # f32 at head_dim 256: S^T = K Q^T (keys_first) on 32 key x 16 query rows, 8 warps:
        # 241 registers, no spills, 984 -> 487 main-loop instructions per S element (16 x 16
        # without keys_first before; 1952 B of spills at 32 x 32).
        "attention_bwd_dkdv/h256/f32": _(16, 32, num_warps=8, num_stages=1, keys_first=True),
        # The tangent pass at head_dim 256: 16-bit no spills; f32 (270 KB of shared memory at
        # 64 x 32: over A100's 164 KB, jax.jvp failed to compile) 16 x 16 on 8 warps with two
        # stages, 191 registers, no spills (128 B with one stage; 72 B on 4 warps).
        "attention_jvp/h256/16bit": _(16, 32, num_warps=4, num_stages=1),
        "attention_jvp/h256/f32": _(16, 16, num_warps=8, num_stages=2),
        # A100 (compiled): 125-155 registers, one 8-warp block per SM.
        "conv2d_dgrad/16bit": _(128, 128, 32, num_warps=8, num_stages=3, blocks_per_sm=1),
        "conv2d_dgrad/f32": _(128, 128, 16, num_warps=8, num_stages=3, blocks_per_sm=1),
        "conv2d_dgrad/depthwise": _(64, 128, num_warps=4, num_stages=3, blocks_per_sm=4),
        "conv2d_wgrad/16bit": _(128, 128, 32, num_warps=8, num_stages=3, blocks_per_sm=1),
        "conv2d_wgrad/f32": _(128, 128, 16, num_warps=8, num_stages=3, blocks_per_sm=2),  # 122-127 registers
        "conv2d_wgrad/depthwise": _(64, 128, num_warps=4, num_stages=3, blocks_per_sm=4),
        # sm_80 compiles the same row code at about twice sm_90's registers (215-255 at
        # 4096 columns on 8 warps; 16 warps at 8192 spill): chunks of 4096.
        "norm_bwd": _(1, 4096, num_warps=8, blocks_per_sm=1),
        # rms_norm over several 4096-column chunks (sums of every chunk first, then the own
        # chunk again for dx): 94-105 registers, two blocks per SM.
        "norm_bwd/rms/c4096/chunked": _(1, 4096, num_warps=8, blocks_per_sm=2),
        "bias_add_dbias/16bit": _(32, 256, num_warps=4, blocks_per_sm=8),
        "bias_add_dbias/f32": _(32, 256, num_warps=4, blocks_per_sm=5),
        "bias_dropout_add_bwd/16bit": _(16, 256, num_warps=4, blocks_per_sm=5),  # 95-96 registers
        "bias_dropout_add_bwd/f32": _(16, 256, num_warps=4, blocks_per_sm=4),  # 101-107 registers
        # 90-114 registers (4-5 blocks per SM), except 16-bit at 64 channels: 216 registers, 2
        # blocks, so that grid is two full waves (taking 2 here would leave the others half
        # a wave).
        "batch_norm_bwd_reduce": _(32, 128, num_warps=4, blocks_per_sm=4),
        # group_norm's fused-SiLU 16-bit sums: 124 registers (jax 0.12.1's compiler), 4 blocks.
        "group_norm_bwd/silu/16bit": _(0, 2048, num_warps=8, blocks_per_sm=4),
    },
}
# sm_100 (B200, tcgen05: the MMA's accumulator lives in tensor memory, 512 f32 columns per SM):
# sm_90's entries, except where they spilled or left tcgen05 for mma.sync when compiled for
# a B200 (2026-12-05, bench/results/2026-12-05-compile-sm100.md; chosen as the sm_90 ones were:
# no spills, then the fewest main-loop instructions per score element or per step).
TABLE["sm_100"] = {
    **TABLE["sm_90"],
    # f32 dq at head_dim 80-128: 128 x 32 with one stage spilled 224 B; two stages: 250
    # registers, no spills.
    "attention_bwd_dq/h128/f32": _(128, 32, num_warps=8, num_stages=2),
    # f32 dk/dv at head_dim 80-128: 64 x 64 on 8 warps puts all four dots on tcgen05 (sm_90's
    # 16 x 64 ran S and dP on mma.sync): 248 registers, 103.5 -> 32.6 instructions per S element.
    "attention_bwd_dkdv/h128/f32": _(64, 64, num_warps=8, num_stages=1),
    # 16-bit dk/dv at head_dim 80-128: sm_90's two stages spilled 16-24 B; one stage: 254
    # registers, no spills, 2 blocks per SM.
    "attention_bwd_dkdv/h128/16bit": _(64, 64, num_warps=4, num_stages=1),
    # 16-bit dk/dv at head_dim 256: S^T = K Q^T on 64 key rows, all on tcgen05 (sm_90's
    # 32 x 64 ran S and dP on mma.sync): 255 registers, no spills, 59.5 -> 37.7 per S element.
    "attention_bwd_dkdv/h256/16bit": _(64, 64, num_warps=8, num_stages=1, keys_first=True),
    # The 16-bit tangent pass at head_dim 256: 64 x 16 on 4 warps spilled 40 B; 64 x 32 on 8
    # warps: 180 registers, no spills. (f32 dk/dv at head_dim 256 stays on sm_90's mma.sync
    # tiles: every tcgen05 tile asked for 576-816 of the 512 tensor-memory columns, or
    # spilled.)
    "attention_jvp/h256/16bit": _(64, 32, num_warps=8, num_stages=2),
    # The f32 tangent pass at head_dim 256, the head dim split in four: 64 x 16 on 8 warps, one
    # stage, tcgen05, 248 registers, no spills, 472.5 -> 346.0 main-loop instructions per unique
    # S element (all four parts counted; sm_90's 16 x 16 mma.sync tile before, 197 registers).
    # 2.8x the MMA work (each part recomputes S and dS). In two parts: 48 B of spills; 4 warps:
    # 808 B. On sm_90 the only tile without spills, 64 x 16 on 4 warps in four parts, issues
    # 583 against 487: sm_90 keeps mma.sync.
    "attention_jvp/h256/f32": _(64, 16, num_warps=8, num_stages=1, head_split=4),
    # f32 dq at head_dim 256, head dim split in two as on sm_90: sm_90's 64 x 16 on 4 warps
    # spilled 992 B, its two stages asked for 576 tensor-memory columns; 64 x 16 on 8 warps,
    # one stage: tcgen05, 252 registers, no spills, 248.8 -> 152.5 main-loop instructions per
    # unique S element (both halves). (The forward takes sm_90's split tile: tcgen05, 255
    # registers, no spills, 120.1 -> 97.5.)
    "attention_bwd_dq/h256/f32": _(64, 16, num_warps=8, num_stages=1, head_split=2),
    # linear_cross_entropy, 16-bit: dw's two stages spilled 16-200 B at 128 tokens (one stage
    # keeps 128 tokens per step, 254 registers); dx takes the table layout's 32-wide D chunks
    # (64 B of spills at 64).
    "linear_cross_entropy_bwd_dw/16bit": _(128, 64, 64, num_warps=4, num_stages=1, blocks_per_sm=2),
    "linear_cross_entropy_bwd_dx/16bit": _(64, 128, 32, num_warps=4, num_stages=2, blocks_per_sm=2),
    # f32 dw: 64-wide D chunks put its dots on tcgen05 (32-wide: partly mma.sync); 255
    # registers, no spills. The table layout keeps 32 (all tcgen05 there; 56 B of spills at
    # 64). Under 3xTF32, 16-wide (104 B of spills at 32; part of its dots on mma.sync).
    "linear_cross_entropy_bwd_dw/f32": _(64, 64, 64, num_warps=4, num_stages=2, blocks_per_sm=2),
    "linear_cross_entropy_bwd_dw/f32/table": _(64, 64, 32, num_warps=4, num_stages=2, blocks_per_sm=2),
    "linear_cross_entropy_bwd_dw/f32/x3": _(64, 64, 16, num_warps=4, num_stages=2, blocks_per_sm=2),
    # 3xTF32 (compiled): sm_90's forward at head_dim 80-128 spilled 768 B (64 x 32 on 8 warps:
    # 255 registers, none); dk/dv at head_dim 64 376 B (32 x 64 keys first on 8 warps: 254,
    # none); the tangent pass at head_dim 64 376 B (64 x 16 on 8 warps, tcgen05: 188, none).
    # At head_dim 80-128 dq, dk/dv and the tangent pass keep sm_90's mma.sync tiles (every
    # tcgen05 tile spilled 264-1912 B; dk/dv's is pinned here, as its f32 entry above
    # changed), and at 256 the budgets in tests/test_compile.py.
    "attention_bwd_dkdv/h128/f32/x3": _(16, 32, num_warps=8, num_stages=1),
    "attention_fwd/h128/f32/x3": _(64, 32, num_warps=8, num_stages=1),
    "attention_bwd_dkdv/h64/f32/x3": _(32, 64, num_warps=8, num_stages=1, keys_first=True),
    "attention_jvp/h64/f32/x3": _(64, 16, num_warps=8, num_stages=1),
    # group_norm's f32 sums kernel with the fused SiLU: 98 registers on sm_100 (95 on sm_90),
    # 4 blocks per SM (5 would size its grid at 1.16 waves).
    "group_norm_bwd/silu/f32": _(0, 2048, num_warps=8, blocks_per_sm=4),
}

_OVERRIDES: dict[str, dict[str, dict]] = {}


def arch() -> str:
    """The table's key for the GPU being built for: ``"sm_100"``, ``"sm_90"`` or ``"sm_80"``."""
    sm = C.sm_version()
    return "sm_100" if sm >= 100 else "sm_90" if sm >= 90 else "sm_80"


def get(key: str) -> Config:
    """The table entry ``key`` (``"kernel/variant"``, one of :func:`requests`) for the current
    architecture, with any loaded override applied; a variant missing from the table falls
    back to its shorter prefixes (``"a/b/c"`` -> ``"a/b"`` -> ``"a"``). Overrides apply from
    the shortest prefix to ``key`` itself, so the more specific one wins.

    Raises: KeyError for a key that is not one of :func:`requests` (a heuristic asking for a
    variant the override check would not know) or that the table has no prefix of."""
    if key not in requests():
        raise KeyError(f"jaxbwd: {key!r} is not a launch configuration the heuristics ask for "
                       f"(_tuning.requests)")
    a = arch()
    table = TABLE[a]
    k = key
    while k not in table and "/" in k:
        k = k.rsplit("/", 1)[0]
    if k not in table:
        raise KeyError(f"jaxbwd: no launch configuration {key!r} for {a}")
    return dataclasses.replace(table[k], **_overridden(key))


def _overridden(key: str) -> dict:
    """The fields the loaded overrides set for ``key``: those of each "/"-prefix of it, from
    the shortest to ``key`` itself (the more specific one wins)."""
    over, out = _OVERRIDES.get(arch(), {}), {}
    parts = key.split("/")
    for n in range(1, len(parts) + 1):
        out.update(over.get("/".join(parts[:n]), {}))
    return out


def _check_overrides(data: Mapping, where: str = "jaxbwd tuning") -> dict[str, dict[str, dict]]:
    """``{arch: {key: {field: value}}}`` checked: known architectures, keys that are one of
    :func:`requests` or a prefix of one at a "/" (any other key would match nothing and be
    ignored: a misspelt kernel or variant), known fields that the kernels there read
    (:func:`fields`), and positive ints (powers of two for block sizes, warps and head
    splits, as Triton's tiles and launches need) or, for ``keys_first``, a bool. Raises
    TypeError/ValueError naming ``where``."""
    def mapping(value, what):
        if not isinstance(value, Mapping):
            raise TypeError(f"{where}: {what} must be a mapping (a JSON object), got {type(value).__name__}: "
                            f"{value!r}")
        return value

    names = {f.name for f in dataclasses.fields(Config)}
    flags = {f.name for f in dataclasses.fields(Config) if f.type in (bool, "bool")}
    out: dict[str, dict[str, dict]] = {}
    for a, entries in mapping(data, "the overrides").items():
        if a not in TABLE:
            raise ValueError(f"{where}: architecture must be one of {sorted(TABLE)}, got {a!r}")
        for key, vals in mapping(entries, f"{a}'s entries").items():
            _check_key(key, f"{where}: {a}")
            bad = set(mapping(vals, f"{a} {key}")) - names
            if bad:
                raise ValueError(f"{where}: {a} {key}: unknown fields {sorted(bad)} (known: {sorted(names)})")
            used = frozenset().union(*(fields(r) for r in requests() if r == key or r.startswith(key + "/")))
            unused = sorted(set(vals) - used)
            if unused:
                raise ValueError(f"{where}: {a} {key}: {', '.join(unused)} not read by the kernel there "
                                 f"(it reads {', '.join(sorted(used))})")
            for name, v in vals.items():
                if name in flags:
                    if not isinstance(v, bool):
                        raise ValueError(f"{where}: {a} {key}: {name} must be true or false, got {v!r}")
                    continue
                pow2 = name.startswith("block_") or name in ("num_warps", "head_split")
                if isinstance(v, bool) or not isinstance(v, int) or v < 1 or (pow2 and v & (v - 1)):
                    want = "an int that is a power of two" if pow2 else "an int >= 1"
                    raise ValueError(f"{where}: {a} {key}: {name} must be {want}, got {v!r}")
            out.setdefault(a, {})[key] = dict(vals)
    return out


def _check_key(key, where: str) -> None:
    """Raises ValueError unless ``key`` is one of :func:`requests` or a "/"-prefix of one,
    naming the variants that could follow its longest valid prefix."""
    keys = requests()
    kernels = sorted({k.split("/")[0] for k in keys})
    if not isinstance(key, str) or key.split("/")[0] not in kernels:
        raise ValueError(f"{where}: no kernel {key!r} in the table (kernels: {kernels})")
    if key in keys or any(k.startswith(key + "/") for k in keys):
        return
    parts = key.split("/")
    stem = next(p for p in ("/".join(parts[:n]) for n in range(len(parts) - 1, 0, -1))
                if p in keys or any(k.startswith(p + "/") for k in keys))
    nxt = sorted({k[len(stem) + 1:].split("/")[0] for k in keys if k.startswith(stem + "/")},
                 key=lambda v: (len(v), v))
    if not nxt:
        raise ValueError(f"{where}: no variant {key!r} of {parts[0]} ({stem} is a whole variant: nothing "
                         f"follows it)")
    shown = nxt if len(nxt) <= 8 else nxt[:4] + ["...", nxt[-1]]
    raise ValueError(f"{where}: no variant {key!r} of {parts[0]} (after {stem}/ comes one of: "
                     f"{', '.join(shown)})")


def load(path: str) -> None:
    """Reads measured configurations (JSON, see the module docstring) over the table.

    Raises: OSError (the file cannot be read), ValueError/TypeError (not JSON, or not the
    layout :func:`use` takes), each naming the file."""
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"jaxbwd tuning file {path}: not valid JSON ({e})") from None
    for a, entries in _check_overrides(data, f"jaxbwd tuning file {path}").items():
        _OVERRIDES.setdefault(a, {}).update(entries)


@contextlib.contextmanager
def use(overrides: Mapping[str, Mapping[str, Mapping[str, int]]]) -> Iterator[None]:
    """Applies ``{arch: {key: {field: value}}}`` while tracing inside the block (config
    sweeps). Raises ValueError/TypeError as :func:`load` does for a malformed mapping."""
    checked = _check_overrides(overrides)
    saved = {a: dict(e) for a, e in _OVERRIDES.items()}
    for a, entries in checked.items():
        _OVERRIDES.setdefault(a, {}).update(entries)
    try:
        yield
    finally:
        _OVERRIDES.clear()
        _OVERRIDES.update(saved)


# ------------------------------------------------------------------------ heuristics


_ATTENTION_KERNELS = ("attention_fwd", "attention_bwd_dkdv", "attention_bwd_dq", "attention_jvp")
_LCE_KERNELS = ("linear_cross_entropy_fwd", "linear_cross_entropy_bwd_dx", "linear_cross_entropy_bwd_dw")
_COLUMN_SUM_KERNELS = ("bias_add_dbias", "bias_dropout_add_bwd", "batch_norm_bwd_reduce")
_DTYPES = ("16bit", "f32", "f32/x3")  # _bits(dtype) + _x3(dtype)


@functools.cache
def requests() -> frozenset[str]:
    """Every key the heuristics below can ask :func:`get` for (``get`` refuses any other, so
    the tests that run the kernels keep this set complete). An override's key must be one
    of these or a prefix of one at a "/".

    Returns: frozenset of str, e.g. ``"attention_bwd_dkdv/h128/f32/x3"``, ``"norm_bwd"``,
    ``"linear_cross_entropy_bwd_dw/f32/table/x3"``, ``"norm_bwd/rms/c4096/chunked"`` (``c``:
    any power of two up to 2**62)."""
    keys = {f"{k}/h{h}/{d}" for k in _ATTENTION_KERNELS for h in (64, 128, 256) for d in _DTYPES}
    keys |= {f"{k}/{b}{t}{x}" for k in _LCE_KERNELS for b, x in (("16bit", ""), ("f32", ""), ("f32", "/x3"))
             for t in ("", "/table")}
    keys |= {f"{k}/{d}" for k in _COLUMN_SUM_KERNELS for d in ("16bit", "f32")}
    keys |= {f"{k}/{d}" for k in ("conv2d_dgrad", "conv2d_wgrad") for d in _DTYPES + ("depthwise",)}
    keys |= {f"group_norm_bwd/{s}{d}" for s in ("", "silu/") for d in ("16bit", "f32")}
    keys |= {"norm_bwd"} | {f"norm_bwd/{n}/c{2 ** i}{c}"
                            for n in ("layer", "rms") for i in range(63) for c in ("", "/chunked")}
    return frozenset(keys)


def fields(key: str) -> frozenset[str]:
    """The Config fields the kernels read from the entry of request ``key`` (one of
    :func:`requests`); an override may set only these at a key, or at a prefix those of the
    requests under it (any other would be ignored)."""
    kernel, _, variant = key.partition("/")
    launch = {"num_warps", "num_stages"}
    if kernel.startswith("attention_"):
        out = launch | {"block_m", "block_n"} | ({"keys_first"} if kernel == "attention_bwd_dkdv" else set())
        out |= {"head_split"}
    elif kernel.startswith("linear_cross_entropy_"):  # dx's grid is not sized by occupancy
        out = launch | {"block_m", "block_n", "block_k"} | (
            set() if kernel == "linear_cross_entropy_bwd_dx" else {"blocks_per_sm"})
    elif kernel in _COLUMN_SUM_KERNELS:
        out = launch | {"block_m", "block_n", "blocks_per_sm"}
    elif kernel in ("conv2d_dgrad", "conv2d_wgrad"):  # depthwise: no channel-block K
        out = launch | {"block_m", "block_n"} | (set() if variant == "depthwise" else {"block_k"})
        out |= {"blocks_per_sm"} if kernel == "conv2d_wgrad" else set()
    elif kernel == "group_norm_bwd":
        out = {"block_n", "num_warps", "blocks_per_sm"}
    else:  # norm_bwd: the kernel's own entry gives the chunk width, each width its launch
        out = {"block_n"} if not variant else launch | {"blocks_per_sm"}
    return frozenset(out)


def _bits(dtype) -> str:
    """The table's dtype variant: ``"16bit"`` (bf16, f16) or ``"f32"``."""
    return "16bit" if jnp.dtype(dtype).itemsize == 2 else "f32"


def _x3(dtype) -> str:
    """``"/x3"``, the last part of a variant, for f32 whose dots run as 3xTF32
    (``jax.default_matmul_precision("highest")``, see ``_common.dot``): three products per
    dot and each tile split in two, so the kernels with dots need their own tiles there;
    ``get`` falls back to the f32 entry where the table has none. Else ``""``."""
    x3 = _bits(dtype) == "f32" and C.f32_dot_precision() == lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    return "/x3" if x3 else ""


def group_norm(dtype, silu: bool) -> Config:
    """group_norm's backward grid and tile (block_n elements per [block_s, C] tile)."""
    return get(f"group_norm_bwd/{'silu/' if silu else ''}{_bits(dtype)}")


def split(tiles: int, steps: int, cfg: Config, *, max_waves: int = 1, min_steps: int = 1,
          max_split: int | None = None) -> int:
    """Programs per tile for ``tiles`` independent reductions of ``steps`` sequential steps
    each (rows of a norm's weight gradient, a conv wgrad's pixel blocks): the one helper that
    sizes persistent and split-K grids.

    The GPU runs ``slots = cfg.blocks_per_sm * num_sms`` programs at once (the compiled
    occupancy). Splitting each reduction over ``s`` programs takes
    ``ceil(tiles * s / slots)`` waves of ``ceil(steps / s)`` steps; the smallest ``s``
    minimising their product is chosen, with at most ``max_waves`` waves (1: a persistent
    grid), at least ``min_steps`` steps per program (pipelining needs a few) and at most
    ``max_split`` programs per tile (each writes a partial result).
    """
    slots = max(1, cfg.blocks_per_sm * C.num_sms())
    hi = max(1, min(steps // max(1, min_steps), C.cdiv(max_waves * slots, max(1, tiles))))
    if max_split is not None:
        hi = max(1, min(hi, max_split))
    if tiles * 1 > max_waves * slots:
        return 1
    best, best_s = None, 1
    for s in range(1, hi + 1):
        if tiles * s > max_waves * slots:
            break
        cost = C.cdiv(tiles * s, slots) * C.cdiv(steps, s)
        if best is None or cost < best:
            best, best_s = cost, s
    return best_s


def attention(kind: str, Hp: int, dtype, T: int, S: int) -> Config:
    """Tiles of attention kernel ``kind`` ("attention_fwd", "attention_bwd_dkdv",
    "attention_bwd_dq", "attention_jvp") at padded head dim ``Hp``: block_m query rows,
    block_n key rows, capped at the (power-of-two padded) sequence lengths. Under 3xTF32
    the table's ``f32/x3`` entries; where it has none, the f32 tiles capped at 64 x 32 (block
    sizes an override sets for the ``f32/x3`` key, itself or a prefix of it, are taken as
    they are)."""
    h = 64 if Hp <= 64 else 128 if Hp <= 128 else 256
    key = f"{kind}/h{h}/{_bits(dtype)}{_x3(dtype)}"
    cfg = get(key)
    bq, bk = cfg.block_m, cfg.block_n
    if key.endswith("/x3") and key not in TABLE[arch()]:
        own = _overridden(key)
        bq, bk = own.get("block_m", min(bq, 64)), own.get("block_n", min(bk, 32))
    bq, bk = min(bq, max(16, C.next_pow2(T))), min(bk, max(16, C.next_pow2(S)))
    return dataclasses.replace(cfg, block_m=bq, block_n=bk)


def linear_cross_entropy(kernel: str, dtype, transpose_w: bool) -> Config:
    """Tiles of a linear_cross_entropy kernel (``linear_cross_entropy_fwd``, ``_bwd_dx`` or
    ``_bwd_dw``): block_m tokens, block_n vocabulary columns, block_k the D chunk of the
    logit dots; ``transpose_w`` (w as an embedding table [V, D]) has its own entries."""
    return get(f"{kernel}/{_bits(dtype)}{'/table' if transpose_w else ''}{_x3(dtype)}")


def column_sum(dtype, kernel: str = "bias_add_dbias") -> Config:
    """Tiles of a column-sum kernel (block_m rows x block_n columns per step): bias_add's
    ``bias_add_dbias`` or a fused one such as ``bias_dropout_add_bwd``."""
    return get(f"{kernel}/{_bits(dtype)}")


def conv(kernel: str, dtype, depthwise: bool) -> Config:
    """Tiles of ``conv2d_dgrad``/``conv2d_wgrad`` (dimensions in conv.py's docstring)."""
    variant = "depthwise" if depthwise else _bits(dtype) + _x3(dtype)
    return get(f"{kernel}/{variant}")


def norm_bwd(n_rows: int, n_cols: int, centered: bool = True) -> tuple[C.RowTiling, Config]:
    """Row tiling of the norm backward (layer_norm when ``centered``, else rms_norm): whole
    rows up to the table's ``block_n`` columns (wider rows are cut into that many-column
    chunks, one per program), about 16 elements per thread and operand, several rows per
    step when rows are short."""
    block_cols = min(C.next_pow2(n_cols), get("norm_bwd").block_n)
    chunked = "/chunked" if n_cols > block_cols else ""
    cfg = get(f"norm_bwd/{'layer' if centered else 'rms'}/c{block_cols}{chunked}")
    block_rows = max(1, min(4096 // block_cols, 64, C.next_pow2(n_rows)))
    warps = max(1, min(cfg.num_warps, block_rows * block_cols // 512))
    return C.RowTiling(n_rows, n_cols, block_rows, block_cols, warps), cfg


# Measured winners named by the environment, checked against the heuristics' keys above.
if os.environ.get("JAXBWD_TUNING"):
    try:
        load(os.environ["JAXBWD_TUNING"])
    except OSError as e:  # at import: say which setting named the file
        raise OSError(e.errno, f"jaxbwd: JAXBWD_TUNING names a file that cannot be read ({e.strerror})",
                      os.environ["JAXBWD_TUNING"]) from e
    except (ValueError, TypeError) as e:
        raise type(e)(f"jaxbwd: JAXBWD_TUNING: {e}") from None
