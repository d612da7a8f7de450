"""Checks shared by the bench scripts. They run before any timing or compiling, so that a
bad argument is refused in one line (exit 2) at once, not after minutes of work; and a
script that needs a GPU this machine lacks says so the same way in every script."""
from __future__ import annotations

import sys

from jaxbwd._paths import unwritable


def description(doc: str) -> str:
    """A script's --help description: the docstring's whole first paragraph (its first line
    alone can stop mid-sentence)."""
    return " ".join(doc.split("\n\n")[0].split())


def bad_arguments(args) -> str | None:
    """What is wrong with ``--repeats`` or the ``--json`` path, or None. A median of no
    runs is undefined, and a result lost to an unwritable path after the timing is worse
    than an early error."""
    repeats = getattr(args, "repeats", 1)
    if repeats < 1:
        return f"--repeats must be >= 1, got {repeats}"
    path = getattr(args, "json", None)
    problem = unwritable(path) if path else None
    return f"--json {path}: {problem}" if problem else None


def refuse(prog: str, message: str) -> int:
    """Prints ``prog: error: message`` on stderr; returns the exit status 2."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


def skip(prog: str, needs: str) -> int:
    """Without the GPU a script needs: one line on stderr, exit status 0 (nothing timed,
    nothing written), so that a sweep of every script (bench/gpu_check.sh) goes on."""
    print(f"{prog}: needs {needs}; skipped (nothing timed, nothing written)", file=sys.stderr)
    return 0
