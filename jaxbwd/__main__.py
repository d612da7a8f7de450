"""Command line: ``python -m jaxbwd list | check | bench | compile [--ops ...]``."""
from __future__ import annotations

import argparse
import math
import os
import sys

from jaxbwd._paths import unwritable

TABLE_WIDTH = 120


def _table(headers, rows, width=TABLE_WIDTH, align=None, notes=None) -> str:
    """Fixed-width text table. Columns are narrowed one character at a time, widest first
    (not below 12 characters or their header), until a line fits in ``width`` characters
    (``None``: no limit); a longer cell wraps onto continuation lines.

    ``align``: one "<" or ">" per column (default: all left). ``notes``: ``(label, texts)``
    with one text per row, printed as an indented ``label: text`` paragraph under the row;
    with ``width=None`` it is a last column instead (one line per row).
    """
    import textwrap

    if notes is not None and width is None:
        label, texts = notes
        headers, rows, notes = (*headers, label), [(*r, t) for r, t in zip(rows, texts)], None
        align = align and align + "<"
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    align = align or "<" * len(headers)

    def total():
        return sum(widths) + 2 * (len(widths) - 1)

    while width is not None and total() > width:
        i = max(range(len(widths)), key=widths.__getitem__)
        if widths[i] <= max(12, len(cells[0][i])):
            break  # nothing left to narrow: the table stays wider than asked
        widths[i] -= 1

    def lines(row):
        wrapped = [textwrap.wrap(c, w, break_on_hyphens=False) or [""] for c, w in zip(row, widths)]
        for k in range(max(map(len, wrapped))):
            parts = [col[k] if k < len(col) else "" for col in wrapped]
            yield "  ".join(f"{c:{a}{w}}" for c, a, w in zip(parts, align, widths)).rstrip()

    out = [*lines(cells[0]), "  ".join("-" * w for w in widths)]
    for k, row in enumerate(cells[1:]):
        out.extend(lines(row))
        if notes is not None:
            out.extend(textwrap.wrap(f"{notes[0]}: {notes[1][k]}", width, initial_indent="    ",
                                     subsequent_indent="      "))
    return "\n".join(out)


def _list(args) -> int:
    from jaxbwd import registry

    specs = registry.ops(args.ops)
    rows = [
        (s.name, s.family, ", ".join(_diff_names(s)), ", ".join(s.static_params) or "-",
         ", ".join(s.kernels) or "- (XLA by design)")
        for s in specs
    ]
    print(_table(("op", "family", "differentiable", "static params", "Pallas kernels"), rows,
                 width=None if args.wide else TABLE_WIDTH, notes=("backward", [s.backward for s in specs])))
    return 0


def _diff_names(spec):
    from jaxbwd.check import _arg_names

    return _arg_names(spec)


def _check(args) -> int:
    import jax

    from jaxbwd.check import check

    from jaxbwd import config

    print(f"jax {jax.__version__}, backend {jax.default_backend()}"
          + ("" if jax.default_backend() == "gpu" else " (Pallas kernels in interpret mode)"), flush=True)
    if config.pallas_backend() != "triton":  # the Mosaic kernels take 16-bit inputs only
        print(f"Pallas backend {config.pallas_backend()} asked for: the checks' float32 examples have no "
              "Mosaic GPU kernel and run the Triton kernels", flush=True)
    tty = sys.stderr.isatty()

    def progress(i, n, name):  # on stderr, so that stdout holds only the report
        if tty:  # one line, rewritten in place and erased at the end
            text = f"checking op {i + 1}/{n}: {name} ..." if i < n else ""
            print("\r" + text.ljust(60) + "\r" * (i == n), end="", file=sys.stderr, flush=True)
        elif i < n:
            print(f"checking op {i + 1}/{n}: {name} ...", file=sys.stderr, flush=True)

    rows = check(args.ops, progress=progress)
    print(_table(
        ("op", "implementation", "checked", "max abs err", "scaled err", "result"),
        [(r.op, r.implementation, "forward" if r.arg == "out" else f"grad {r.arg}" if r.arg else "-", f"{r.max_abs:.2e}",
          f"{r.max_rel:.2e}", "pass" if r.ok else "FAIL" + (f": {r.note}" if r.note else "")) for r in rows],
        width=None if args.wide else TABLE_WIDTH, align="<<<>><",
    ))
    failed = [r for r in rows if not r.ok]
    print(f"checked: the op's output (forward) or the gradient of one input (grad NAME)\n"
          f"scaled err = max|jaxbwd - autodiff| / max|autodiff| (max|jaxbwd| where autodiff is all 0); pass below 1e-4\n"
          f"{len(rows) - len(failed)} checks ok, {len(failed)} failing")
    return 1 if failed else 0


