"""Residual bytes at the bench's realistic shapes, without running anything: what jaxbwd's
forward keeps for the backward against what autodiff of the library call it replaces keeps
(``jaxbwd.baselines``) and what autodiff of ``jaxbwd.reference`` (float32 inside) keeps.

Shapes, dtypes and options are those of ``python -m jaxbwd bench --size llm`` (the registry's
bench entry or first lowering shape; ops with neither, such as glu and matmul, get their
first test example in float32 there too). Everything is traced on abstract values, so it runs
in seconds on a CPU. The ratios are autodiff's bytes over jaxbwd's, given where both keep at
least 1 KiB.

    python bench/residuals.py [--ops NAME ...] [--implementation xla|pallas]
"""
import argparse

import jax
import jax.numpy as jnp

from jaxbwd import bench, config, registry

import _cli  # bench/_cli.py: this script's folder is first on sys.path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=_cli.description(__doc__))
    p.add_argument("--ops", nargs="+", metavar="NAME", help="ops to measure (default: every op)")
    p.add_argument("--implementation", choices=["xla", "pallas"], default="xla",
                   help="jaxbwd path (default xla; pallas is traced in interpret mode off a GPU: nothing runs)")
    args = p.parse_args(argv)
    try:
        specs = registry.ops(args.ops)
    except KeyError as e:
        return _cli.refuse(p.prog, str(e.args[0]))
    size = lambda n: "-" if n is None else bench.format_bytes(n)
    print("| op | inputs | jaxbwd | baseline | autodiff of the baseline | ratio | autodiff of the reference | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    interpret = jax.default_backend() != "gpu"
    for spec in specs:
        a, kw = bench.bench_inputs(spec, "llm", jax.random.PRNGKey(0), abstract=True)
        _, name = bench.baseline_fn(spec, a, kw)
        with config.use(interpret=interpret):
            ours = bench.residual_bytes(spec, None, a, kw, implementation=args.implementation)
        base = bench.residual_bytes(spec, spec.baseline, a, kw) if name != "jaxbwd.reference" else None
        ref = bench.residual_bytes(spec, spec.reference, a, kw)
        shapes = " ".join("x".join(map(str, x.shape)) + ":" + jnp.dtype(x.dtype).name for x in a if hasattr(x, "shape"))
        ratio = lambda n: "-" if n is None or min(n, ours) < 1024 else f"{n / ours:.2f}x"
        print(f"| {spec.name} | {shapes} | {size(ours)} | {name} | {size(base)} | {ratio(base)} | {size(ref)} | "
              f"{ratio(ref)} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
