"""The bench/ scripts' command lines: bad arguments refused in one line before any work, no
traceback, figures in the units they name, and compare_compile.py comparing like with like.
Each script runs in a subprocess on CPU at tiny sizes (seconds)."""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from jaxbwd.vjp._derivatives import FORWARD_MODE

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"


def _run(script, *args, timeout=120):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env.pop("JAXBWD_IMPLEMENTATION", None)
    return subprocess.run([sys.executable, str(BENCH / script), *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=timeout)


def _refused(r, *words):
    """Exit status 2 and one line on stderr naming ``words``, no traceback, nothing on stdout."""
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert all(w in r.stderr for w in words), r.stderr
    assert r.stdout == "", r.stdout


# ------------------------------------------------------------------ compare_compile.py

def _row(op, case, dtype="float32", gpu="h200", kernel=None, sass=100, registers=64):
    return {"op": op, "case": case, "dtype": dtype, "gpu": gpu, "kernel": kernel or f"{op}_bwd",
            "registers": registers, "stack": 0, "tensor_core": "none", "sass": sass, "expf": 0,
            "occupancy": 0.5, "waves": 2.0}


def _report(tmp_path, name, rows, failures=(), cases=None):
    path = tmp_path / name
    meta = {"date": "2026-12-03", "jax": "0.12.0.1", "gpus": ["h200"], "cases": cases or len(rows), "jobs": 1,
            "seconds": 1.0}
    path.write_text(json.dumps({"meta": meta, "rows": rows, "failures": list(failures)}))
    return path


def _table_rows(out):
    return [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| kernel")]


def test_compare_compile_leaves_out_a_failed_case(tmp_path):
    # The same kernel in two cases; the after run timed out on one. Summed SASS must not halve.
    rows = [_row("silu", "a", sass=100), _row("silu", "b", sass=300)]
    before = _report(tmp_path, "before.json", rows)
    after = _report(tmp_path, "after.json", rows[:1],
                    failures=[{"case": "silu/b/float32/h200", "error": "timed out after 1.5 s"}], cases=2)
    r = _run("compare_compile.py", before, after)
    assert r.returncode == 0, r.stderr
    table = _table_rows(r.stdout)
    assert table == ["| silu_bwd | float32 | h200 | 64 | 0 | none | 100 | 0 | 50% | 2.00 |"], r.stdout
    header = r.stdout.splitlines()[0]
    assert "(1 compiled, 1 failed)" in header and "the 1 cases compiled in both" in header, header
    assert "`silu/b/float32/h200`: failed in after (timed out after 1.5 s)" in r.stdout


def test_compare_compile_subset_against_full_sweep(tmp_path):
    full = _report(tmp_path, "full.json", [_row("silu", "a"), _row("rms_norm", "a", sass=500)])
    subset = _report(tmp_path, "subset.json", [_row("silu", "a", sass=90)])
    r = _run("compare_compile.py", full, subset)
    assert r.returncode == 0, r.stderr
    # No "X -> -" row for rms_norm, which the subset did not compile: it is listed instead.
    assert _table_rows(r.stdout) == ["| silu_bwd | float32 | h200 | 64 | 0 | none | 100 -> 90 | 0 | 50% | 2.00 |"]
    assert "`rms_norm/a/float32/h200`: compiled in before only" in r.stdout


def test_compare_compile_reads_mosaic_rows(tmp_path):
    # Mosaic kernels have no SASS or expf count ("-") and no grid (NaN waves) in the reports.
    mosaic = dict(_row("dot_product_attention", "a", kernel="attention_fwd_mosaic"), sass="-", expf="-",
                  waves=float("nan"))
    rows = [mosaic, _row("dot_product_attention", "a", kernel="attention_jvp")]
    before, after = _report(tmp_path, "before.json", rows), _report(tmp_path, "after.json", rows)
    r = _run("compare_compile.py", before, after)
    assert r.returncode == 0, r.stderr
    assert "| attention_fwd_mosaic | float32 | h200 | 64 | 0 | none | - | - | 50% | - |" in _table_rows(r.stdout)


def test_compare_compile_refuses_what_is_not_a_compile_report(tmp_path):
    good = _report(tmp_path, "good.json", [_row("silu", "a")])
    _refused(_run("compare_compile.py", good, tmp_path / "nosuch.json"), "nosuch.json", "no such file")
    bench = tmp_path / "bench.json"  # a `python -m jaxbwd bench --json` report: rows without kernels
    bench.write_text(json.dumps({"meta": {}, "rows": [{"op": "silu", "ms": 0.1}]}))
    _refused(_run("compare_compile.py", bench, good), "bench.json", "not a report")
    (tmp_path / "text.json").write_text("not json")
    _refused(_run("compare_compile.py", good, tmp_path / "text.json"), "text.json", "not a JSON report")


# ------------------------------------------------------------------ attention.py, attention_jvp.py

def test_attention_refuses_bad_arguments_before_timing():
    _refused(_run("attention.py", "--repeats", "0"), "--repeats must be >= 1")
    _refused(_run("attention.py", "--json", "/nonexistent/x.json"), "/nonexistent/x.json", "folder does not exist")
    # A folder that exists but takes no file (as a read-only one): the write itself is tried.
    _refused(_run("attention.py", "--json", "/proc/x.json"), "/proc/x.json", "cannot be written")


def test_attention_rows_line_up():
    r = _run("attention.py", "--seqs", "64", "--repeats", "1")
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith("T=")]
    assert [line.split()[2] for line in rows] == ["jaxbwd", "autodiff", "jax.nn", "jax.nn-xla"], r.stdout
    # Every row's time ends at the same column ("jax.nn-xla" used to push its row one right).
    assert len({line.index(" ms") for line in rows}) == 1, r.stdout


def test_attention_jvp_pallas_without_gpu_is_one_line():
    _refused(_run("attention_jvp.py", "--implementation", "pallas"), "GPU only")


def test_attention_jvp_prints_mib():
    r = _run("attention_jvp.py", "--seqs", "64")
    if not FORWARD_MODE:  # jax < 0.12: no forward mode to time, said in one line
        _refused(r, "needs jax >= 0.12")
        return
    assert r.returncode == 0, r.stderr
    assert re.search(r"temp [\d.]+ MiB; jax.jvp of reference .* temp [\d.]+ MiB", r.stdout), r.stdout
    assert " MB" not in r.stdout


# ------------------------------------------------------------------ tune.py, mosaic_attention.py

@pytest.mark.parametrize("script", ["tune.py", "mosaic_attention.py"])
def test_gpu_scripts_skip_the_same_way_without_a_gpu(script):
    r = _run(script)  # tune.py without --json: the missing GPU is what to say
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert r.stdout == "" and "Traceback" not in r.stderr, (r.stdout, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1 and "needs" in r.stderr and "skipped" in r.stderr, r.stderr


def test_tune_help_has_the_whole_first_paragraph():
    r = _run("tune.py", "--help")
    assert r.returncode == 0
    assert "conv2d's backward against XLA's (cuDNN) in bf16." in " ".join(r.stdout.split()), r.stdout


def _tune_module(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # the script imports bench/_cli.py
    spec = importlib.util.spec_from_file_location("bench_tune", BENCH / "tune.py")
    tune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune)
    return tune


def test_tune_keeps_the_table_entry_unless_a_candidate_beats_it(monkeypatch):
    from jaxbwd.pallas import _tuning

    tune = _tune_module(monkeypatch)
    key = "attention_bwd_dkdv/h128/16bit"
    own = _tuning.get(key)  # sm_90's: 64 x 64 on 4 warps, 2 stages
    same = (own.block_m, own.block_n, 0, own.num_warps, own.num_stages)
    faster, slower, broken = (64, 64, 0, 8, 3), (64, 128, 0, 8, 2), (32, 64, 0, 4, 2)
    times = {None: 1.0, faster: 0.5, slower: 2.0}

    def time_one(over, speedup=True):
        c = tuple(over.get(f, 0) for f in tune.F[:5]) if over else None
        if c == broken:
            raise RuntimeError("shared memory")
        return times[c] if speedup or c is None else 3.0

    won, rows = tune.sweep(key, [same, faster, slower, broken], time_one)
    assert won == {"block_m": 64, "block_n": 64, "num_warps": 8, "num_stages": 3}
    assert [r["config"] for r in rows][0] is None and len(rows) == 4  # the table's own once, not again as `same`
    assert rows[-1]["error"] == "RuntimeError" and "ms" not in rows[-1]
    won, rows = tune.sweep(key, [same, faster, slower], lambda over: time_one(over, speedup=False))
    assert won is None and rows[0]["ms"] == 1000.0  # the table's entry was fastest: nothing written
    assert tune.sweep(key, [broken], time_one)[0] is None


def test_tune_sweeps_valid_keys_and_configurations(monkeypatch):
    """Every key and candidate of bench/tune.py's sweeps passes the tuning table's override
    check (a refused one would be reported as a failed configuration on the GPU)."""
    from jaxbwd.pallas import _tuning

    tune = _tune_module(monkeypatch)
    for key, candidates in tune.SWEEPS.items():
        assert key in _tuning.requests(), key
        assert tune.case_of(key) in tune.CASES, key
        for c in candidates:
            with _tuning.use({"sm_90": {key: {f: v for f, v in zip(tune.F, c) if v}}}):
                pass


# ------------------------------------------------------------------ whole_model.py

def test_whole_model_head_memory_gpu_needs_head_memory():
    _refused(_run("whole_model.py", "--skip-timing", "--head-memory-gpu", "h200"), "--head-memory")
    _refused(_run("whole_model.py", "--head-memory", "--head-memory-gpu", "h300"), "unknown GPU")


def test_whole_model_gpu_table_header_labels_every_column(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # the script imports bench/_cli.py
    spec = importlib.util.spec_from_file_location("bench_whole_model", BENCH / "whole_model.py")
    whole_model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(whole_model)
    names = ["plain jnp/optax", "matmul+cross_entropy", "linear_cross_entropy", "matmul+cross_entropy (xla)",
             "linear_cross_entropy (xla)"]
    lines = whole_model.table_lines(names, {128256: {n: 1000.0 * i for i, n in enumerate(names)}})
    header, row = (line.split(" | ") for line in lines)
    assert [h.strip() for h in header] == ["V"] + names
    assert len(row) == len(header) and [len(c) for c in row] == [len(h) for h in header]


# ------------------------------------------------------------------ residuals.py

def test_residuals_refuses_an_unknown_op():
    _refused(_run("residuals.py", "--ops", "nope"), "unknown op 'nope'")


def test_residuals_rows_name_the_baseline_and_its_bytes():
    """Abstract shapes only: the llm-size attention row costs nothing to measure."""
    r = _run("residuals.py", "--ops", "silu", "dot_product_attention", "rope")
    assert r.returncode == 0, r.stderr
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in r.stdout.splitlines()[2:]}
    assert rows["silu"][3] == "jax.nn.silu" and rows["silu"][5] == "3.00x"
    assert rows["dot_product_attention"][3].startswith("jax.nn.dot_product_attention")
    assert rows["dot_product_attention"][4].endswith("GiB") and rows["dot_product_attention"][2].endswith("MiB")
    assert rows["rope"][3] == "jaxbwd.reference" and rows["rope"][4] == "-"


def test_residuals_of_the_kernel_path_off_a_gpu():
    """Traced in interpret mode: nothing runs, so no GPU is needed."""
    r = _run("residuals.py", "--implementation", "pallas", "--ops", "rms_norm")
    assert r.returncode == 0, r.stderr
    assert "| rms_norm | 8192x4096:bfloat16 4096:bfloat16 | 64.0 MiB | flax.linen.RMSNorm |" in r.stdout
