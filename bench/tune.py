"""Sweeps a few launch configurations of the hot kernels on the GPU at hand and writes the
fastest per tuning-table key as JSON that ``jaxbwd.pallas._tuning.load`` reads
(``JAXBWD_TUNING=path``); also times conv2d's backward against XLA's (cuDNN) in bf16. The
table's own configuration of each key is timed first, and a key is written only where a
candidate beat it.

Attention (B=2, N=16, H=128, T=4096, causal, bf16) is timed fwd+bwd, so a dk/dv or dq
configuration is judged by the whole step it changes; ``attention_f32_h256`` (B=1, T=4096,
N=16, K=8, H=256, causal with a 1024-key window, f32 at the default TF32 precision) weighs
the forward's and dq's head-dim split on wgmma against their unsplit mma.sync tiles; conv2d
at the UNet shape [8, 64, 64, 320] * 3x3x320x320 (bf16) likewise, and linear_cross_entropy's
three kernels by its loss and grads at T=8192, D=2048, V=128256 (bf16; against its XLA
implementation and the unfused ``matmul`` + ``cross_entropy``). TFLOP/s: attention forward
4*B*N*T*S*H halved when causal (4*B*N*H per (query, key) pair inside the window for
attention_f32_h256), backward 2.5x the forward (FlashAttention convention); conv2d forward
2*N*Ho*Wo*Cout*KH*KW*Cin, dgrad and wgrad the same each; linear_cross_entropy 2*T*D*V for the
logits and the same for each gradient. Needs a GPU: without one it says so in one line on
stderr and exits with status 0, before looking at the other arguments, nothing timed and
nothing written (as bench/mosaic_attention.py does), so that bench/gpu_check.sh goes on.

    python bench/tune.py --json OUT.json [--ops attention attention_f32_h256 conv2d linear_cross_entropy] [--repeats N]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import jax
import jax.numpy as jnp

import jaxbwd
from jaxbwd.bench import median_time
from jaxbwd.pallas import _tuning

import _cli  # bench/_cli.py: this script's folder is first on sys.path

F = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "blocks_per_sm", "head_split")
# key -> candidate (block_m, block_n, block_k, num_warps, num_stages[, blocks_per_sm[,
# head_split]]), zeros left out; a candidate whose occupancy differs from the table entry's
# says so, since split grids are sized from it.
SWEEPS = {
    "attention_fwd/h128/16bit": [(128, 64, 0, 8, 2), (128, 64, 0, 8, 3), (128, 128, 0, 8, 2), (64, 64, 0, 4, 2)],
    "attention_bwd_dq/h128/16bit": [(128, 64, 0, 8, 2), (128, 64, 0, 8, 3), (64, 64, 0, 8, 2), (128, 32, 0, 8, 2)],
    # (64 x 64 on 4 warps with 2 stages: sm_90's entry; sm_100's takes 1 stage, 2 spilled 16 B.)
    "attention_bwd_dkdv/h128/16bit": [(64, 64, 0, 8, 2), (64, 64, 0, 8, 3), (64, 128, 0, 8, 2), (32, 64, 0, 4, 2),
                                      (64, 64, 0, 4, 2)],
    # f32 at head_dim 256: the head dim split between programs on wgmma (sm_90's entries split
    # in two; dq also in four) against the unsplit mma.sync tiles they replaced (head_split
    # 1), all without spills on H200.
    "attention_fwd/h256/f32": [(32, 32, 0, 4, 2, 0, 1), (128, 32, 0, 8, 1, 0, 2), (64, 32, 0, 4, 1, 0, 2),
                               (128, 16, 0, 8, 2, 0, 2)],
    "attention_bwd_dq/h256/f32": [(32, 32, 0, 8, 2, 0, 1), (64, 16, 0, 4, 1, 0, 2), (64, 16, 0, 8, 1, 0, 4)],
    "conv2d_dgrad/16bit": [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 32, 8, 4), (128, 64, 64, 4, 3)],
    "conv2d_wgrad/16bit": [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 32, 8, 4), (64, 128, 64, 4, 3)],
    # linear_cross_entropy: block_m tokens, block_n vocabulary columns, block_k the D chunk. 128
    # tokens on 8 warps give each Hopper warpgroup its own 64 rows; dx's read-modify-write of
    # its running sums per vocabulary block shrinks with block_n; dw's 128 columns double its
    # slab of sums (temporary memory).
    "linear_cross_entropy_fwd/16bit": [(64, 128, 64, 4, 2), (64, 128, 64, 4, 3), (128, 128, 64, 8, 2, 1),
                                       (64, 64, 64, 4, 3)],
    "linear_cross_entropy_bwd_dx/16bit": [(64, 128, 64, 4, 2), (64, 128, 64, 4, 3), (128, 128, 64, 8, 2),
                                          (128, 128, 32, 8, 3)],
    "linear_cross_entropy_bwd_dw/16bit": [(128, 64, 64, 4, 2), (128, 64, 64, 4, 3), (64, 64, 64, 4, 2),
                                          (128, 128, 64, 8, 2)],
}


def _attention_case():
    B, T, N, H = 2, 4096, 16, 128
    q, k, v, do = (jax.random.normal(jax.random.PRNGKey(i), (B, T, N, H), jnp.bfloat16) for i in range(4))
    flops = 3.5 * 4 * B * N * T * T * H / 2
    return (q, k, v, do), flops, {
        "jaxbwd": lambda q, k, v: jaxbwd.dot_product_attention(q, k, v, is_causal=True),
        "cudnn": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"),
        "xla": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla"),
    }


def _attention_f32_h256_case():
    B, T, N, K, H, W = 1, 4096, 16, 8, 256, 1024
    q, do = (jax.random.normal(jax.random.PRNGKey(i), (B, T, N, H), jnp.float32) for i in (0, 3))
    k, v = (jax.random.normal(jax.random.PRNGKey(i), (B, T, K, H), jnp.float32) for i in (1, 2))
    pairs = W * (W + 1) // 2 + (T - W) * W  # (query, key) pairs inside the causal window
    flops = 3.5 * 4 * B * N * pairs * H
    return (q, k, v, do), flops, {
        "jaxbwd": lambda q, k, v: jaxbwd.dot_product_attention(q, k, v, is_causal=True, sliding_window=W),
        "xla": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=(W - 1, 0),
                                                            implementation="xla"),
    }


def _conv_case():
    x = jax.random.normal(jax.random.PRNGKey(0), (8, 64, 64, 320), jnp.bfloat16)
    w = (0.05 * jax.random.normal(jax.random.PRNGKey(1), (3, 3, 320, 320))).astype(jnp.bfloat16)
    dy = jax.random.normal(jax.random.PRNGKey(2), (8, 64, 64, 320), jnp.bfloat16)
    flops = 3 * 2 * 8 * 64 * 64 * 320 * 9 * 320
    return (x, w, dy), flops, {
        "jaxbwd": lambda x, w: jaxbwd.conv2d(x, w, padding=1, implementation="pallas"),
        "xla": lambda x, w: jaxbwd.conv2d(x, w, padding=1, implementation="xla"),
    }


def _linear_cross_entropy_case(T=8192, D=2048, V=128256):
    x = jax.random.normal(jax.random.PRNGKey(0), (T, D), jnp.bfloat16)
    w = (0.02 * jax.random.normal(jax.random.PRNGKey(1), (D, V))).astype(jnp.bfloat16)
    labels = jax.random.randint(jax.random.PRNGKey(2), (T,), 0, V)
    # Useful flops: the logits and their two gradients (the kernels also recompute the logits
    # twice in the backward, not counted).
    flops = 3 * 2 * T * D * V
    return (x, w, jnp.ones((), jnp.bfloat16)), flops, {  # the loss is in the operands' dtype
        "jaxbwd": lambda x, w: jaxbwd.linear_cross_entropy(x, w, labels, implementation="pallas"),
        "xla": lambda x, w: jaxbwd.linear_cross_entropy(x, w, labels, implementation="xla"),
        "unfused": lambda x, w: jaxbwd.cross_entropy(jaxbwd.matmul(x, w, implementation="pallas"), labels,
                                                     implementation="pallas"),
    }


CASES = {"attention": _attention_case, "attention_f32_h256": _attention_f32_h256_case, "conv2d": _conv_case,
         "linear_cross_entropy": _linear_cross_entropy_case}


def case_of(key: str) -> str:
    """The case (a key of ``CASES``) that times the tuning-table key ``key``."""
    if key.startswith("attention_") and key.endswith("/h256/f32"):
        return "attention_f32_h256"
    return next(c for c in CASES if key.startswith(c))


def _time(f, args, repeats):
    *inputs, ct = args
    step = jax.jit(lambda *a: jax.vjp(f, *a[:-1])[1](a[-1]))
    return median_time(step, *inputs, ct, repeats=repeats, warmup=1)


def sweep(key: str, candidates, time_one):
    """Times the tuning table's own configuration of ``key`` (as ``config`` None) and then each
    candidate (a tuple in ``F``'s order, zeros left out) that differs from it;
    ``time_one(override) -> seconds`` may raise where a configuration does not compile.

    Returns ``(override, rows)``: the fastest candidate's override, or None where the
    table's own configuration was fastest (or the only one that ran), so that the JSON never
    replaces an entry by a slower configuration; and one row per configuration timed
    (``key``, ``config``, ``ms``) or failed (``error`` instead of ``ms``)."""
    own = _tuning.get(key)
    overs = [None]
    for c in candidates:
        over = {f: v for f, v in zip(F, c) if v}
        if dataclasses.replace(own, **over) != own and over not in overs:
            overs.append(over)
    rows, timed = [], []
    for over in overs:
        try:
            t = time_one(over or {})
        except Exception as e:  # a configuration over the shared memory or register limits
            rows.append({"key": key, "config": over, "error": type(e).__name__})
            continue
        rows.append({"key": key, "config": over, "ms": t * 1e3})
        timed.append((t, len(timed), over))
    return (min(timed)[2] if timed else None), rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=_cli.description(__doc__))
    # --json is required, but checked after the GPU: without one, that is all there is to say.
    p.add_argument("--json", metavar="PATH", help="where to write the fastest configurations (required)")
    p.add_argument("--repeats", type=int, default=10, help="timed runs per configuration (median reported)")
    p.add_argument("--ops", nargs="+", choices=CASES, default=list(CASES), help="which ops to sweep and time")
    args = p.parse_args(argv)
    if jax.default_backend() != "gpu":
        return _cli.skip(p.prog, f"a GPU (this backend: {jax.default_backend()})")
    if not args.json:
        return _cli.refuse(p.prog, "--json PATH is required")
    problem = _cli.bad_arguments(args)
    if problem:
        return _cli.refuse(p.prog, problem)
    arch = _tuning.arch()
    cases = {name: CASES[name]() for name in args.ops}
    best, log = {}, []
    for key, candidates in SWEEPS.items():
        op = case_of(key)
        if op not in cases:
            continue
        inputs, flops, impls = cases[op]

        def time_one(over, key=key, inputs=inputs, impl=impls["jaxbwd"]):
            with _tuning.use({arch: {key: over}}):
                return _time(impl, inputs, args.repeats)

        won, rows = sweep(key, candidates, time_one)
        for r in rows:
            label = "table" if r["config"] is None else tuple(r["config"].values())
            if "ms" not in r:
                print(f"{key:36s} {label}  failed: {r['error']}")
                continue
            log.append({**r, "tflop_s": flops / r["ms"] * 1e-9})
            print(f"{key:36s} {label}  {r['ms']:8.3f} ms  {flops / r['ms'] * 1e-9:6.1f} TFLOP/s")
        if won is not None:
            best[key] = won
    with _tuning.use({arch: best}):
        for name, (inputs, flops, impls) in cases.items():
            for impl, f in impls.items():
                try:
                    t = _time(f, inputs, args.repeats)
                except Exception as e:  # e.g. no cuDNN attention for this GPU
                    print(f"{name:20s} {impl:7s} failed: {type(e).__name__}: {str(e)[:100]}")
                    continue
                log.append({"case": name, "impl": impl, "ms": t * 1e3, "tflop_s": flops / t / 1e12})
                print(f"{name:20s} {impl:7s} fwd+bwd {t * 1e3:8.3f} ms  {flops / t / 1e12:6.1f} TFLOP/s")
    with open(args.json, "w") as fh:
        json.dump({arch: best}, fh, indent=1)
    with open(args.json.replace(".json", "") + "_log.json", "w") as fh:
        json.dump({"date": time.strftime("%Y-%m-%d"), "device": jax.devices()[0].device_kind, "rows": log}, fh, indent=1)
    print(f"wrote {args.json} (load with JAXBWD_TUNING={args.json})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
