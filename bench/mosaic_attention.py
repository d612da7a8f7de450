"""Attention on Hopper by backend: jaxbwd's Mosaic GPU kernels vs its Triton kernels vs cuDNN
(``jax.nn.dot_product_attention(implementation="cudnn")``) vs jaxbwd's XLA path.

B=1, bf16, causal, T = S in {4096, 8192}, N=32 query heads over K=8 kv heads at H=128 and
Gemma 2's N=16 over K=8 at H=256 (where the Mosaic backward splits dk and dv): median
time of the forward and of forward + backward, TFLOP/s counted as forward 4*B*N*T*S*H/2 and
the backward as 2.5x the forward (the FlashAttention-2 convention). The Mosaic output and
gradients are compared with the Triton ones first, so a wrong kernel prints an error, not a
time. Needs an sm_90 GPU (the Mosaic kernels are Hopper-only): elsewhere it says so in one
line on stderr and exits with status 0, before looking at the other arguments, nothing timed
and nothing written (as bench/tune.py does without a GPU), so that bench/gpu_check.sh goes on.

    python bench/mosaic_attention.py [--json PATH] [--repeats N]
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp

import jaxbwd
from jaxbwd.bench import median_time
from jaxbwd.pallas import _common as C

import _cli  # bench/_cli.py: this script's folder is first on sys.path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=_cli.description(__doc__))
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument("--repeats", type=int, default=10, help="timed runs per case (median reported)")
    args = p.parse_args(argv)
    if jax.default_backend() != "gpu" or C.sm_version() != 90:
        return _cli.skip(p.prog, f"an sm_90 GPU (Hopper; this backend: {jax.default_backend()})")
    problem = _cli.bad_arguments(args)
    if problem:
        return _cli.refuse(p.prog, problem)
    B = 1
    impls = {
        "mosaic": lambda q, k, v: jaxbwd.dot_product_attention(q, k, v, is_causal=True, implementation="pallas:mosaic"),
        "triton": lambda q, k, v: jaxbwd.dot_product_attention(q, k, v, is_causal=True, implementation="pallas:triton"),
        "cudnn": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"),
        "xla": lambda q, k, v: jaxbwd.dot_product_attention(q, k, v, is_causal=True, implementation="xla"),
    }
    rows = []
    print(f"attention B={B} bf16 causal, {jax.devices()[0].device_kind}, jax {jax.__version__}")
    for (N, K, H), T in ((nkh, T) for nkh in ((32, 8, 128), (16, 8, 256)) for T in (4096, 8192)):
        ks = jax.random.split(jax.random.PRNGKey(T), 4)
        q, do = (jax.random.normal(kk, (B, T, N, H), jnp.float32).astype(jnp.bfloat16) for kk in ks[:2])
        k, v = (jax.random.normal(kk, (B, T, K, H), jnp.float32).astype(jnp.bfloat16) for kk in ks[2:])
        fwd_flops = 4 * B * N * T * T * H / 2
        steps = {name: (jax.jit(f), jax.jit(lambda q, k, v, do, f=f: jax.vjp(f, q, k, v)[1](do)))
                 for name, f in impls.items()}
        try:
            want = jax.tree.map(lambda x: x.astype(jnp.float32), (steps["triton"][0](q, k, v), steps["triton"][1](q, k, v, do)))
            got = jax.tree.map(lambda x: x.astype(jnp.float32), (steps["mosaic"][0](q, k, v), steps["mosaic"][1](q, k, v, do)))
            err = max(float(jnp.max(jnp.abs(a - b)) / jnp.maximum(1.0, jnp.max(jnp.abs(b))))
                      for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
        except Exception as e:
            err = f"{type(e).__name__}: {str(e)[:200]}"
        print(f"H={H} T={T:5d} mosaic vs triton, max |diff| / max(1, max |triton|) over out, dq, dk, dv: {err}")
        for name, (fwd, fwd_bwd) in steps.items():
            if name == "mosaic" and not (isinstance(err, float) and err < 5e-2):
                rows.append({"T": T, "H": H, "impl": name, "error": f"not timed: mismatch {err}"})
                continue
            try:
                tf = median_time(fwd, q, k, v, repeats=args.repeats, warmup=1)
                tb = median_time(fwd_bwd, q, k, v, do, repeats=args.repeats, warmup=1)
            except Exception as e:
                rows.append({"T": T, "H": H, "impl": name, "error": f"{type(e).__name__}: {str(e)[:160]}"})
                print(f"H={H} T={T:5d} {name:7s} failed: {type(e).__name__}: {str(e)[:160]}")
                continue
            row = {"T": T, "H": H, "impl": name, "fwd_ms": tf * 1e3, "fwd_tflop_s": fwd_flops / tf / 1e12,
                   "fwd_bwd_ms": tb * 1e3, "fwd_bwd_tflop_s": 3.5 * fwd_flops / tb / 1e12}
            rows.append(row)
            print(f"H={H} T={T:5d} {name:7s} fwd {row['fwd_ms']:8.3f} ms {row['fwd_tflop_s']:6.1f} TFLOP/s   "
                  f"fwd+bwd {row['fwd_bwd_ms']:8.3f} ms {row['fwd_bwd_tflop_s']:6.1f} TFLOP/s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"date": time.strftime("%Y-%m-%d"), "jax": jax.__version__,
                       "device": jax.devices()[0].device_kind, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
