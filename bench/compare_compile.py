"""Before/after summary of two `python -m jaxbwd compile --json` reports, one row per
(kernel, dtype, GPU): worst registers and spill bytes, tensor-core kind, SASS summed over the
registry's cases, libdevice expf sequences, lowest occupancy and waves.

Only the cases (op, case, dtype, gpu) compiled in both reports are compared, so that a case
that failed or timed out on one side, or a subset run against a full sweep, does not show as
a change in the sums; the header counts the compared cases and the cases left out are
listed under the table.

    python bench/compare_compile.py BEFORE.json AFTER.json > summary.md
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

# What each row must have for the summary (a `jaxbwd bench --json` report has rows without
# them).
ROW_KEYS = ("op", "case", "dtype", "gpu", "kernel", "registers", "stack", "tensor_core", "sass", "expf",
            "occupancy", "waves")


def load(path: str):
    """The report at ``path``, or a one-line reason why it is not a compile report."""
    if not os.path.isfile(path):
        return None, f"{path}: no such file"
    try:
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return None, f"{path}: not a JSON report of `python -m jaxbwd compile --json` ({e})"
    rows = report.get("rows") if isinstance(report, dict) else None
    if not (isinstance(rows, list) and all(isinstance(r, dict) and set(ROW_KEYS) <= r.keys() for r in rows)):
        return None, (f"{path}: not a report of `python -m jaxbwd compile --json` (no list of rows with "
                      f"{', '.join(ROW_KEYS)} under \"rows\")")
    return report, None


def case_id(r) -> str:
    """The case a row belongs to, spelled as `compile` names it in "failures"."""
    return f"{r['op']}/{r['case']}/{r['dtype']}/{r['gpu']}"


def compiled_cases(report) -> set[str]:
    """Cases with rows and no failure entry."""
    failed = {f.get("case") for f in report.get("failures") or []}
    return {case_id(r) for r in report["rows"]} - failed


def aggregate(report, cases=None):
    """Per (kernel, dtype, gpu): the worst figures over the rows of ``cases`` (all: None)."""
    out = defaultdict(lambda: {"reg": 0, "stack": 0, "tc": set(), "sass": 0, "expf": 0, "occ": 1.0, "waves": None})
    for r in report["rows"]:
        if cases is not None and case_id(r) not in cases:
            continue
        a = out[(r["kernel"], r["dtype"], r["gpu"])]
        a["reg"] = max(a["reg"], r["registers"])
        a["stack"] = max(a["stack"], r["stack"])
        a["tc"].add(r["tensor_core"])
        for k in ("sass", "expf"):  # "-" for Mosaic kernels (no SASS from XLA's compile): stays "-"
            a[k] = a[k] + r[k] if isinstance(a[k], int) and isinstance(r[k], int) else "-"
        a["occ"] = min(a["occ"], r["occupancy"])
        if r["waves"] == r["waves"]:  # NaN for Mosaic kernels, whose grid the dump does not give
            a["waves"] = r["waves"] if a["waves"] is None else min(a["waves"], r["waves"])
    return out


def _left_out(name, report, compiled, other) -> list[str]:
    """A line per case of ``report`` that is not compared: failed, or not compiled in ``other``."""
    failures = {f.get("case"): f.get("error", "") for f in report.get("failures") or []}
    lines = [f"- `{c}`: failed in {name} ({failures[c]})" for c in sorted(failures)]
    lines += [f"- `{c}`: compiled in {name} only" for c in sorted(compiled - other) if c not in failures]
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("before", help="JSON report of the earlier run")
    p.add_argument("after", help="JSON report of the later run")
    args = p.parse_args(argv)
    reports = []
    for path in (args.before, args.after):
        report, problem = load(path)
        if problem:
            print(f"{p.prog}: error: {problem}", file=sys.stderr)
            return 2
        reports.append(report)
    before, after = reports
    cb, ca = compiled_cases(before), compiled_cases(after)
    both = cb & ca
    if not both:
        print(f"{p.prog}: error: no case (op, case, dtype, gpu) compiled in both reports", file=sys.stderr)
        return 2
    b, a = aggregate(before, both), aggregate(after, both)
    fmt = {"reg": str, "stack": str, "tc": lambda v: "/".join(sorted(v)), "sass": str, "expf": str,
           "occ": lambda v: f"{v:.0%}", "waves": lambda v: "-" if v is None else f"{v:.2f}"}
    cols = ("reg", "stack", "tc", "sass", "expf", "occ", "waves")
    left_out = _left_out("before", before, cb, ca) + _left_out("after", after, ca, cb)
    print(f"Before: {args.before} ({len(cb)} cases compiled, {len(before.get('failures') or [])} failed); "
          f"after: {args.after} ({len(ca)} compiled, {len(after.get('failures') or [])} failed). "
          f"Compared: the {len(both)} cases compiled in both"
          + (f"; {len(left_out)} left out, listed below" if left_out else "")
          + ". Worst case per kernel, SASS summed over the compared cases.\n")
    print("| kernel | dtype | gpu | registers | spill B | tensor cores | SASS | expf | occupancy | waves |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for k in sorted(set(b) | set(a)):
        cells = []
        for c in cols:
            x = fmt[c](b[k][c]) if k in b else "-"
            y = fmt[c](a[k][c]) if k in a else "-"
            cells.append(y if x == y else f"{x} -> {y}")
        print(f"| {k[0]} | {k[1]} | {k[2]} | " + " | ".join(cells) + " |")
    if left_out:
        print("\nNot compared:\n" + "\n".join(left_out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
