"""Before/after summary of two `python -m jaxbwd compile --json` reports, one row per
(kernel, dtype, GPU): worst registers and spill bytes, tensor-core kind, SASS summed over the
registry's cases, libdevice expf sequences, lowest occupancy and waves.

    python bench/compare_compile.py BEFORE.json AFTER.json > summary.md
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict


def aggregate(report):
    out = defaultdict(lambda: {"reg": 0, "stack": 0, "tc": set(), "sass": 0, "expf": 0, "occ": 1.0, "waves": 1e9})
    for r in report["rows"]:
        a = out[(r["kernel"], r["dtype"], r["gpu"])]
        a["reg"] = max(a["reg"], r["registers"])
        a["stack"] = max(a["stack"], r["stack"])
        a["tc"].add(r["tensor_core"])
        a["sass"] += r["sass"]
        a["expf"] += r["expf"]
        a["occ"] = min(a["occ"], r["occupancy"])
        a["waves"] = min(a["waves"], r["waves"])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("before", help="JSON report of the earlier run")
    p.add_argument("after", help="JSON report of the later run")
    args = p.parse_args(argv)
    before, after = (json.load(open(f)) for f in (args.before, args.after))
    b, a = aggregate(before), aggregate(after)
    fmt = {"reg": str, "stack": str, "tc": lambda v: "/".join(sorted(v)), "sass": str, "expf": str,
           "occ": lambda v: f"{v:.0%}", "waves": lambda v: f"{v:.2f}"}
    cols = ("reg", "stack", "tc", "sass", "expf", "occ", "waves")
    print(f"Before: {args.before} ({before['meta']['cases']} cases); after: {args.after} "
          f"({after['meta']['cases']} cases). Worst case per kernel, SASS summed over cases.\n")
    print("| kernel | dtype | gpu | registers | spill B | tensor cores | SASS | expf | occupancy | waves |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for k in sorted(set(b) | set(a)):
        cells = []
        for c in cols:
            x = fmt[c](b[k][c]) if k in b else "-"
            y = fmt[c](a[k][c]) if k in a else "-"
            cells.append(y if x == y else f"{x} -> {y}")
        print(f"| {k[0]} | {k[1]} | {k[2]} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
