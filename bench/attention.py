"""Attention benchmark: fwd+bwd of jaxbwd.dot_product_attention vs autodiff and vs JAX's own.

At B=2, N=16, H=128, bf16, causal, T in {1k, 4k, 8k}: median time of forward + backward
for jaxbwd (Pallas on GPU), ``jax.grad`` of the plain reference (XLA autodiff, T x T
probabilities) and ``jax.nn.dot_product_attention`` (``implementation="cudnn"`` on GPU,
XLA elsewhere; and ``implementation="xla"``), with TFLOP/s counted as forward 4*B*N*T*S*H (halved when causal) and the
backward as 2.5x the forward (the FlashAttention-2 convention), and the residual bytes
each keeps for the backward. Without a GPU, jaxbwd runs its blockwise XLA path and the
sizes shrink to what a CPU finishes in seconds.

    python bench/attention.py [--json PATH] [--repeats N] [--seqs T ...]
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp

import jaxbwd
from jaxbwd import reference
from jaxbwd.bench import median_time

import _cli  # bench/_cli.py: this script's folder is first on sys.path


def _residual_bytes(f, *args):
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(jax.vjp(f, *args)[1])
                   if hasattr(x, "dtype")))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=_cli.description(__doc__))
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument("--repeats", type=int, default=10, help="timed runs per case; the median is reported (default 10)")
    p.add_argument("--seqs", type=int, nargs="+", metavar="T",
                   help="sequence lengths (default 1024 4096 8192 on a GPU, 256 1024 elsewhere)")
    args = p.parse_args(argv)
    problem = _cli.bad_arguments(args)
    if problem:  # before the timing, not after it
        return _cli.refuse(p.prog, problem)
    on_gpu = jax.default_backend() == "gpu"
    B, N, H = (2, 16, 128) if on_gpu else (1, 4, 64)
    seqs = args.seqs or ((1024, 4096, 8192) if on_gpu else (256, 1024))
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    impls = {
        "jaxbwd": lambda q, k, v: jaxbwd.dot_product_attention(q, k, v, is_causal=True),
        "autodiff": lambda q, k, v: reference.dot_product_attention(q, k, v, is_causal=True),
        "jax.nn": lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="cudnn" if on_gpu else None),
        "jax.nn-xla": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla"),
    }
    w = max(map(len, impls))  # the name column fits the longest name ("jax.nn-xla")
    rows = []
    print(f"attention fwd+bwd, B={B}, N={N}, H={H}, {jnp.dtype(dtype).name}, causal, "
          f"{jax.devices()[0].device_kind}, jax {jax.__version__}")
    for T in seqs:
        ks = jax.random.split(jax.random.PRNGKey(T), 4)
        q, k, v, do = (jax.random.normal(kk, (B, T, N, H), jnp.float32).astype(dtype) for kk in ks)
        fwd_flops = 4 * B * N * T * T * H / 2
        for name, f in impls.items():
            step = jax.jit(lambda q, k, v, do, f=f: jax.vjp(f, q, k, v)[1](do))
            try:
                t = median_time(step, q, k, v, do, repeats=args.repeats, warmup=1)
            except Exception as e:  # e.g. cuDNN missing or out of memory at 8k for autodiff
                rows.append({"T": T, "impl": name, "error": f"{type(e).__name__}: {str(e)[:120]}"})
                print(f"T={T:5d} {name:{w}s} failed: {type(e).__name__}")
                continue
            res = _residual_bytes(f, q, k, v)
            row = {"T": T, "impl": name, "ms": t * 1e3, "tflop_s": 3.5 * fwd_flops / t / 1e12, "residual_mib": res / 2**20}
            rows.append(row)
            print(f"T={T:5d} {name:{w}s} {row['ms']:9.3f} ms  {row['tflop_s']:7.2f} TFLOP/s  residuals {row['residual_mib']:9.1f} MiB")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"date": time.strftime("%Y-%m-%d"), "jax": jax.__version__,
                       "device": jax.devices()[0].device_kind, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
