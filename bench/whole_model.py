"""Whole-model benchmark: the LM of examples/train_lm.py built from jaxbwd ops vs plain JAX/flax.

Reports, for one AdamW train step (forward, backward, update), the compiled peak temporary
memory (``compile().memory_analysis().temp_size_in_bytes``, exact on any backend, nothing
is run) at a large config, and the measured step time at a config this machine can run.

    python bench/whole_model.py [--json PATH]
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

LARGE = lm.Config(d_model=1024, n_layers=8, n_heads=16, n_kv_heads=8, mlp_hidden=2816, seq_len=4096,
                  batch_size=1, vocab=32000)
TIMED = lm.Config(d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, mlp_hidden=704, seq_len=512,
                  batch_size=4, vocab=32000)


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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH")
    p.add_argument("--skip-timing", action="store_true",
                   help="report compiled temporary memory only, without timing the train steps")
    args = p.parse_args(argv)
    impl = jaxbwd.config.default_implementation()
    ours, plain = lm.jaxbwd_ops(impl), lm.plain_ops()
    report = {"date": time.strftime("%Y-%m-%d"), "jax": jax.__version__, "device": jax.devices()[0].device_kind,
              "implementation": impl, "large": dataclasses.asdict(LARGE), "timed": dataclasses.asdict(TIMED)}
    report["temp_mib_jaxbwd"] = temp_bytes(LARGE, ours) / 2**20
    report["temp_mib_plain"] = temp_bytes(LARGE, plain) / 2**20
    print(f"large config (T={LARGE.seq_len}, V={LARGE.vocab}, D={LARGE.d_model}, {LARGE.n_layers} layers): "
          f"train-step temp memory jaxbwd {report['temp_mib_jaxbwd']:.0f} MiB vs plain {report['temp_mib_plain']:.0f} MiB "
          f"({report['temp_mib_plain'] / report['temp_mib_jaxbwd']:.2f}x)")
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
