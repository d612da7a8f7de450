"""Benchmarks: ``python -m jaxbwd bench [--ops ...] [--size small|llm] [--mode vjp|jvp] [--json PATH] [--plot PATH]``.

For every op, in one run: forward + backward time of jaxbwd and of ``jax.grad`` of its
baseline (XLA autodiff of what a user calls without jaxbwd; below), the ratio, achieved
bandwidth, residual bytes and compiled temporary memory. Timing is the median of repeated
runs after warm-up, each ended by ``block_until_ready``. ``--mode jvp`` times forward mode instead: ``jax.jvp`` of
the op (its fwd rule and tangent rule: the ``attention_jvp`` kernel on the Pallas path)
against ``jax.jvp`` of the baseline (XLA's forward-mode autodiff); bytes moved count the
tangents like the inputs, and there are no residuals.

What is counted:
- bytes moved = differentiable and integer inputs read + output cotangent read + gradients
  written (the customary lower bound of a fused backward; the forward is counted too by
  adding the output written once). GB/s = bytes / time; ``of_copy`` divides it by the
  device's copy bandwidth measured in the same run (read + write of a 256 MiB buffer).
- TFLOP/s for ops that declare ``flops`` in the registry (attention counts its backward
  as 2.5x the forward, the FlashAttention-2 convention).
- base: what a user computes without jaxbwd, ``jaxbwd.baselines`` (the jax.nn, optax, lax or
  flax function the op replaces, on the inputs as given: ``jax.nn.silu``,
  ``optax.softmax_cross_entropy_with_integer_labels``, ``flax.linen.RMSNorm``,
  ``jax.nn.dot_product_attention`` with ``implementation="xla"``, not cuDNN), each row naming
  it (the table's footnote, the JSON's ``baseline``). Where the library has no such function
  (RoPE, dropout, adaptive pooling; flax's without flax installed) or none for the row's
  options, the base is ``jaxbwd.reference``, which computes in float32 and casts back; the
  table marks those rows with ``*``. With 16-bit inputs, autodiff of a float32 formula keeps
  float32 values, so its residual bytes and time overstate what 16-bit jnp code costs; the
  marked rows carry that caveat, the others do not.
- residual bytes = the arrays the forward keeps for the backward (the leaves of the vjp
  closure, inputs included); temp bytes = ``compile().memory_analysis().temp_size_in_bytes``
  of the jitted forward + backward.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import textwrap
import time
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp

from jaxbwd import config, registry


@dataclasses.dataclass
class BenchRow:
    """One op at one size: times in ms, bytes, ratios (>1 means jaxbwd is faster / smaller)."""

    op: str
    shapes: str
    implementation: str
    ms: float
    ms_autodiff: float
    speedup: float
    gb_s: float
    of_copy: float
    tflop_s: Optional[float]
    residual_bytes: Optional[int]  # None in jvp mode (nothing is saved)
    residual_bytes_autodiff: Optional[int]
    temp_bytes: Optional[int]
    temp_bytes_autodiff: Optional[int]
    mode: str = "vjp"
    baseline: str = "jaxbwd.reference"  # what "autodiff" differentiates (see the module docstring)


def _materialise(args, key):
    out = []
    for i, a in enumerate(args):
        if isinstance(a, jax.ShapeDtypeStruct):
            k = jax.random.fold_in(key, i)
            if jnp.issubdtype(a.dtype, jnp.floating):
                a = jax.random.normal(k, a.shape, jnp.float32).astype(a.dtype)
            else:
                a = jnp.zeros(a.shape, a.dtype)
        out.append(a)
    return out


def bench_inputs(spec: registry.OpSpec, size: str, key, abstract: bool = False):
    """Concrete ``(args, kwargs)`` for ``spec`` at ``size`` ("small" or "llm").

    The registry's ``bench`` entry for that size when present (bf16); otherwise "llm"
    materialises the first lowering shape (normal floats, zero integers) and "small" uses the
    first test example in float32. ``abstract``: the large arrays (a bench entry's, a lowering
    shape's) as ShapeDtypeStructs instead, nothing allocated.
    """
    for name, ex in spec.bench:
        if name == size:
            make = lambda: ex.make(key, jnp.dtype("bfloat16"))  # noqa: E731
            args, kwargs = jax.eval_shape(make) if abstract else make()
            return list(args), kwargs
    if size == "llm" and spec.lowering:
        args, kwargs = spec.lowering[0].make(key, None)
        return (list(args) if abstract else _materialise(args, key)), kwargs
    args, kwargs = spec.examples[0].make(key, jnp.dtype("float32"))
    return list(args), kwargs


def median_time(fn, *args, repeats: int = 10, warmup: int = 2) -> float:
    """Median wall time in seconds of ``fn(*args)`` over ``repeats`` runs after ``warmup``
    runs, each ended by ``jax.block_until_ready``."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _nbytes(tree) -> int:
    return int(sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "dtype")))