def _bench(args) -> int:
    import json

    from jaxbwd import bench

    why = bench.unavailable(args.implementation, args.mode)
    if why:  # a backend this machine cannot time: one line, no traceback
        print(f"error: {why}", file=sys.stderr)
        return 2
    try:
        report = bench.run(args.ops, size=args.size, implementation=args.implementation, repeats=args.repeats,
                           mode=args.mode)
    except ValueError as e:  # e.g. jvp mode on a jax without forward mode: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(bench.format_table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.plot:
        bench.plot(report, args.plot)
    return 0


def _compile(args) -> int:
    from jaxbwd import deviceless

    gpus = list(dict.fromkeys(g.strip() for g in args.gpu.split(",")))  # repeats compile once
    dtypes = list(dict.fromkeys(_DTYPES.get(d.strip(), d.strip()) for d in args.dtype.split(",")))
    precisions = list(dict.fromkeys(None if p.strip() == "default" else p.strip() for p in args.precision.split(",")))
    cases = deviceless.cases(args.ops, dtypes=dtypes, gpus=gpus, precisions=precisions)
    if not cases:
        print("error: no Pallas kernels among the ops asked for", file=sys.stderr)
        return 2
    if None not in precisions:  # only other precisions asked for: say where they do not apply
        at_default = sum(c.precision is None for c in cases)
        applies = (f"--precision {','.join(precisions)} applies to the float32 cases of "
                   f"{', '.join(deviceless.MATMUL_OPS)} (their dots)")
        if at_default == len(cases):
            print(f"error: {applies}: none among the ops and dtypes asked for (add default to compile "
                  "them at the default precision)", file=sys.stderr)
            return 2
        if at_default:
            print(f"note: {applies}; the other {deviceless.plural(at_default, 'case')} "
                  f"compile{'s' * (at_default == 1)} at the default precision", file=sys.stderr)
    missing = deviceless.missing_requirements()
    if missing:
        print(f"error: compiling for a GPU without one needs {', '.join(missing)}.\n"
              f"Install: {deviceless.INSTALL_HINT}", file=sys.stderr)
        return 2
    jobs = deviceless.worker_count(args.jobs, len(cases))
    print(f"compiling {deviceless.plural(len(cases), 'case')} for {', '.join(gpus)} in "
          f"{deviceless.plural(jobs, 'process', 'es')} "
          "(XLA's deviceless GPU compiler; no GPU is used)", file=sys.stderr)
    try:
        from tqdm import tqdm

        bar = tqdm(total=len(cases), unit="case", file=sys.stderr)
        progress = lambda case, msg: (bar.set_postfix_str(case.id, refresh=False), bar.update())
    except ImportError:
        bar, progress = None, lambda case, msg: print(f"  {case.id}: {'FAILED' if 'error' in msg else 'ok'}",
                                                      file=sys.stderr)
    try:
        report = deviceless.run(cases, jobs=jobs, timeout=args.timeout, progress=progress)
    except deviceless.Stopped as e:  # SIGTERM or SIGHUP: workers gone; one line after the bar's
        if bar is not None:
            bar.close()
            bar = None
        print(f"jaxbwd compile: stopped by {e.signame}", file=sys.stderr)
        return e.code
    finally:  # also on Ctrl-C: the bar's line ends, and the message comes on a line of its own
        if bar is not None:
            bar.close()
    headers, rows = deviceless.table_rows(report)
    if len(gpus) == 1:  # one target: no gpu column
        i = headers.index("gpu")
        headers, rows = headers[:i] + headers[i + 1:], [r[:i] + r[i + 1:] for r in rows]
    print(_table(headers, rows, width=None if args.wide else TABLE_WIDTH))
    for f in report["failures"]:
        print(f"FAILED {f['case']}: {f['error']}")
    missing_k = deviceless.missing_kernels(report, cases)
    for m in missing_k:
        print(f"MISSING {m}")
    print(deviceless.summary(report))
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(deviceless.markdown(report))
    if args.baseline:
        if not hasattr(args, "baseline_report"):  # called without _bad_arguments
            problem = _read_baseline(args)
            if problem:
                raise ValueError(problem)
        h, rows = deviceless.compare(args.baseline_report, report)
        print(f"\nchanges against {args.baseline}:")
        if rows:
            print(_table(h, rows, width=None if args.wide else TABLE_WIDTH))
        else:
            print("none to show: no kernel of this run (op, case, dtype, gpu) is in the baseline")
    return 1 if report["failures"] or missing_k else 0


