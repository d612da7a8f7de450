"""Command line: ``python -m jaxbwd list | check | bench [--ops ...]``."""
from __future__ import annotations

import argparse
import sys


def _table(headers, rows) -> str:
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(str(h)) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _list(args) -> int:
    from jaxbwd import registry

    rows = [
        (s.name, s.family, ", ".join(_diff_names(s)), ", ".join(s.static_params) or "-",
         ", ".join(s.kernels) or "- (XLA by design)", s.backward)
        for s in registry.ops(args.ops)
    ]
    print(_table(("op", "family", "differentiable", "static params", "Pallas kernels", "backward"), rows))
    return 0


def _diff_names(spec):
    from jaxbwd.check import _arg_names

    return _arg_names(spec)


def _check(args) -> int:
    import jax

    from jaxbwd.check import check

    print(f"jax {jax.__version__}, backend {jax.default_backend()}"
          + ("" if jax.default_backend() == "gpu" else " (Pallas kernels in interpret mode)"))
    rows = check(args.ops)
    print(_table(
        ("op", "implementation", "grad", "max abs err", "scaled err", "result"),
        [(r.op, r.implementation, r.arg, f"{r.max_abs:.2e}", f"{r.max_rel:.2e}", "pass" if r.ok else "FAIL") for r in rows],
    ))
    failed = [r for r in rows if not r.ok]
    print(f"scaled err = max|jaxbwd - autodiff| / max(1, max|autodiff|); pass below 1e-4\n"
          f"{len(rows) - len(failed)} checks ok, {len(failed)} failing")
    return 1 if failed else 0


def _bench(args) -> int:
    import json

    from jaxbwd import bench

    report = bench.run(args.ops, size=args.size, implementation=args.implementation, repeats=args.repeats)
    print(bench.format_table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.plot:
        bench.plot(report, args.plot)
    return 0


def main(argv=None) -> int:
    """Entry point of ``python -m jaxbwd`` and the ``jaxbwd`` script."""
    p = argparse.ArgumentParser(prog="python -m jaxbwd", description="jaxbwd: JAX ops with Pallas backward kernels")
    sub = p.add_subparsers(dest="cmd", required=True)
    pl = sub.add_parser("list", help="print the op registry as a table")
    pl.add_argument("--ops", nargs="*", help="op names (default: all)")
    pc = sub.add_parser("check", help="gradient check of each op against autodiff of its reference")
    pc.add_argument("--ops", nargs="*", help="op names (default: all)")
    pb = sub.add_parser("bench", help="time fwd+bwd vs XLA autodiff of the reference; residual and temp memory")
    pb.add_argument("--ops", nargs="*", help="op names (default: all)")
    pb.add_argument("--size", choices=["small", "llm"], default="small")
    pb.add_argument("--implementation", choices=["pallas", "xla"], default=None)
    pb.add_argument("--repeats", type=int, default=10)
    pb.add_argument("--json", help="write the report as JSON")
    pb.add_argument("--plot", help="write a PNG chart of the ratios")
    args = p.parse_args(argv)
    from jaxbwd import registry

    try:
        registry.ops(getattr(args, "ops", None))
    except KeyError as e:  # an unknown op name: say so, no traceback
        print(f"error: {e.args[0]}", file=sys.stderr)
        return 2
    return {"list": _list, "check": _check, "bench": _bench}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
