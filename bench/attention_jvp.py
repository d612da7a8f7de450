"""Forward mode through attention: jaxbwd's jax.jvp against jax.jvp of the plain reference.

Time and compiled temp memory (MiB, 2^20 bytes) of each, causal, B=1, 2 heads of 32, f32,
T=S=1024 and 4096; jaxbwd's side is its XLA formula (default) or, on a GPU, the
attention_jvp kernel (--implementation pallas; without a GPU that is refused in one line,
exit status 2, since interpret mode would time the interpreter; so is jax < 0.12, which has
no forward mode of the ops).

    python bench/attention_jvp.py [--implementation xla|pallas] [--seqs T ...]
"""
import argparse
import sys

import jax
import jax.numpy as jnp

from jaxbwd import bench, registry

import _cli  # bench/_cli.py: this script's folder is first on sys.path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=_cli.description(__doc__))
    p.add_argument("--implementation", choices=["xla", "pallas"], default="xla",
                   help="jaxbwd path to time (default xla)")
    p.add_argument("--seqs", type=int, nargs="+", default=[1024, 4096], metavar="T",
                   help="sequence lengths T=S (default 1024 4096)")
    args = p.parse_args(argv)
    impl = args.implementation
    why = bench.unavailable(impl, "jvp")
    if why:  # Pallas without a GPU, or jax < 0.12: one line, not jax's traceback
        return _cli.refuse(p.prog, why.removeprefix("jaxbwd bench: "))
    spec = registry.get("dot_product_attention")
    for T in args.seqs:
        xs = [jax.random.normal(jax.random.PRNGKey(i), (1, T, 2, 32), jnp.float32) for i in range(3)]
        kw = {"is_causal": True}
        ours = spec.bind(xs, kw, implementation=impl); theirs = spec.bind(xs, kw, spec.reference)
        ts = [jax.random.normal(jax.random.PRNGKey(10 + i), a.shape) for i, a in enumerate(xs)]
        so, sr = jax.jit(bench.jvp_step(ours, 3)), jax.jit(bench.jvp_step(theirs, 3))
        to, tr = bench.median_time(so, *xs, *ts, repeats=5), bench.median_time(sr, *xs, *ts, repeats=5)
        mo, mr = bench._temp_bytes(so, *xs, *ts), bench._temp_bytes(sr, *xs, *ts)
        print(f"T=S={T}, B=1, 2 heads x 32, f32, causal: jaxbwd jvp ({impl}) {to*1e3:.1f} ms, "
              f"temp {mo / 2**20:.1f} MiB; jax.jvp of reference {tr*1e3:.1f} ms, temp {mr / 2**20:.1f} MiB; "
              f"speedup {tr/to:.2f}x, memory {mr/mo:.1f}x less")
    return 0


if __name__ == "__main__":
    sys.exit(main())