class _Ops(argparse.Action):
    """``--ops NAME ...``: given twice, both lists; given once with no name (an empty variable,
    or a flag right after it), an error in :func:`main` rather than every op."""

    def __call__(self, parser, namespace, values, option_string=None):
        namespace.ops_empty = getattr(namespace, "ops_empty", False) or not values
        setattr(namespace, self.dest, list(getattr(namespace, self.dest, None) or []) + list(values))


def main(argv=None) -> int:
    """Entry point of ``python -m jaxbwd`` and the ``jaxbwd`` script."""
    p = argparse.ArgumentParser(prog="python -m jaxbwd", description="jaxbwd: JAX ops with Pallas backward kernels")
    sub = p.add_subparsers(dest="cmd", required=True)
    ops_help = ("op names, space-separated (default: all; `list` shows them), or user ops as "
                "module:ATTR or path/file.py:ATTR (an OpSpec or a list of them); given twice, both lists")
    wide_help = "one line per row, however wide (default: wrap to 120 columns)"
    text = "print the op registry as a table"
    pl = sub.add_parser("list", help=text, description=text)
    pl.add_argument("--ops", nargs="*", action=_Ops, help=ops_help)
    pl.add_argument("--wide", action="store_true", help=wide_help)
    text = ("gradient check of each op against autodiff of its reference (2-3 minutes on 2 CPU cores, where "
            "the Pallas kernels run in interpret mode)")
    pc = sub.add_parser("check", help=text, description=text)
    pc.add_argument("--ops", nargs="*", action=_Ops, help=ops_help)
    pc.add_argument("--wide", action="store_true", help=wide_help)
    text = "time fwd+bwd vs XLA autodiff of the library call each op replaces; residual and temp memory"
    pb = sub.add_parser("bench", help=text, description=text)
    pb.add_argument("--ops", nargs="*", action=_Ops, help=ops_help)
    pb.add_argument("--size", choices=["small", "llm"], default=None,
                    help="input shapes: small (test-sized, float32; the default on CPU) or llm (realistic "
                         "training shapes, mostly bf16; the default on GPU, slow on CPU)")
    pb.add_argument("--implementation", choices=["pallas", "xla"], default=None,
                    help="what to time against autodiff: pallas (the compiled kernels; needs a GPU) or xla "
                         "(jaxbwd's XLA backward). Default: pallas on GPU, xla elsewhere")
    pb.add_argument("--mode", choices=["vjp", "jvp"], default="vjp",
                    help="vjp: forward + backward against jax.grad of the baseline (default); jvp: forward + "
                         "tangent (jax.jvp, jax >= 0.12) against jax.jvp of the baseline")
    pb.add_argument("--repeats", type=int, default=10, help="timed runs per op after 2 warm-up runs; the median "
                    "is reported (default 10)")
    pb.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH")
    pb.add_argument("--plot", metavar="PATH", help="also write a chart of speedup and residual-memory ratio "
                    "per op to PATH, in the format its extension names (.png, .svg, .pdf, ...; needs matplotlib)")
    pg = sub.add_parser(
        "compile", help="compile every Pallas kernel for a GPU without one; registers, spills, occupancy, SASS mix",
        description="Compiles each op's forward+backward at the registry's realistic shapes with XLA's own "
                    "GPU compiler (deviceless, on this CPU machine) and reads registers, spills, shared memory, "
                    "occupancy, tensor-core instructions and bytes from the compiled kernels. "
                    "Needs: pip install -e \".[compile]\" (Python >= 3.12).")
    pg.add_argument("--ops", nargs="*", action=_Ops, help="op names, space-separated (default: every op with Pallas kernels), "
                                             "or user ops as module:ATTR or path/file.py:ATTR")
    pg.add_argument("--gpu", default="h200",
                    help="target GPU(s), comma-separated: h200, h100 (sm_90), a100 (sm_80), b200 (sm_100) "
                         "(default: h200)")
    pg.add_argument("--dtype", default="f32,bf16", help="input dtypes, comma-separated: f32, bf16, f16 "
                                                        "(default: f32,bf16)")
    pg.add_argument("--precision", default="default",
                    help="jax.default_matmul_precision for the f32 cases of the ops with dots (attention, "
                         "conv2d, linear_cross_entropy), comma-separated: default (TF32 dots), "
                         "highest (3xTF32; cases named highest:...) (default: default)")
    pg.add_argument("--jobs", type=int, default=None, help="compile processes (default: one per CPU core)")
    pg.add_argument("--timeout", type=float, default=900.0, help="seconds one case may take before it is failed "
                                                           "(default: 900)")
    pg.add_argument("--json", metavar="PATH", help="write the full report (every figure per kernel) as JSON")
    pg.add_argument("--markdown", metavar="PATH", help="write the table with a legend as Markdown")
    pg.add_argument("--wide", action="store_true", help=wide_help)
    pg.add_argument("--baseline", metavar="PATH", help="a JSON report of an earlier run: print each kernel's figures as before -> after")
    args = p.parse_args(argv)
    if getattr(args, "ops_empty", False):  # `--ops $EMPTY` or `--ops --dtype bf16`: not "every op" (omit the flag for that)
        print("error: --ops needs at least one op name (omit --ops for every op)", file=sys.stderr)
        return 2
    if args.cmd in ("list", "compile"):
        import jax

        # Neither needs a device (compile's GPU is only a compile target): the host runs on CPU,
        # and a CUDA plugin without a GPU would otherwise print a traceback when backends start.
        # check and bench keep jax's choice: there a GPU is what the user wants.
        if not os.environ.get("JAX_PLATFORMS"):
            jax.config.update("jax_platforms", "cpu")
    if args.cmd == "compile":
        from jaxbwd import deviceless

        bad = [g for g in args.gpu.split(",") if g.strip() not in deviceless.GPUS]
        if bad:
            print(f"error: unknown --gpu {', '.join(bad)}; known: {', '.join(deviceless.GPUS)}", file=sys.stderr)
            return 2
    from jaxbwd import registry

    try:
        registry.ops(getattr(args, "ops", None))
    except (KeyError, ValueError) as e:  # an unknown op name, a clash, a bad module path: no traceback
        if getattr(e, "__notes__", None):  # raised by the user's module itself (registry.load): its traceback
            raise
        msg = str(e.args[0] if e.args else e)
        if msg.startswith("jaxbwd: unknown op "):  # the one message that names no path: name the option
            msg = "--ops: " + msg.removeprefix("jaxbwd: ")
        print(f"error: {msg}", file=sys.stderr)
        return 2
    from jaxbwd import config

    try:  # the JAXBWD_* environment, read now rather than deep inside a run
        config.interpret(), config.default_implementation()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    problem = _bad_arguments(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        return {"list": _list, "check": _check, "bench": _bench, "compile": _compile}[args.cmd](args)
    except BrokenPipeError:  # stdout closed early (e.g. `| head`): quiet, as other Unix tools
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 1
    except KeyboardInterrupt:  # Ctrl-C: one line, and the shell's status for SIGINT (compile's workers are gone)
        print("\n" * sys.stderr.isatty() + "interrupted", file=sys.stderr)  # on a terminal: after ^C
        return 130


_DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}


