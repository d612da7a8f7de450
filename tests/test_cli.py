"""The command line as a user meets it: `python -m jaxbwd list | check | bench` and the
examples' options."""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
import pathlib
import sys
from unittest import mock

import jax
import pytest

import jaxbwd
from jaxbwd import __main__ as cli
from jaxbwd import bench, registry
from jaxbwd.vjp._derivatives import FORWARD_MODE

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _width(text: str) -> int:
    return max(map(len, text.splitlines()))


def test_list_fits_120_columns_and_wide_keeps_one_line_per_op(capsys):
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    assert _width(out) <= 120
    for spec in registry.ops():
        assert spec.name in out and all(k in out for k in spec.kernels)
        assert " ".join(spec.backward.split()[:3]) in out  # the backward text, wrapped but present
    assert cli.main(["list", "--wide"]) == 0
    wide = capsys.readouterr().out.splitlines()
    assert len(wide) == 2 + len(registry.ops())  # header, rule, one line per op
    assert _width("\n".join(wide)) > 120


def test_table_wraps_long_cells_and_keeps_every_word():
    rows = [("a", "word " * 40), ("b", "short")]
    text = cli._table(("name", "text"), rows, width=40)
    assert _width(text) <= 40
    assert text.count("word") == 40 and "short" in text


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="on a GPU the Pallas kernels can be timed")
def test_bench_pallas_without_gpu_is_one_line_and_exit_2(capsys):
    assert cli.main(["bench", "--implementation", "pallas", "--ops", "silu"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("error: jaxbwd bench:") and "GPU" in err
    with pytest.raises(ValueError, match="timed on a GPU only"):
        bench.run(["silu"], implementation="pallas")


def test_bench_refuses_pallas_on_cpu_however_it_is_named():
    from jaxbwd import bench, config

    with config.use(implementation="pallas"):
        for name in (None, "auto", "pallas", "pallas:triton"):
            assert "timed on a GPU only" in bench.unavailable(name), name
    assert bench.unavailable("auto") is None and bench.unavailable("xla") is None


def test_check_reports_progress_and_names_forward_and_grad_rows(capsys):
    assert cli.main(["check", "--ops", "silu", "rms_norm"]) == 0
    out, err = capsys.readouterr()
    assert "checking op 1/2: silu" in err and "checking op 2/2: rms_norm" in err  # stderr is no tty here
    rows = [line.split() for line in out.splitlines() if line.startswith(("silu", "rms_norm"))]
    # silu: forward + grad x, for xla and pallas; rms_norm: forward + grad x + grad weight, both
    assert len(rows) == 2 * 2 + 2 * 3
    checked = {r[2] + ("" if r[2] == "forward" else " " + r[3]) for r in rows}
    assert checked == {"forward", "grad x", "grad weight"}
    assert all(r[-1] == "pass" for r in rows)
    assert _width(out) <= 120
    assert "Pallas backend" not in out  # the default, Triton, goes without saying


def test_check_says_which_pallas_backend_its_examples_run(capsys):
    with jaxbwd.config.use(pallas_backend="mosaic"):
        assert cli.main(["check", "--ops", "silu"]) == 0
    out = capsys.readouterr().out
    assert ("Pallas backend mosaic asked for: the checks' float32 examples have no Mosaic GPU kernel and run "
            "the Triton kernels") in out


def test_bench_table_fits_120_columns_and_has_no_zero_figures():
    row = dict(op="dot_product_attention", implementation="pallas", ms=0.000123, ms_autodiff=12345.6,
               speedup=0.0000099, gb_s=0.00042, of_copy=0.004, tflop_s=0.0000251, residual_bytes=100,
               residual_bytes_autodiff=3 * 2**30 + 5, temp_bytes=None, temp_bytes_autodiff=999 * 2**20)
    report = dict(size="small", device="cpu", backend="cpu", jax=jax.__version__, date="2026-12-01",
                  copy_gb_s=10.0, rows=[row, dict(row, op="rms_norm", tflop_s=None)])
    text = bench.format_table(report)
    assert _width(text) <= 120
    cells = text.splitlines()[3].split()
    assert cells[2:8] == ["0.00012", "12346", "9.9e-06x", "0.00042", "0.400%", "2.5e-05"], cells
    assert "3.00 GiB" in text and "999 MiB" in text and "100 B" in text


@pytest.mark.skipif(not FORWARD_MODE, reason="forward mode needs jax >= 0.12")
def test_bench_jvp_mode_times_forward_mode_against_the_baseline(capsys):
    assert cli.main(["bench", "--mode", "jvp", "--ops", "softmax", "dot_product_attention", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "(small, jvp)" in out and "base = jax.jvp of what a user calls without jaxbwd" in out
    rows = [line.split() for line in out.splitlines() if line.startswith(("softmax ", "dot_product_attention "))]
    assert [r[0] for r in rows] == ["softmax", "dot_product_attention"]
    for r in rows:  # times and speedup are positive figures; no residual columns in forward mode
        assert float(r[2]) > 0 and float(r[3]) > 0 and float(r[4].rstrip("x")) > 0
        assert r[8:10] == ["-", "-"], r


def _forward_flops(op, args, kwargs):
    """The forward's FLOPs from the example's shapes (2 per multiply-add)."""
    if op == "dot_product_attention":
        q, k = args[0], args[1]
        B, T, N, H = q.shape
        return 2 * 2 * B * N * T * k.shape[1] * H / (2 if kwargs.get("is_causal") else 1)  # q k^T and P v
    if op == "conv2d":
        x, w = args[0], args[1]
        out = jax.eval_shape(lambda a, b: jaxbwd.conv2d(a, b, implementation="xla", **kwargs), x, w)
        kh, kw, cin_per_group, _ = w.shape
        return 2 * math.prod(out.shape) * kh * kw * cin_per_group
    x, w = args[0], args[1]  # linear_cross_entropy: the logits x @ w
    return 2 * x.size * (w.size // x.shape[-1])


@pytest.mark.skipif(not FORWARD_MODE, reason="forward mode needs jax >= 0.12")
@pytest.mark.parametrize("op,units", [("dot_product_attention", 3.5), ("conv2d", 3.0), ("linear_cross_entropy", 4.0)])
def test_bench_jvp_tflops_count_the_tangent_rules_products(op, units):
    # TFLOP/s in jvp mode: forward + tangent, in forwards (attention's tangent kernel runs
    # five products of the forward's two; conv2d's tangent is bilinear, two forwards;
    # linear_cross_entropy's recomputes the logits and takes dx w and x dw). The jvp mode's
    # figure was (forward + backward) * 4/7.
    spec = registry.get(op)
    args, kwargs = bench.bench_inputs(spec, "small", jax.random.PRNGKey(0))
    want = units * _forward_flops(op, args, kwargs)
    row = bench.bench_op(spec, "small", "xla", copy_gb_s=0.0, repeats=1, mode="jvp")
    assert row.tflop_s * row.ms * 1e9 == pytest.approx(want, rel=1e-6)


def test_bench_rejects_an_unknown_mode():
    with pytest.raises(ValueError, match=r"jaxbwd bench: mode must be 'vjp' or 'jvp', got 'hvp'"):
        bench.run(["silu"], implementation="xla", mode="hvp")


def _parser_of(main, argv):
    """The ArgumentParser that ``main(argv)`` builds, caught at its ``parse_args`` call."""
    seen = []

    class Parsed(Exception):
        pass

    def capture(self, *args, **kwargs):
        seen.append(self)
        raise Parsed

    with mock.patch.object(argparse.ArgumentParser, "parse_args", capture), pytest.raises(Parsed):
        main(argv)
    return seen[0]


def _options_without_help(parser, where):
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                if not choice.help:
                    missing.append(f"{where} {choice.dest}")
            for name, sub in action.choices.items():
                missing += _options_without_help(sub, f"{where} {name}")
        elif not action.help or action.help == argparse.SUPPRESS:
            missing.append(f"{where} {'/'.join(action.option_strings) or action.dest}")
    return missing


def _example_main(name, monkeypatch):
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.main


@pytest.mark.parametrize("program", ["python -m jaxbwd", "train_lm", "train_superres"])
def test_every_option_has_help_text(program, monkeypatch):
    main = cli.main if program == "python -m jaxbwd" else _example_main(program, monkeypatch)
    parser = _parser_of(main, [])
    assert _options_without_help(parser, program) == []


@pytest.mark.parametrize("argv,message", [
    (["bench", "--ops", "silu", "--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["bench", "--ops", "silu", "--json", "/nonexistent-dir/x.json"],
     "--json /nonexistent-dir/x.json: its folder does not exist"),
    (["compile", "--ops", "silu", "--dtype", "f64"], "unknown --dtype f64; known: f32, bf16, f16"),
    (["compile", "--ops", "silu", "--precision", "default,fast"], "unknown --precision fast; known: default, highest"),
    (["compile", "--ops", "silu", "--jobs", "0"], "--jobs must be >= 1, got 0"),
    (["compile", "--ops", "silu", "--timeout", "-5"], "--timeout must be a finite number of seconds > 0, got -5.0"),
    (["compile", "--ops", "silu", "--timeout", "nan"], "--timeout must be a finite number of seconds > 0, got nan"),
    (["compile", "--ops", "silu", "--timeout", "inf"], "--timeout must be a finite number of seconds > 0, got inf"),
    (["compile", "--ops", "silu", "--baseline", "/nonexistent-dir/b.json"],
     "--baseline /nonexistent-dir/b.json: no such file"),
    (["bench", "--ops", "silu", "--json", "/"], "--json /: is a folder, not a file"),
], ids=["repeats", "json-folder", "dtype", "precision", "jobs", "timeout", "timeout-nan", "timeout-inf", "baseline",
        "json-is-folder"])
def test_bad_arguments_are_one_line_before_any_work(argv, message, capsys):
    """Checked before anything runs: a report lost to an unwritable path after a long
    compile is worse than an early error."""
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.strip() == f"error: {message}"


@pytest.mark.parametrize("content, why", [
    (b"not json", "not a JSON report of `python -m jaxbwd compile --json` (Expecting value"),
    (b"", "not a JSON report of `python -m jaxbwd compile --json` (Expecting value"),
    (b"\xff\xfe\x00binary", "not a JSON report of `python -m jaxbwd compile --json` ('utf-8' codec"),
    (b'{"a": 1}', 'not a report of `python -m jaxbwd compile --json` (no list of rows with case, dtype, gpu, '
                  'kernel, op under "rows")'),
    (b'{"rows": [{"op": "silu"}]}', "not a report of `python -m jaxbwd compile --json` (no list of rows"),
    (b"[]", "not a report of `python -m jaxbwd compile --json` (no list of rows"),
], ids=["text", "empty", "binary", "no-rows", "row-keys", "list"])
def test_compile_baseline_is_read_before_any_work(content, why, tmp_path, capsys):
    baseline = tmp_path / "b.json"
    baseline.write_bytes(content)
    assert cli.main(["compile", "--ops", "silu", "--baseline", str(baseline)]) == 2
    assert capsys.readouterr().err.strip().startswith(f"error: --baseline {baseline}: {why}")


def test_output_path_probe_leaves_things_as_they_were(tmp_path):
    new, old, link = tmp_path / "new.json", tmp_path / "old.json", tmp_path / "link.json"
    old.write_text("keep")
    link.symlink_to(tmp_path / "nowhere.json")
    assert cli.unwritable(str(new)) is None and not new.exists()
    assert cli.unwritable(str(old)) is None and old.read_text() == "keep"
    assert cli.unwritable(str(link)) is None and link.is_symlink() and not (tmp_path / "nowhere.json").exists()
    assert cli.unwritable(str(tmp_path)) == "is a folder, not a file"
    assert cli.unwritable(str(tmp_path / "no-dir" / "x.json")) == "its folder does not exist"
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK) and os.geteuid() == 0:  # root writes anyway: /proc is not writable for anyone
            assert cli.unwritable("/proc/jaxbwd-probe.json").startswith("cannot be written (")
        else:
            assert cli.unwritable(str(ro / "x.json")).startswith("cannot be written (")
    finally:
        ro.chmod(0o700)


@pytest.mark.parametrize("program, argv, message", [
    ("train_lm", ["--data", "/nonexistent-dir/corpus.txt"], "--data /nonexistent-dir/corpus.txt: no such file"),
    ("train_lm", ["--data", "{tmp}"], "--data {tmp}: is a folder, not a file"),
    ("train_lm", ["--data", "{tmp}/small.txt"],
     "the corpus has 5 bytes; at least 8192 are needed (the last 5%, at least 4096 bytes, is held out)"),
    ("train_lm", ["--max-bytes", "0"], "--max-bytes must be >= 1, got 0"),
    ("train_lm", ["--out", "{tmp}/small.txt"], "--out {tmp}/small.txt: is a file, not a folder"),
    ("train_superres", ["--steps", "0"], "--steps must be >= 1, got 0"),
    ("train_superres", ["--batch", "0"], "--batch must be >= 1, got 0"),
    ("train_superres", ["--crop", "-4"], "--crop must be even and >= 2, got -4"),
    ("train_superres", ["--lr", "nan"], "--lr must be a positive number, got nan"),
    ("train_superres", ["--lr", "-1"], "--lr must be a positive number, got -1.0"),
    ("train_superres", ["--adv-weight", "inf"], "--adv-weight must be a positive number, got inf"),
    ("train_superres", ["--adv-weight", "5"], "--adv-weight weighs the adversarial loss, which only --r1 GAMMA trains"),
    ("train_superres", ["--r1", "nan"], "--r1 needs a finite GAMMA >= 0 and a --crop that is a multiple of 4 "
                                        "(the discriminator downsamples twice), got GAMMA=nan, --crop 48"),
    ("train_superres", ["--crop", "5000"], "--crop must be at most 300 (the smallest training image's side), got 5000"),
    ("train_superres", ["--out", "{tmp}/small.txt"], "--out {tmp}/small.txt: is a file, not a folder"),
    # a run name that is a path would write outside --out
    ("train_lm", ["--name", "../../escape"], "argument --name: a run name is one folder name under --out, got '../../escape'"),
    ("train_superres", ["--name", ".."], "argument --name: a run name is one folder name under --out, got '..'"),
], ids=["lm-data-missing", "lm-data-folder", "lm-data-small", "lm-max-bytes", "lm-out-file", "sr-steps", "sr-batch",
        "sr-crop-negative", "sr-lr-nan", "sr-lr-negative", "sr-adv-weight-inf", "sr-adv-weight-without-r1",
        "sr-r1-nan", "sr-crop-large",
        "sr-out-file", "lm-name-path", "sr-name-dotdot"])
def test_example_bad_arguments_are_argparse_errors(program, argv, message, tmp_path, monkeypatch, capsys):
    (tmp_path / "small.txt").write_text("hello")
    main = _example_main(program, monkeypatch)
    with pytest.raises(SystemExit) as e:
        main(["--preset", "tiny", *[a.format(tmp=tmp_path) for a in argv]] if program == "train_lm"
             else [a.format(tmp=tmp_path) for a in argv])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().endswith(f"error: {message.format(tmp=tmp_path)}")


@pytest.mark.parametrize("module, message", [
    # define_op refuses the name when the module runs
    ("import jaxbwd\n"
     "op = jaxbwd.define_op('silu', forward=lambda x: x, backward=lambda r, d: (d,))\n"
     "SPEC = op.spec(reference=lambda x: x, examples=())\n",
     "error: jaxbwd.define_op('silu'): 'silu' is one of jaxbwd's own ops; choose another name "
     "(raised importing '{file}' for --ops {path})"),
    # a spec made by hand: the registry refuses it
    ("import dataclasses\n"
     "from jaxbwd import registry\n"
     "SPEC = dataclasses.replace(registry.get('relu'), name='silu', family='user')\n",
     "error: jaxbwd.registry: op 'silu' from {path} clashes with jaxbwd's own op"),
], ids=["define_op", "OpSpec"])
def test_user_op_named_like_a_builtin_is_one_line(module, message, tmp_path, capsys):
    (tmp_path / "clash.py").write_text(module)
    path = f"{tmp_path / 'clash.py'}:SPEC"
    assert cli.main(["list", "--ops", path]) == 2
    assert capsys.readouterr().err.strip() == message.format(path=path, file=tmp_path / "clash.py")


@pytest.mark.parametrize("var, value", [("JAXBWD_INTERPRET", "maybe"), ("JAXBWD_IMPLEMENTATION", "bogus")])
def test_a_bad_environment_variable_is_one_line(var, value, monkeypatch, capsys):
    from jaxbwd import config

    monkeypatch.setenv(var, value)
    monkeypatch.setattr(config, "_default", None)  # read from the environment again
    assert cli.main(["check", "--ops", "gelu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: jaxbwd: {var} must be") and err.endswith(f"got '{value}'")


def test_ops_given_twice_takes_both_lists(capsys):
    assert cli.main(["list", "--ops", "relu", "--ops", "gelu", "silu", "--wide"]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()[2:] if line[:1] != " "] == [
        "relu", "gelu", "silu"]


@pytest.mark.parametrize("name, hint", [
    ("RMS_NORM", " (did you mean 'rms_norm'?)"), ("rmsnorm", " (did you mean 'rms_norm'?)"),
    ("examples/squared_relu.py", " (a user op is named module:ATTR or path/file.py:ATTR)"), ("zzz", ""),
])
def test_unknown_op_names_the_option_and_the_nearest_op(name, hint, monkeypatch, capsys):
    _no_command(monkeypatch)
    assert cli.main(["list", "--ops", name]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --ops: unknown op {name!r}{hint}; known: adaptive_avg_pool2d, ") and err.count("\n") == 1


@pytest.mark.parametrize("module, message", [
    ("SPEC = []\n", "error: jaxbwd: {path} is an empty list: it must hold at least one OpSpec"),
    ("import sys\nsys.exit(0)\n", "error: jaxbwd: importing '{file}' for --ops {path} called sys.exit(0)"),
    ("def f(:\n", "error: jaxbwd: importing '{file}' for --ops {path}: syntax error: invalid syntax (user.py, line 1)"),
], ids=["empty", "sys.exit", "syntax"])
def test_a_user_module_that_cannot_give_ops_is_one_line(module, message, tmp_path, monkeypatch, capsys):
    # sys.exit(0) at import ended `check` with status 0 and no output: a pass, nothing checked
    _no_command(monkeypatch)
    (tmp_path / "user.py").write_text(module)
    path = f"{tmp_path / 'user.py'}:SPEC"
    assert cli.main(["check", "--ops", path]) == 2
    assert capsys.readouterr().err.strip() == message.format(path=path, file=tmp_path / "user.py")


@pytest.mark.parametrize("raises, error", [('raise RuntimeError("boom")', RuntimeError), ('{}["boom"]', KeyError)])
def test_a_user_module_that_raises_keeps_its_traceback_and_names_the_path(raises, error, tmp_path):
    # a KeyError of the user's own code too, which the CLI would otherwise print as one of its own
    (tmp_path / "boom.py").write_text(raises + "\n")
    path = f"{tmp_path / 'boom.py'}:SPEC"
    with pytest.raises(error, match="boom") as e:
        cli.main(["list", "--ops", path])
    assert e.value.__notes__ == [f"(raised importing '{tmp_path / 'boom.py'}' for --ops {path})"]


def test_compile_precision_that_applies_to_no_case_is_refused(monkeypatch, capsys):
    from jaxbwd import deviceless

    real = cli._compile  # up to the compiler check, which stops it
    _no_command(monkeypatch)
    monkeypatch.setattr(cli, "_compile", real)
    monkeypatch.setattr(deviceless, "missing_requirements", lambda: ["(stops here)"])
    assert cli.main(["compile", "--ops", "relu", "--precision", "highest"]) == 2
    assert capsys.readouterr().err == (
        "error: --precision highest applies to the float32 cases of dot_product_attention, conv2d, "
        "linear_cross_entropy (their dots): none among the ops and dtypes asked for (add default to compile them "
        "at the default precision)\n")
    assert cli.main(["compile", "--ops", "relu", "conv2d", "--dtype", "bf16", "--precision", "highest"]) == 2
    assert "none among the ops and dtypes asked for" in capsys.readouterr().err
    assert cli.main(["compile", "--ops", "relu", "conv2d", "--dtype", "f32", "--precision", "highest"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("note: --precision highest applies to the float32 cases of dot_product_attention, "
                          "conv2d, linear_cross_entropy (their dots); the other 1 case compiles at the default "
                          "precision\nerror: compiling for a GPU without one needs (stops here).")


def test_an_op_named_twice_is_listed_once(capsys):
    assert [s.name for s in registry.ops(["rms_norm", "silu", "rms_norm"])] == ["rms_norm", "silu"]
    assert cli.main(["list", "--ops", "rms_norm", "rms_norm", "--wide"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 3  # header, rule, one row


# ------------------------------------------------------------- --ops, output paths, plot format


def _no_command(monkeypatch):
    """Every command body fails the test: the arguments alone must be refused (and a wrong
    acceptance must not start an 86 s check or a full compile sweep)."""
    for name in ("_list", "_check", "_bench", "_compile"):
        monkeypatch.setattr(cli, name, mock.Mock(side_effect=AssertionError(f"{name} ran")))


@pytest.mark.parametrize("argv", [["list", "--ops"], ["check", "--ops"], ["bench", "--ops"], ["compile", "--ops"],
                                  ["compile", "--ops", "--dtype", "bf16"], ["list", "--ops", "relu", "--ops"],
                                  ["list", "--ops", "--ops", "relu"]],
                         ids=["list", "check", "bench", "compile", "compile-flag-after", "second-empty", "first-empty"])
def test_empty_ops_is_an_error_not_every_op(argv, monkeypatch, capsys):
    """`--ops $EMPTY` (or a flag right after --ops) used to select every op: for compile, the
    whole sweep."""
    _no_command(monkeypatch)
    assert cli.main(argv) == 2
    assert capsys.readouterr().err == "error: --ops needs at least one op name (omit --ops for every op)\n"


@pytest.mark.parametrize("argv, first, second", [
    (["bench", "--ops", "silu", "--json", "{tmp}/out", "--plot", "{tmp}/out"], "json", "plot"),
    (["compile", "--ops", "silu", "--json", "{tmp}/out", "--markdown", "{tmp}/./out"], "json", "markdown"),
], ids=["bench", "compile"])
def test_two_outputs_to_the_same_file_are_refused(argv, first, second, tmp_path, monkeypatch, capsys):
    _no_command(monkeypatch)
    assert cli.main([a.format(tmp=tmp_path) for a in argv]) == 2
    assert capsys.readouterr().err == f"error: --{first} and --{second} name the same file, {argv[-1].format(tmp=tmp_path)}\n"


def test_plot_format_is_checked_before_the_benchmark(tmp_path, monkeypatch, capsys):
    """matplotlib refused `.txt` only in savefig, after the whole benchmark, with a traceback."""
    pytest.importorskip("matplotlib")
    _no_command(monkeypatch)
    assert cli.main(["bench", "--ops", "silu", "--plot", str(tmp_path / "chart.txt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"error: --plot {tmp_path / 'chart.txt'}: matplotlib cannot write '.txt' files; "
                          "use one of: ") and ".png" in err and ".svg" in err
    for ok in ("chart.png", "chart.SVG", "chart.pdf"):
        assert cli._bad_arguments(argparse.Namespace(cmd="bench", plot=str(tmp_path / ok))) is None, ok
    # no extension: matplotlib would write chart.png, another file than the one named (and
    # perhaps the --json report's)
    assert cli.main(["bench", "--ops", "silu", "--json", str(tmp_path / "chart.png"), "--plot", str(tmp_path / "chart")]) == 2
    assert capsys.readouterr().err == (f"error: --plot {tmp_path / 'chart'}: name the format with an extension "
                                       "(.png, .svg, .pdf, ...)\n")
    assert not list(tmp_path.iterdir())  # the probe wrote nothing


def test_list_starts_no_backend(tmp_path):
    """With the [compile] extra (jax's CUDA plugin) and no GPU, `list` printed jax's 30-line
    plugin traceback when JAX_PLATFORMS was unset; it needs no device at all."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-m", "jaxbwd", "list", "--ops", "silu"], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stderr) == (0, "")
    assert r.stdout.splitlines()[2].startswith("silu ")


# ------------------------------------------------------------------------- compile's printing


def _compiled_row(**kw):
    row = dict(op="silu", case="(8192, 4096)", dtype="float32", gpu="h200", kernel="silu_bwd", grid=[4096, 4, 1],
               num_warps=4, num_stages=3, registers=64, stack=0, spill_stores=0, smem=384, blocks_per_sm=8, limiter="registers",
               occupancy=0.5, waves=15.52, tensor_core="none", ex2=16, expf=16, sass=481, inst_per_s=None,
               io_bytes=403e6, op_io_bytes=403e6, op_min_bytes=403e6)
    return {**row, **kw}


def test_compile_prints_the_processes_it_uses_and_small_smem_in_bytes(monkeypatch, capsys):
    """It said "in 8 processes" for --jobs 8 and 3 cases (3 were used), "1 cases", and `0K`
    for shared memory below 512 B."""
    from jaxbwd import deviceless

    seen = {}

    def run(cases, *, jobs, timeout, progress):
        seen["jobs"] = jobs
        rows = [_compiled_row(case=c.shape_name, smem=s) for c, s in zip(cases, (0, 384, 2048))]
        return {"meta": dict(cases=len(cases), jobs=jobs, seconds=1.0), "rows": rows, "failures": []}

    monkeypatch.setattr(deviceless, "missing_requirements", lambda: [])
    monkeypatch.setattr(deviceless, "run", run)
    assert cli.main(["compile", "--ops", "silu", "--dtype", "f32", "--jobs", "8", "--wide"]) == 0
    out, err = capsys.readouterr()
    assert err.startswith("compiling 3 cases for h200 in 3 processes (") and seen["jobs"] == 3
    smem = {line.split()[1] + " " + line.split()[2]: line.split()[9] for line in out.splitlines()
            if line.startswith("silu ")}  # op, case (2 words), dtype, kernel, grid, w/s, reg, spill, smem
    assert smem == {"(8192, 4096)": "0B", "(4096, 5120)": "384B", "(2048, 16384)": "2K"}
    assert "3 kernel compiles from 3 cases (0 failed)" in out
    assert [deviceless.worker_count(j, n) for j, n in ((8, 1), (None, 1), (2, 5), (1, 0))] == [1, 1, 2, 1]
    assert (deviceless.plural(1, "case"), deviceless.plural(1, "process", "es"),
            deviceless.plural(2, "process", "es")) == ("1 case", "1 process", "2 processes")
    assert deviceless.summary({"meta": {"cases": 1, "seconds": 1.0}, "rows": [_compiled_row(stack=8)],
                               "failures": []}) == ("1 kernel compile from 1 case (0 failed) in 1.0 s; "
                                                    "1 kernel spills: silu_bwd(float32); 0 use tensor cores")


def test_baseline_table_names_dtypes_as_the_main_table_does():
    from jaxbwd import deviceless

    headers, rows = deviceless.compare({"rows": [_compiled_row(dtype="bfloat16", registers=72)]},
                                       {"rows": [_compiled_row(dtype="bfloat16")]})
    assert rows[0][headers.index("dtype")] == "bf16"
    assert rows[0][headers.index("reg")] == "72 -> 64"
    assert deviceless.table_rows({"rows": [_compiled_row(dtype="bfloat16")]})[1][0][2] == "bf16"


# --------------------------------------------- compile's workers: timeouts, signals, temp folders

# A stand-in compile worker (deviceless.WORKER_CMD): the protocol without XLA. It logs its pid
# and folder, sleeps FAKE_WORKER_STARTUP seconds before it is ready (jax's import, say) and
# hangs on the case named FAKE_WORKER_HANG ("*": every case).
FAKE_WORKER = '''
import json, os, sys, time
log = open(os.environ["FAKE_WORKER_LOG"], "a", buffering=1)
log.write(f"start {os.getpid()} {sys.argv[1]}\\n")
time.sleep(float(os.environ.get("FAKE_WORKER_STARTUP", "0")))
print('{"ready": true}', flush=True)
for line in sys.stdin:
    case = json.loads(line)
    log.write(f"case {os.getpid()} {case['shape_name']}\\n")
    if os.environ.get("FAKE_WORKER_HANG") in (case["shape_name"], "*"):
        time.sleep(600)
    if os.environ.get("FAKE_WORKER_GARBLE") == case["shape_name"]:
        print("a stray line", flush=True)
        continue
    time.sleep(0.1)
    print(json.dumps({"case": case["op"], "rows": []}), flush=True)
'''


def _fake_worker(tmp_path, monkeypatch, **env):
    from jaxbwd import deviceless

    (tmp_path / "fake_worker.py").write_text(FAKE_WORKER)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("FAKE_WORKER_LOG", str(tmp_path / "workers.log"))
    for k, v in env.items():
        monkeypatch.setenv(f"FAKE_WORKER_{k.upper()}", v)
    monkeypatch.setattr(deviceless, "WORKER_CMD", [sys.executable, str(tmp_path / "fake_worker.py")])
    monkeypatch.setattr(deviceless, "missing_requirements", lambda: [])


def _workers(tmp_path):
    """(pid, folder) of every worker the log names."""
    log = tmp_path / "workers.log"
    lines = log.read_text().splitlines() if log.exists() else []
    return [(int(w[1]), w[2]) for w in (line.split(" ", 2) for line in lines) if w[0] == "start"]


def _alive(pid):
    """Running (not gone, not a zombie waiting for its parent)."""
    try:
        return not pathlib.Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except FileNotFoundError:
        return False


def test_case_timer_starts_when_its_worker_is_ready_and_killed_workers_leave_no_folder(tmp_path, monkeypatch):
    """--timeout counted the worker's start-up (jax's import): a 1.5 s timeout that every case
    fits in failed them all, the case after a timeout paying the new worker's import. And a
    killed worker left its /tmp/jaxbwd-compile-* folder behind."""
    import tempfile

    from jaxbwd import deviceless

    _fake_worker(tmp_path, monkeypatch, startup="2", hang="(8192, 4096)")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    cases = deviceless.cases(["silu"], dtypes=("float32",))
    assert [c.shape_name for c in cases] == ["(8192, 4096)", "(4096, 5120)", "(2048, 16384)"]
    report = deviceless.run(cases, jobs=1, timeout=1)
    assert report["failures"] == [{"case": cases[0].id, "error": "timed out after 1 s"}]
    workers = _workers(tmp_path)
    assert len(workers) == 2  # the hung one, killed, and its replacement
    assert all(w[1].startswith(str(tmp_path / "tmp" / "jaxbwd-compile-")) for w in workers)
    assert not any(_alive(pid) for pid, _ in workers)
    assert list((tmp_path / "tmp").iterdir()) == []


DRIVER = '''
import signal, sys
# As started from a terminal, even if the test run itself ignores these (pytest under nohup
# passes an ignored SIGHUP on, which compile rightly keeps ignored)
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGHUP, signal.SIG_DFL)
signal.signal(signal.SIGTERM, signal.SIG_DFL)
from jaxbwd import __main__ as cli, deviceless
deviceless.WORKER_CMD = [sys.executable, sys.argv[1]]
deviceless.missing_requirements = lambda: []
sys.exit(cli.main(["compile", "--ops", "silu", "--dtype", "f32", "--jobs", "2"]))
'''


def _interrupt(tmp_path, cmd, env, signum, ready):
    """Runs ``cmd``, sends it ``signum`` once ``ready(its Popen)``; its exit code and stderr."""
    import signal
    import subprocess
    import time

    env = {**os.environ, **env, "TMPDIR": str(tmp_path / "tmp"), "PYTHONFAULTHANDLER": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not ready(proc) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert ready(proc), "the compile did not get going"
        proc.send_signal(signum)  # to the parent only: it must take its workers down itself
        try:  # stderr read while waiting: a full pipe must not stall the child
            _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:  # SIGABRT: faulthandler prints every thread's stack
            proc.send_signal(signal.SIGABRT)
            _, err = proc.communicate(timeout=30)
            raise AssertionError(f"still running 120 s after the signal; its threads:\n{err[-8000:]}")
        return proc.returncode, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("signame, code", [("SIGINT", 130), ("SIGTERM", 143), ("SIGHUP", 129)])
def test_a_signal_during_compile_kills_the_workers_and_removes_their_folders(signame, code, tmp_path, monkeypatch):
    """Ctrl-C gave a KeyboardInterrupt traceback; SIGTERM (a job scheduler's) left the
    workers compiling, orphaned; both left the workers' temp folders."""
    import signal

    _fake_worker(tmp_path, monkeypatch, hang="*")
    (tmp_path / "driver.py").write_text(DRIVER)
    log = tmp_path / "workers.log"
    busy = lambda proc: log.exists() and log.read_text().count("case ") == 2  # noqa: E731  both workers in a case
    rc, err = _interrupt(tmp_path, [sys.executable, str(tmp_path / "driver.py"), str(tmp_path / "fake_worker.py")],
                         {}, getattr(signal, signame), busy)
    assert rc == code, err
    assert "Traceback" not in err
    if signame == "SIGINT":
        assert err.endswith("\ninterrupted\n")
    else:
        assert f"jaxbwd compile: stopped by {signame}\n" in err, err
    workers = _workers(tmp_path)
    assert len(workers) == 2 and not any(_alive(pid) for pid, _ in workers)
    assert list((tmp_path / "tmp").iterdir()) == []


def test_a_garbled_answer_fails_its_case_and_the_run_goes_on(tmp_path, monkeypatch):
    """A worker line that is not JSON killed the thread serving it and left run() waiting."""
    from jaxbwd import deviceless

    import threading

    _fake_worker(tmp_path, monkeypatch, garble="(4096, 5120)")
    cases = deviceless.cases(["silu"], dtypes=("float32",))
    out = {}
    runner = threading.Thread(target=lambda: out.update(report=deviceless.run(cases, jobs=1, timeout=60)), daemon=True)
    runner.start()
    runner.join(120)
    assert not runner.is_alive(), "run() hangs on a garbled answer"
    report = out["report"]
    assert report["failures"] == [{"case": cases[1].id,
                                   "error": "the compile worker answered 'a stray line', not a JSON result"}]
    assert not any(_alive(pid) for pid, _ in _workers(tmp_path))


def test_an_ignored_sighup_stays_ignored(tmp_path, monkeypatch):
    """Under nohup (SIGHUP ignored) a closed terminal must not stop the sweep."""
    import signal
    import time

    from jaxbwd import deviceless

    _fake_worker(tmp_path, monkeypatch)
    cases = deviceless.cases(["silu"], dtypes=("float32",))
    old = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    sent = []

    def progress(case, msg):  # the signal arrives mid-run, after the first case
        if not sent:
            sent.append(case)
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(0.2)  # delivered (to the main thread) before the run goes on

    try:
        report = deviceless.run(cases, jobs=1, timeout=60, progress=progress)
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, old)
    assert sent and report["failures"] == [] and len(report["rows"]) == 0 and report["meta"]["cases"] == 3


@pytest.mark.compile
def test_sigterm_during_a_real_compile_leaves_no_worker_and_no_folder(tmp_path):
    """The real worker and compiler: SIGTERM while a case compiles (it hangs in its trace)."""
    import signal

    from jaxbwd import deviceless

    if deviceless.missing_requirements():
        pytest.skip(f"needs {', '.join(deviceless.missing_requirements())}")
    from test_compile import SLOW_OP  # tests/ is on sys.path under pytest

    (tmp_path / "hang.py").write_text(SLOW_OP)
    (tmp_path / "tmp").mkdir()
    workers = []

    def compiling(proc):  # its worker has started and made its folder; then a few seconds into the case
        import time

        kids = [int(p.name) for p in pathlib.Path("/proc").glob("[0-9]*") if _ppid(p) == proc.pid]
        if workers or not (kids and list((tmp_path / "tmp").iterdir())):
            return bool(workers)
        workers.extend(kids)
        time.sleep(8)
        return True

    rc, err = _interrupt(tmp_path, [sys.executable, "-m", "jaxbwd", "compile", "--ops", f"{tmp_path / 'hang.py'}:SPEC",
                                    "--dtype", "f32", "--jobs", "1"], {}, signal.SIGTERM, compiling)
    assert rc == 143, err
    assert "Traceback" not in err and "compiling 2 cases for h200 in 1 process " in err
    assert workers and not any(_alive(pid) for pid in workers)
    assert list((tmp_path / "tmp").iterdir()) == []


def _ppid(proc_dir):
    try:
        return int((proc_dir / "stat").read_text().split(") ")[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None
