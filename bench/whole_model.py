"""Whole-model benchmark: the LM of examples/train_lm.py built from jaxbwd ops vs plain JAX/flax.

Reports, for one AdamW train step (forward, backward, update), the compiled peak temporary
memory (``compile().memory_analysis().temp_size_in_bytes``, exact on any backend, nothing
is run) at a large config, and the measured step time at a config this machine can run.

    python bench/whole_model.py [--json PATH] [--skip-timing] [--head-memory [--head-memory-gpu GPU]]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import train_lm as lm  # noqa: E402

import jaxbwd  # noqa: E402

import _cli  # noqa: E402  (bench/_cli.py: this script's folder is first on sys.path)

LARGE = lm.Config(d_model=1024, n_layers=8, n_heads=16, n_kv_heads=8, mlp_hidden=2816, seq_len=4096,
                  batch_size=1, vocab=32000)
TIMED = lm.Config(d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, mlp_hidden=704, seq_len=512,
                  batch_size=4, vocab=32000)


# The LM-head memory comparison: T tokens of width D against a vocabulary of V, bf16.
HEAD_T, HEAD_D, HEAD_VOCABS = 8192, 2048, (128256, 32000)
HEAD_MODEL = lm.Config(d_model=HEAD_D, n_layers=2, n_heads=16, n_kv_heads=8, mlp_hidden=5632, seq_len=HEAD_T,
                       batch_size=1, vocab=HEAD_VOCABS[0])


def head_losses(impl):
    """The loss of an LM head three ways: ``f(x [T, D], w [D, V], labels [T]) -> mean loss``."""
    def plain(x, w, y):  # jnp + optax: XLA autodiff
        logits = jnp.matmul(x, w, preferred_element_type=jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def unfused(x, w, y):
        return jaxbwd.cross_entropy(jaxbwd.matmul(x, w), y, implementation=impl)

    def fused(x, w, y):
        return jaxbwd.linear_cross_entropy(x, w, y, implementation=impl)

    losses = {"plain jnp/optax": plain, "matmul+cross_entropy": unfused, "linear_cross_entropy": fused}
    try:  # tokamax's chunked XLA formulation, for comparison when it is installed
        import tokamax
    except ImportError:
        return losses
    losses["tokamax chunked_xla"] = lambda x, w, y: tokamax.linear_softmax_cross_entropy_loss(
        x, y, w, reduction="mean", implementation="chunked_xla")
    return losses


def head_temp_bytes(fn, V: int, T: int = HEAD_T, D: int = HEAD_D) -> int:
    """Compiled temp memory of ``value_and_grad`` of ``fn`` w.r.t. x and w (bf16), nothing run."""
    x = jax.ShapeDtypeStruct((T, D), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((D, V), jnp.bfloat16)
    y = jax.ShapeDtypeStruct((T,), jnp.int32)
    step = jax.value_and_grad(fn, argnums=(0, 1))
    return int(jax.jit(step).lower(x, w, y).compile().memory_analysis().temp_size_in_bytes)


def head_temp_bytes_gpu(fn, V: int, gpu: str = "h200", T: int = HEAD_T, D: int = HEAD_D) -> int:
    """As :func:`head_temp_bytes`, compiled for ``gpu`` by XLA's deviceless GPU compiler
    (``jaxbwd.deviceless``, the ``[compile]`` extra) with the Pallas kernels: no GPU is used."""
    from jaxbwd import deviceless

    x = jax.ShapeDtypeStruct((T, D), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((D, V), jnp.bfloat16)
    y = jax.ShapeDtypeStruct((T,), jnp.int32)
    step = jax.value_and_grad(fn, argnums=(0, 1))
    return int(deviceless.compile_for(step, x, w, y, gpu=gpu).memory_analysis().temp_size_in_bytes)


def head_ops(impl):
    """The train_lm model's building blocks three ways, differing in the head's loss only for
    the two jaxbwd variants: plain flax/jnp, jaxbwd with attend + cross_entropy, jaxbwd fused."""
    ours = lm.jaxbwd_ops(impl)
    unfused = ours._replace(head_loss=lambda embed, h, y: jaxbwd.cross_entropy(embed.attend(h), y, implementation=impl))
    return {"plain jnp/optax": lm.plain_ops(), "matmul+cross_entropy": unfused, "linear_cross_entropy": ours}


def head_memory_table(impl) -> dict:
    """MiB of compiled temp memory: loss+head fwd+bwd at each vocabulary, and one train step of
    HEAD_MODEL (vocab HEAD_VOCABS[0]), per variant."""
    out = {"T": HEAD_T, "D": HEAD_D, "head": {}, "train_step": {}, "model": dataclasses.asdict(HEAD_MODEL)}
    for V in HEAD_VOCABS:
        out["head"][V] = {name: head_temp_bytes(fn, V) / 2**20 for name, fn in head_losses(impl).items()}
    for name, ops in head_ops(impl).items():
        out["train_step"][name] = temp_bytes(HEAD_MODEL, ops) / 2**20
    return out


def table_lines(names, table) -> list[str]:
    """A header naming every column, then one line per vocabulary: ``table[V][name]`` MiB.
    Each column is as wide as its name (at least 20), so that header and cells line up."""
    widths = [max(20, len(n)) for n in names]
    lines = ["  " + " | ".join(["V".rjust(7)] + [n.rjust(w) for n, w in zip(names, widths)])]
    for V, row in table.items():
        lines.append("  " + " | ".join([str(V).rjust(7)] + [f"{row[n]:{w}.1f}" for n, w in zip(names, widths)]))
    return lines


def make_step(cfg, ops):
    model = lm.LM(cfg, ops)
    loss_fn = lm.make_loss(model)
    opt = optax.adamw(1e-3)

    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    x = jax.ShapeDtypeStruct((cfg.batch_size, cfg.seq_len), jnp.int32)
    params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros(x.shape, x.dtype))["params"])
    opt_state = jax.eval_shape(opt.init, params)
    return model, opt, step, (params, opt_state, x, x)


def temp_bytes(cfg, ops) -> int:
    _, _, step, args = make_step(cfg, ops)
    return int(jax.jit(step).lower(*args).compile().memory_analysis().temp_size_in_bytes)


def step_time(cfg, ops, repeats=5) -> float:
    model, opt, step, (_, _, x, _) = make_step(cfg, ops)
    ids = jax.random.randint(jax.random.PRNGKey(0), x.shape, 0, cfg.vocab)
    params = model.init(jax.random.PRNGKey(0), ids)["params"]
    state = opt.init(params)
    f = jax.jit(step)
    for _ in range(2):
        jax.block_until_ready(f(params, state, ids, ids))
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(params, state, ids, ids))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _head_memory_gpu_problem(args):
    """What is wrong with --head-memory-gpu, or None: it adds to --head-memory's table (alone
    it was once ignored without a word), and it needs a known GPU and the [compile] extra."""
    if not args.head_memory_gpu:
        return None
    if not args.head_memory:
        return "--head-memory-gpu adds a GPU compile to --head-memory's table: give --head-memory too"
    from jaxbwd import deviceless

    if args.head_memory_gpu not in deviceless.GPUS:
        return f"--head-memory-gpu: unknown GPU {args.head_memory_gpu!r}; known: {', '.join(deviceless.GPUS)}"
    missing = deviceless.missing_requirements()
    if missing:
        return f"--head-memory-gpu needs {', '.join(missing)}: {deviceless.INSTALL_HINT}"
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=_cli.description(__doc__))
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH")
    p.add_argument("--skip-timing", action="store_true",
                   help="report compiled temporary memory only, without timing the train steps")
    p.add_argument("--head-memory-gpu", metavar="GPU",
                   help="with --head-memory: also compile the head comparison for GPU (e.g. h200) without a "
                        "GPU, Pallas and XLA paths (needs the [compile] extra)")
    p.add_argument("--head-memory", action="store_true",
                   help=f"also compare the LM head's loss three ways (T={HEAD_T}, D={HEAD_D}, "
                        f"V={' and '.join(map(str, HEAD_VOCABS))}, bf16): compiled temp memory only")
    args = p.parse_args(argv)
    problem = _cli.bad_arguments(args) or _head_memory_gpu_problem(args)
    if problem:  # before minutes of compiling, not after
        return _cli.refuse(p.prog, problem)
    impl = jaxbwd.config.default_implementation()
    ours, plain = lm.jaxbwd_ops(impl), lm.plain_ops()
    report = {"date": time.strftime("%Y-%m-%d"), "jax": jax.__version__, "device": jax.devices()[0].device_kind,
              "implementation": impl, "large": dataclasses.asdict(LARGE), "timed": dataclasses.asdict(TIMED)}
    report["temp_mib_jaxbwd"] = temp_bytes(LARGE, ours) / 2**20
    report["temp_mib_plain"] = temp_bytes(LARGE, plain) / 2**20
    print(f"large config (T={LARGE.seq_len}, V={LARGE.vocab}, D={LARGE.d_model}, {LARGE.n_layers} layers): "
          f"train-step temp memory jaxbwd {report['temp_mib_jaxbwd']:.0f} MiB vs plain {report['temp_mib_plain']:.0f} MiB "
          f"({report['temp_mib_plain'] / report['temp_mib_jaxbwd']:.2f}x)")
    if args.head_memory:
        table = report["head_memory_mib"] = head_memory_table(impl)
        print(f"LM head loss, value and grad (T={HEAD_T}, D={HEAD_D}, bf16), compiled temp memory in MiB:")
        names = list(head_losses(impl))
        print("\n".join(table_lines(names, table["head"])))
        if "tokamax chunked_xla" not in names:
            print("  (tokamax is not installed: its chunked XLA formulation is not compared)")
        if args.head_memory_gpu:
            fns = {n: f for n, f in head_losses("pallas").items() if not n.startswith("tokamax")}
            fns.update({f"{n} (xla)": f for n, f in head_losses("xla").items() if n in (
                "matmul+cross_entropy", "linear_cross_entropy")})
            gpu = table["head_gpu"] = {V: {n: head_temp_bytes_gpu(f, V, args.head_memory_gpu) / 2**20
                                           for n, f in fns.items()} for V in HEAD_VOCABS}
            print(f"  the same compiled for {args.head_memory_gpu} (Pallas kernels; \"(xla)\": the XLA paths), MiB:")
            print("\n".join(table_lines(list(fns), gpu)))
        print(f"train step ({HEAD_MODEL.n_layers} layers, V={HEAD_MODEL.vocab}): "
              + ", ".join(f"{n} {v:.0f} MiB" for n, v in table["train_step"].items()))
    if not args.skip_timing:
        report["step_ms_jaxbwd"] = step_time(TIMED, ours) * 1e3
        report["step_ms_plain"] = step_time(TIMED, plain) * 1e3
        print(f"timed config (T={TIMED.seq_len}, B={TIMED.batch_size}, V={TIMED.vocab}, D={TIMED.d_model}): "
              f"step {report['step_ms_jaxbwd']:.1f} ms jaxbwd ({impl}) vs {report['step_ms_plain']:.1f} ms plain "
              f"({report['step_ms_plain'] / report['step_ms_jaxbwd']:.2f}x)")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