def _bad_arguments(args):
    """What is wrong with the numbers and paths given, found before any work is done (a
    report lost to an unwritable path after a long compile is worse than an early error)."""
    if getattr(args, "repeats", 1) < 1:
        return f"--repeats must be >= 1, got {args.repeats}"
    if getattr(args, "jobs", None) is not None and args.jobs < 1:
        return f"--jobs must be >= 1, got {args.jobs}"
    timeout = getattr(args, "timeout", 1.0)
    if not (math.isfinite(timeout) and timeout > 0):
        return f"--timeout must be a finite number of seconds > 0, got {args.timeout}"
    if hasattr(args, "dtype") and args.cmd == "compile":
        bad = [d for d in args.dtype.split(",") if d.strip() not in set(_DTYPES) | set(_DTYPES.values())]
        if bad:
            return f"unknown --dtype {', '.join(bad)}; known: {', '.join(_DTYPES)}"
        from jaxbwd.deviceless import PRECISIONS

        bad = [p for p in args.precision.split(",") if p.strip() not in ("default",) + PRECISIONS]
        if bad:
            return f"unknown --precision {', '.join(bad)}; known: default, {', '.join(PRECISIONS)}"
    if getattr(args, "baseline", None):
        problem = _read_baseline(args)
        if problem:
            return problem
    outputs = {}
    for opt in ("json", "markdown", "plot"):
        path = getattr(args, opt, None)
        if path:
            problem = unwritable(path)
            if problem:
                return f"--{opt} {path}: {problem}"
            same = outputs.setdefault(os.path.realpath(path), opt)
            if same != opt:  # the second write would replace the first
                return f"--{same} and --{opt} name the same file, {path}"
    if getattr(args, "plot", None):
        return _unplottable(args.plot)
    return None


