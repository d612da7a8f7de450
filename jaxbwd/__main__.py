"""Command line: ``python -m jaxbwd list | check | bench | compile [--ops ...]``."""
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


def _compile(args) -> int:
    from jaxbwd import deviceless

    missing = deviceless.missing_requirements()
    if missing:
        print(f"error: compiling for a GPU without one needs {', '.join(missing)}.\n"
              f"Install: {deviceless.INSTALL_HINT}", file=sys.stderr)
        return 2
    gpus = [g.strip() for g in args.gpu.split(",")]
    dtypes = [{"f32": "float32", "bf16": "bfloat16", "f16": "float16"}.get(d.strip(), d.strip())
              for d in args.dtype.split(",")]
    cases = deviceless.cases(args.ops, dtypes=dtypes, gpus=gpus)
    if not cases:
        print("error: no Pallas kernels among the ops asked for", file=sys.stderr)
        return 2
    print(f"compiling {len(cases)} cases for {', '.join(gpus)} in {args.jobs or 'one per core'} processes "
          "(XLA's deviceless GPU compiler; no GPU is used)", file=sys.stderr)
    try:
        from tqdm import tqdm

        bar = tqdm(total=len(cases), unit="case", file=sys.stderr)
        progress = lambda case, msg: (bar.set_postfix_str(case.id, refresh=False), bar.update())
    except ImportError:
        bar, progress = None, lambda case, msg: print(f"  {case.id}: {'FAILED' if 'error' in msg else 'ok'}",
                                                      file=sys.stderr)
    report = deviceless.run(cases, jobs=args.jobs, timeout=args.timeout, progress=progress)
    if bar is not None:
        bar.close()
    headers, rows = deviceless.table_rows(report)
    if len(gpus) == 1:  # one target: no gpu column
        i = headers.index("gpu")
        headers, rows = headers[:i] + headers[i + 1:], [r[:i] + r[i + 1:] for r in rows]
    print(_table(headers, rows))
    for f in report["failures"]:
        print(f"FAILED {f['case']}: {f['error']}")
    missing_k = deviceless.missing_kernels(report, cases)
    for m in missing_k:
        print(f"MISSING {m}")
    print(deviceless.summary(report))
    if args.baseline:
        import json

        with open(args.baseline) as f:
            h, rows = deviceless.compare(json.load(f), report)
        print(f"\nchanges against {args.baseline}:")
        print(_table(h, rows))
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(deviceless.markdown(report))
    return 1 if report["failures"] or missing_k else 0


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
    pg = sub.add_parser(
        "compile", help="compile every Pallas kernel for a GPU without one; registers, spills, occupancy, SASS mix",
        description="Compiles each op's forward+backward at the registry's realistic shapes with XLA's own "
                    "GPU compiler (deviceless, on this CPU machine) and reads registers, spills, shared memory, "
                    "occupancy, tensor-core instructions and bytes from the compiled kernels. "
                    "Needs: pip install -e \".[compile]\" (Python >= 3.12).")
    pg.add_argument("--ops", nargs="*", help="op names (default: every op with Pallas kernels)")
    pg.add_argument("--gpu", default="h200",
                    help="target GPU(s), comma-separated: h200, h100 (sm_90), a100 (sm_80), b200 (sm_100)")
    pg.add_argument("--dtype", default="f32,bf16", help="input dtypes, comma-separated: f32, bf16, f16")
    pg.add_argument("--jobs", type=int, default=None, help="compile processes (default: one per CPU core)")
    pg.add_argument("--timeout", type=float, default=900.0, help="seconds one case may take before it is failed")
    pg.add_argument("--json", help="write the full report (every figure per kernel) as JSON")
    pg.add_argument("--markdown", help="write the table with a legend as Markdown")
    pg.add_argument("--baseline", help="a JSON report of an earlier run: print each kernel's figures as before -> after")
    args = p.parse_args(argv)
    if args.cmd == "compile":
        import os

        import jax

        # The GPU is only a compile target: the host runs on CPU, and a CUDA plugin without a
        # GPU would otherwise complain when backends start.
        if not os.environ.get("JAX_PLATFORMS"):
            jax.config.update("jax_platforms", "cpu")
        from jaxbwd import deviceless

        bad = [g for g in args.gpu.split(",") if g.strip() not in deviceless.GPUS]
        if bad:
            print(f"error: unknown --gpu {', '.join(bad)}; known: {', '.join(deviceless.GPUS)}", file=sys.stderr)
            return 2
    from jaxbwd import registry

    try:
        registry.ops(getattr(args, "ops", None))
    except KeyError as e:  # an unknown op name: say so, no traceback
        print(f"error: {e.args[0]}", file=sys.stderr)
        return 2
    return {"list": _list, "check": _check, "bench": _bench, "compile": _compile}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