def copy_bandwidth(n_bytes: int = 256 << 20) -> float:
    """Device copy bandwidth in GB/s (read + write of an ``n_bytes`` f32 buffer)."""
    x = jnp.ones((n_bytes // 4,), jnp.float32)
    f = jax.jit(lambda x: x * 1.0001)
    return 2 * n_bytes / median_time(f, x) / 1e9


def _temp_bytes(fn, *args) -> Optional[int]:
    try:
        mem = jax.jit(fn).lower(*args).compile().memory_analysis()
        return int(mem.temp_size_in_bytes) if mem is not None else None
    except Exception:  # memory_analysis is not available on every backend
        return None


def jvp_step(f, n):
    """``g(*primals, *tangents) = jax.jvp(f, primals, tangents)`` for ``f`` of ``n`` arrays."""
    return lambda *d_and_t: jax.jvp(f, tuple(d_and_t[:n]), tuple(d_and_t[n:]))


def _abstractly(body, args, kwargs):
    """``jax.eval_shape`` of ``body(args, kwargs)`` with the arrays among them (concrete or
    ShapeDtypeStructs) abstract and the rest as given: nothing is computed."""
    leaves, tree = jax.tree_util.tree_flatten((list(args), kwargs))
    arrays = [i for i, x in enumerate(leaves) if isinstance(x, (jax.Array, jax.ShapeDtypeStruct))]

    def f(*xs):
        full = list(leaves)
        for i, x in zip(arrays, xs):
            full[i] = x
        return body(*jax.tree_util.tree_unflatten(tree, full))

    return jax.eval_shape(f, *[leaves[i] for i in arrays])


def residual_bytes(spec: registry.OpSpec, fn, args, kwargs, **extra) -> int:
    """Bytes ``jax.vjp`` of ``fn`` (the op when ``fn is None``) keeps for the backward: the
    leaves of its vjp closure, inputs included; measured on abstract values, so realistic
    shapes cost nothing. ``extra`` goes to every call (e.g. ``implementation``)."""
    def saved(a, k):
        return jax.vjp(spec.bind(a, k, fn, **extra), *[a[i] for i in spec.diff_argnums])[1]

    return _nbytes(_abstractly(saved, args, kwargs))


def baseline_fn(spec: registry.OpSpec, args, kwargs):
    """``(fn, name)``: what the bench differentiates for the op called with ``args`` and
    ``kwargs`` (which may be ShapeDtypeStructs): its baseline (``spec.baseline``), or its
    reference where it has none or the baseline has no counterpart for these options;
    ``name`` says which (the library call, or ``"jaxbwd.reference"``)."""
    from jaxbwd import baselines

    if spec.baseline is not None:
        try:
            _abstractly(lambda a, k: spec.baseline(*a, **k), args, kwargs)
        except baselines.Unsupported:
            pass
        else:
            return spec.baseline, spec.baseline.calls
    return spec.reference, "jaxbwd.reference"


def bench_op(spec: registry.OpSpec, size: str, implementation: str, copy_gb_s: float, repeats: int = 10,
             mode: str = "vjp") -> BenchRow:
    """Times one op's forward + backward (``mode="vjp"``) or forward + tangent
    (``mode="jvp"``) against autodiff of its baseline (:func:`baseline_fn`)."""
    args, kwargs = bench_inputs(spec, size, jax.random.PRNGKey(0))
    diff = [args[i] for i in spec.diff_argnums]

    ours = spec.bind(args, kwargs, implementation=implementation)
    base, baseline = baseline_fn(spec, args, kwargs)
    theirs = spec.bind(args, kwargs, base)
    out_shape = jax.eval_shape(ours, *diff)
    flops = spec.flops(*args, **kwargs) if spec.flops else None
    shapes = " ".join("x".join(map(str, a.shape)) + ":" + jnp.dtype(a.dtype).name for a in args if hasattr(a, "shape"))
    if mode == "jvp":
        jvp_flops = spec.jvp_flops(*args, **kwargs) if spec.jvp_flops else None
        keys = jax.random.split(jax.random.PRNGKey(1), len(diff))
        tangents = [jax.random.normal(k, d.shape, jnp.float32).astype(d.dtype) for k, d in zip(keys, diff)]
        step_ours, step_ref = jax.jit(jvp_step(ours, len(diff))), jax.jit(jvp_step(theirs, len(diff)))
        t_ours = median_time(step_ours, *diff, *tangents, repeats=repeats)
        t_ref = median_time(step_ref, *diff, *tangents, repeats=repeats)
        moved = _nbytes(args) + _nbytes(tangents) + 2 * _nbytes(out_shape)
        gb_s = moved / t_ours / 1e9
        return BenchRow(
            op=spec.name, shapes=shapes, implementation=implementation, mode=mode,
            ms=t_ours * 1e3, ms_autodiff=t_ref * 1e3, speedup=t_ref / t_ours,
            gb_s=gb_s, of_copy=gb_s / copy_gb_s if copy_gb_s else 0.0,
            tflop_s=(jvp_flops / t_ours / 1e12) if jvp_flops else None,
            residual_bytes=None, residual_bytes_autodiff=None,
            temp_bytes=_temp_bytes(step_ours, *diff, *tangents), temp_bytes_autodiff=_temp_bytes(step_ref, *diff, *tangents),
            baseline=baseline,
        )
    ct = jax.random.normal(jax.random.PRNGKey(1), out_shape.shape, jnp.float32).astype(out_shape.dtype)

    def fwd_bwd(f):
        def g(ct, *d):
            out, vjp = jax.vjp(f, *d)
            return out, vjp(ct)

        return g

    step_ours, step_ref = jax.jit(fwd_bwd(ours)), jax.jit(fwd_bwd(theirs))
    t_ours = median_time(step_ours, ct, *diff, repeats=repeats)
    t_ref = median_time(step_ref, ct, *diff, repeats=repeats)
    moved = _nbytes(args) + 2 * _nbytes(ct) + _nbytes(diff)
    res_ours = residual_bytes(spec, None, args, kwargs, implementation=implementation)
    res_ref = residual_bytes(spec, base, args, kwargs)
    gb_s = moved / t_ours / 1e9
    return BenchRow(
        op=spec.name, shapes=shapes, implementation=implementation,
        ms=t_ours * 1e3, ms_autodiff=t_ref * 1e3, speedup=t_ref / t_ours,
        gb_s=gb_s, of_copy=gb_s / copy_gb_s if copy_gb_s else 0.0,
        tflop_s=(flops / t_ours / 1e12) if flops else None,
        residual_bytes=res_ours, residual_bytes_autodiff=res_ref,
        temp_bytes=_temp_bytes(step_ours, ct, *diff), temp_bytes_autodiff=_temp_bytes(step_ref, ct, *diff),
        baseline=baseline,
    )


def default_size() -> str:
    """``"llm"`` on a GPU, ``"small"`` elsewhere (realistic shapes take minutes per op on a CPU)."""
    return "llm" if jax.default_backend() == "gpu" else "small"


def unavailable(implementation: Optional[str] = None, mode: str = "vjp") -> Optional[str]:
    """Why ``implementation`` (``None``: the configured default) cannot be benchmarked in
    ``mode`` on this machine, as one sentence; ``None`` when it can. Pallas kernels are timed
    on a GPU only: elsewhere they run in interpret mode, which times the interpreter, not the
    kernels. Forward mode (``"jvp"``) needs jax >= 0.12."""
    from jaxbwd.vjp._derivatives import FORWARD_MODE

    if config.resolve(implementation, "bench") == "pallas" and jax.default_backend() != "gpu":
        return (f"jaxbwd bench: the Pallas kernels are timed on a GPU only (this backend: {jax.default_backend()}; "
                "interpret mode would time the interpreter); use --implementation xla here, or "
                "`python -m jaxbwd check` to test the kernels in interpret mode")
    if mode == "jvp" and not FORWARD_MODE:
        return f"jaxbwd bench: mode 'jvp' needs jax >= 0.12 (forward mode of the ops), this is jax {jax.__version__}"
    return None


def run(ops: Optional[Sequence[str]] = None, size: Optional[str] = None, implementation: Optional[str] = None,
        repeats: int = 10, mode: str = "vjp") -> dict[str, Any]:
    """Benchmarks the named ops (all when ``None``) and returns a JSON-able report.

    Args:
      ops: op names. size: ``"small"`` (test shapes, f32) or ``"llm"`` (realistic shapes);
        ``None``: :func:`default_size`.
      implementation: defaults to ``jaxbwd.config.default_implementation()``; on CPU that is
        XLA (interpret-mode kernels are not benchmarked).
      mode: ``"vjp"`` (forward + backward) or ``"jvp"`` (forward + tangent, jax >= 0.12).

    Raises:
      ValueError: unknown size or mode, Pallas without a GPU (see :func:`unavailable`), or
        jvp mode on a jax without forward mode or for an op without one. KeyError: unknown op.
    """
    size = size or default_size()
    if size not in ("small", "llm"):
        raise ValueError(f"jaxbwd bench: size must be 'small' or 'llm', got {size!r}")
    if mode not in ("vjp", "jvp"):
        raise ValueError(f"jaxbwd bench: mode must be 'vjp' or 'jvp', got {mode!r}")
    why = unavailable(implementation, mode)
    if why:
        raise ValueError(why)
    specs = registry.ops(ops)
    no_jvp = [s.name for s in specs if not s.forward_mode] if mode == "jvp" else []
    if no_jvp:
        raise ValueError(f"jaxbwd bench: mode 'jvp' needs forward mode, which {', '.join(no_jvp)} "
                         "does not have (a fwd rule and no tangent rule); leave it out or give it a tangent")
    kind = config.resolve(implementation, "bench")  # "pallas:<backend>" named is passed on as named
    impl = implementation if kind == "pallas" and config.named(implementation) else kind
    copy = copy_bandwidth()
    rows = []
    for spec in specs:
        has_kernels = spec.jvp_kernels if mode == "jvp" else spec.has_kernels
        rows.append(bench_op(spec, size, impl if has_kernels else "xla", copy, repeats, mode))
    return {
        "date": time.strftime("%Y-%m-%d"), "jax": jax.__version__, "backend": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind), "size": size, "mode": mode, "copy_gb_s": copy,
        "rows": [dataclasses.asdict(r) for r in rows],
    }


def _num(x: float) -> str:
    """Three significant digits (two below 0.001), no exponent above 1e-5:
    12345, 123, 1.23, 0.00123, 0.00012, 1.2e-06."""
    if x == 0 or abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) < 1e-3:
        return f"{x:.2g}"
    return f"{x:.{2 - math.floor(math.log10(abs(x)))}f}"