def _unplottable(path):
    """Why matplotlib cannot write a chart to ``path``, or None: checked before the benchmark,
    not after it. The format is the extension's, which must be there."""
    try:
        from matplotlib.figure import Figure  # not pyplot: no backend is chosen here
    except ImportError:
        return f"--plot {path}: needs matplotlib (pip install matplotlib)"
    formats = Figure().canvas.get_supported_filetypes()
    ext = os.path.splitext(path)[1][1:].lower()
    if not ext:  # matplotlib would add ".png": a file other than the one named, maybe another output
        return f"--plot {path}: name the format with an extension (.png, .svg, .pdf, ...)"
    if ext not in formats:
        return f"--plot {path}: matplotlib cannot write '.{ext}' files; use one of: .{', .'.join(sorted(formats))}"
    return None


def _read_baseline(args):
    """Reads ``--baseline`` into ``args.baseline_report``; what is wrong with it, or None."""
    import json

    if not os.path.isfile(args.baseline):
        return f"--baseline {args.baseline}: no such file"
    try:
        with open(args.baseline, encoding="utf-8") as f:
            report = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return f"--baseline {args.baseline}: not a JSON report of `python -m jaxbwd compile --json` ({e})"
    rows = report.get("rows") if isinstance(report, dict) else None
    keys = {"op", "case", "dtype", "gpu", "kernel"}
    if not (isinstance(rows, list) and all(isinstance(r, dict) and keys <= r.keys() for r in rows)):
        return (f"--baseline {args.baseline}: not a report of `python -m jaxbwd compile --json` "
                f"(no list of rows with {', '.join(sorted(keys))} under \"rows\")")
    args.baseline_report = report
    return None


if __name__ == "__main__":
    sys.exit(main())