def format_bytes(n: Optional[int]) -> str:
    """Bytes in the largest binary unit that keeps the figure >= 1 ("-" when unknown)."""
    if n is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{_num(n / scale)} {unit}"
    return f"{n} B"


def format_table(report: dict[str, Any]) -> str:
    """The report of :func:`run` as a text table (at most 120 columns) with a title line and
    a key to the columns. Figures have three significant digits, bytes their own unit."""
    head = ("op", "impl", "ms", "base ms", "speedup", "GB/s", "%copy", "TFLOP/s",
            "resid", "base resid", "temp", "base temp")
    rows = [
        (r["op"] + ("*" if r.get("baseline", "jaxbwd.reference") == "jaxbwd.reference" else ""),
         r["implementation"], _num(r["ms"]), _num(r["ms_autodiff"]), f"{_num(r['speedup'])}x",
         _num(r["gb_s"]), f"{_num(100 * r['of_copy'])}%", "-" if r["tflop_s"] is None else _num(r["tflop_s"]),
         format_bytes(r["residual_bytes"]), format_bytes(r["residual_bytes_autodiff"]), format_bytes(r["temp_bytes"]),
         format_bytes(r["temp_bytes_autodiff"]))
        for r in report["rows"]
    ]
    widths = [max(len(h), *(len(x[i]) for x in rows)) if rows else len(h) for i, h in enumerate(head)]
    def line(cells):  # names left, figures right; one space between figures keeps it in 120 columns
        return (f"{cells[0]:<{widths[0]}}  {cells[1]:>{widths[1]}}  "
                + " ".join(f"{c:>{w}}" for c, w in zip(cells[2:], widths[2:])))

    mode = report.get("mode", "vjp")
    title = (f"jaxbwd bench ({report['size']}{', jvp' if mode == 'jvp' else ''}) on {report['device']} ({report['backend']}), jax {report['jax']}, "
             f"{report['date']}; copy bandwidth {_num(report['copy_gb_s'])} GB/s")
    key = ("base = jax.grad of what a user calls without jaxbwd (jaxbwd.baselines: the jax.nn, optax, lax or "
           "flax function, on the inputs as given; attention's is jax.nn's XLA implementation); * = no such "
           "function for the op or its options, base = jaxbwd.reference, which computes in float32 (with 16-bit "
           "inputs its resid and ms overstate 16-bit jnp code); ms: forward + backward, median (test-sized "
           "shapes time mostly dispatch); speedup = base ms / ms; %copy = GB/s over the copy bandwidth; resid: "
           "bytes saved for the backward; temp: compiled temporary memory")
    if mode == "jvp":
        key = ("base = jax.jvp of what a user calls without jaxbwd (as in vjp mode; * = jaxbwd.reference), XLA's "
               "forward-mode autodiff; ms: forward + tangent, median; speedup = base ms / ms; %copy = GB/s over "
               "the copy bandwidth; temp: compiled temporary memory")
    named = sorted({(r["op"], r.get("baseline", "jaxbwd.reference")) for r in report["rows"]
                    if r.get("baseline", "jaxbwd.reference") != "jaxbwd.reference"})
    if named:
        key += "; baselines: " + "; ".join(f"{op}: {b}" for op, b in named)
    return "\n".join(textwrap.wrap(title, 120) + [line(head), line(["-" * w for w in widths])]
                     + [line(r) for r in rows] + textwrap.wrap(key, 120))


def plot(report: dict[str, Any], path: str) -> None:
    """Bar chart of speedup and residual-memory ratio per op (speedup only in jvp mode), in
    the format ``path``'s extension names; needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = report["rows"]
    jvp = report.get("mode") == "jvp"  # forward mode saves nothing: no residual bars
    names = [r["op"] + ("*" if r.get("baseline", "jaxbwd.reference") == "jaxbwd.reference" else "") for r in rows]
    speed = [r["speedup"] for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(rows)) + 3, 4))  # + room for the legend
    if jvp:
        ax.bar(x, speed, 0.6, label="speedup vs jax.jvp of the baseline (time)")
    else:
        mem = [(r["residual_bytes_autodiff"] or 0) / max(r["residual_bytes"] or 0, 1) for r in rows]
        ax.bar(x - 0.2, speed, 0.4, label="speedup vs jax.grad of the baseline (time)")
        ax.bar(x + 0.2, mem, 0.4, label="baseline / jaxbwd residual bytes")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(x, names, rotation=45, ha="right")
    ax.set_yscale("log")
    ax.set_title(f"jaxbwd vs autodiff of its baselines{' (jvp)' if jvp else ''} (*: the reference), "
                 f"{report['size']}, {report['device']}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside the axes: it covers no bar
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
