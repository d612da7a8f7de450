"""Train a small Llama-style byte-level language model with jaxbwd's ops.

The model: byte embedding, N blocks of [RMSNorm -> GQA causal attention with RoPE ->
residual add -> RMSNorm -> SwiGLU MLP -> residual add], a final RMSNorm and a tied output
projection, trained with optax AdamW (linear warmup + cosine decay) in one jitted step.
The loss of the tied head is ``linear_cross_entropy`` (``Embed.attend_cross_entropy``):
the [batch, seq, vocab] logits are never stored, in the forward or the backward. Default
corpus: the Python standard library's own source files, found through ``sysconfig``
(present on every Python install, no download); ``--data PATH`` trains on any text file.
The last 5% of the corpus (at least 4096 bytes) is held out for evaluation: every evaluation
scores the same windows drawn from it (16 x 16 windows of 128 bytes in the default preset),
and the unigram baseline is taken on the same bytes.

Writes ``runs/<name>/metrics.json`` and ``runs/<name>/loss.png`` and prints bits per byte
against the unigram baseline and a generated sample.

    python examples/train_lm.py                      # XLA backward on CPU, a few minutes
    python examples/train_lm.py --implementation pallas --preset tiny   # kernels, interpret mode on CPU
    python examples/train_lm.py --check              # first-step grads vs the same model in plain JAX/flax
    python examples/train_lm.py --mesh data=4,model=2 --preset tiny   # 8 devices (simulated on CPU)

``--mesh``: data parallel over ``data`` and Megatron-style tensor parallel over ``model``
(query/key/value/gate/up column-parallel, out/down row-parallel, the tied embedding
vocab-parallel, so the fused head and its loss run per vocabulary shard) on
an explicit-sharding mesh (``jax.set_mesh``; ``--axis-type auto`` for Auto axes, where
XLA propagates the shardings); jaxbwd's ops run per shard. On CPU the devices are
simulated (``jax_num_cpu_devices``).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import pathlib
import sys
import sysconfig
import time
from typing import Any, Callable, NamedTuple, Optional

import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

import jaxbwd
import jaxbwd.nn as jnn
from jaxbwd import reference


@dataclasses.dataclass(frozen=True)
class Config:
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    mlp_hidden: int = 384
    seq_len: int = 128
    batch_size: int = 16
    steps: int = 1200
    lr: float = 3e-3
    warmup: int = 100
    weight_decay: float = 0.1
    eval_every: int = 200
    eval_batches: int = 16
    seed: int = 0
    vocab: int = 256  # bytes

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


PRESETS = {
    "default": Config(),
    # Small enough for Pallas interpret mode on CPU, or a CI smoke test.
    "tiny": Config(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, mlp_hidden=128, seq_len=64,
                   batch_size=4, steps=30, warmup=5, eval_every=15, eval_batches=2),
}

VOCAB = 256  # byte-level tokens


# ------------------------------------------------------------------------------ data
def stdlib_corpus(max_bytes: Optional[int] = None) -> bytes:
    """The standard library's .py sources, concatenated in a fixed order."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for p in sorted(root.rglob("*.py")):
        if "site-packages" in p.parts or "test" in p.parts or "tests" in p.parts:
            continue
        try:
            b = p.read_bytes()
        except OSError:
            continue
        parts.append(b)
        total += len(b)
        if max_bytes and total >= max_bytes:
            break
    return b"\n".join(parts)


def load_data(path: Optional[str], max_bytes: Optional[int] = None):
    raw = pathlib.Path(path).read_bytes() if path else stdlib_corpus(max_bytes)
    if max_bytes:
        raw = raw[:max_bytes]
    data = np.frombuffer(raw, dtype=np.uint8).astype(np.int32)
    n_eval = max(len(data) // 20, 4096)
    if len(data) < 2 * n_eval:
        raise ValueError(f"the corpus has {len(data)} bytes; at least {2 * 4096} are needed "
                         "(the last 5%, at least 4096 bytes, is held out)")
    return data[:-n_eval], data[-n_eval:]


def unigram_bits_per_byte(train, held_out) -> float:
    """Cross-entropy (bits/byte) of the held-out bytes under the train byte frequencies."""
    counts = np.bincount(train, minlength=VOCAB).astype(np.float64) + 1.0
    logp = np.log2(counts / counts.sum())
    return float(-logp[held_out].mean())


def batches(data, cfg: Config, rng: np.random.Generator):
    n = len(data) - cfg.seq_len - 1
    while True:
        starts = rng.integers(0, n, cfg.batch_size)
        x = np.stack([data[s : s + cfg.seq_len + 1] for s in starts])
        yield x[:, :-1], x[:, 1:]


# ----------------------------------------------------------------------------- model
class Ops(NamedTuple):
    """The building blocks a model is made of: jaxbwd's, or plain JAX/flax ones."""

    RMSNorm: Any
    Dense: Any
    Embed: Any
    attention: Callable
    rope: Callable
    swiglu: Callable
    add: Callable
    # head_loss(embed, h, labels): the mean cross-entropy of the tied head embed.attend(h)
    head_loss: Callable


def jaxbwd_ops(implementation: Optional[str], head: str = "fused") -> Ops:
    """jaxbwd's modules and ops. ``head="fused"``: ``Embed.attend_cross_entropy``
    (linear_cross_entropy, no logits stored); ``"unfused"``: ``Embed.attend`` (jaxbwd.matmul)
    then ``jaxbwd.cross_entropy`` on the stored logits."""
    impl = dict(implementation=implementation)
    if head == "fused":
        head_loss = lambda embed, h, labels: embed.attend_cross_entropy(h, labels)  # noqa: E731
    elif head == "unfused":
        head_loss = lambda embed, h, labels: jaxbwd.cross_entropy(embed.attend(h), labels, **impl)  # noqa: E731
    else:
        raise ValueError(f"train_lm: head must be 'fused' or 'unfused', got {head!r}")
    return Ops(
        RMSNorm=lambda **kw: jnn.RMSNorm(**kw, **impl),
        Dense=lambda *a, **kw: jnn.Dense(*a, **kw, **impl),
        Embed=lambda *a, **kw: jnn.Embed(*a, **kw, **impl),
        attention=lambda q, k, v: jaxbwd.dot_product_attention(q, k, v, is_causal=True, **impl),
        rope=lambda x: jaxbwd.rope(x, **impl),
        swiglu=lambda g, u: jaxbwd.swiglu(g, u, **impl),
        add=lambda a, b: jaxbwd.residual_add(a, b, **impl),
        head_loss=head_loss,
    )


def plain_ops() -> Ops:
    """flax's own modules and jaxbwd.reference's plain-jnp functions (XLA autodiff)."""
    return Ops(
        RMSNorm=fnn.RMSNorm, Dense=fnn.Dense, Embed=fnn.Embed,
        attention=lambda q, k, v: reference.dot_product_attention(q, k, v, is_causal=True),
        rope=reference.rope, swiglu=reference.swiglu, add=jnp.add,
        head_loss=lambda embed, h, labels: reference.cross_entropy(embed.attend(h), labels),
    )


class Block(fnn.Module):
    cfg: Config
    ops: Ops

    @fnn.compact
    def __call__(self, x):
        cfg, ops = self.cfg, self.ops
        B, T, D = x.shape
        h = ops.RMSNorm(name="attn_norm")(x)
        dense = lambda n, name: ops.Dense(n, use_bias=False, name=name)
        q = dense(cfg.n_heads * cfg.head_dim, "query")(h).reshape(B, T, cfg.n_heads, cfg.head_dim)
        k = dense(cfg.n_kv_heads * cfg.head_dim, "key")(h).reshape(B, T, cfg.n_kv_heads, cfg.head_dim)
        v = dense(cfg.n_kv_heads * cfg.head_dim, "value")(h).reshape(B, T, cfg.n_kv_heads, cfg.head_dim)
        o = ops.attention(ops.rope(q), ops.rope(k), v).reshape(B, T, D)
        x = ops.add(x, dense(D, "out")(o))
        h = ops.RMSNorm(name="mlp_norm")(x)
        h = ops.swiglu(dense(cfg.mlp_hidden, "gate")(h), dense(cfg.mlp_hidden, "up")(h))
        return ops.add(x, dense(D, "down")(h))


class LM(fnn.Module):
    cfg: Config
    ops: Ops

    @fnn.compact
    def __call__(self, ids, labels=None):
        """The logits [B, T, vocab]; with ``labels`` [B, T] the mean loss instead (no logits)."""
        embed = self.ops.Embed(self.cfg.vocab, self.cfg.d_model, name="embed")
        x = embed(ids)
        for i in range(self.cfg.n_layers):
            x = Block(self.cfg, self.ops, name=f"block_{i}")(x)
        h = self.ops.RMSNorm(name="final_norm")(x)
        return embed.attend(h) if labels is None else self.ops.head_loss(embed, h, labels)


def make_loss(model: LM):
    def loss_fn(params, x, y):
        return model.apply({"params": params}, x, y)

    return loss_fn


# -------------------------------------------------------------------------- sharding
def parse_mesh(text: str) -> dict:
    """'data=4,model=2' -> {'data': 4, 'model': 2}."""
    axes = {}
    for part in text.split(","):
        name, _, size = part.partition("=")
        if name.strip() not in ("data", "model") or not size.strip().isdigit() or int(size) < 1:
            raise ValueError(f"--mesh: expected axes data=N and/or model=M, e.g. data=4,model=2; got {text!r}")
        if name.strip() in axes:
            raise ValueError(f"--mesh: axis {name.strip()!r} given twice in {text!r}")
        axes[name.strip()] = int(size)
    return axes


def make_mesh(axes: dict, axis_type: str = "explicit"):
    n = math.prod(axes.values())
    if len(jax.devices()) < n:
        raise SystemExit(f"--mesh {axes} needs {n} devices, found {len(jax.devices())} "
                         f"({jax.default_backend()}); to simulate them on CPU: JAX_PLATFORMS=cpu")
    kind = jax.sharding.AxisType.Explicit if axis_type == "explicit" else jax.sharding.AxisType.Auto
    return jax.make_mesh(tuple(axes.values()), tuple(axes), axis_types=(kind,) * len(axes), devices=jax.devices()[:n])


def param_specs(params, mesh, cfg: Config):
    """Megatron-LM layout over the mesh's ``model`` axis; replicated where the split would not
    fall on whole heads (attention) or whole rows/columns."""
    P = jax.sharding.PartitionSpec
    tp = dict(zip(mesh.axis_names, mesh.axis_sizes)).get("model", 1)
    # attention projections split by heads: the [.., heads * head_dim] reshape must keep
    # each head on one device
    splits = {"query": cfg.n_heads, "out": cfg.n_heads, "key": cfg.n_kv_heads, "value": cfg.n_kv_heads,
              "gate": cfg.mlp_hidden, "up": cfg.mlp_hidden, "down": cfg.mlp_hidden, "embed": cfg.vocab}

    def spec(path, leaf):
        names = [getattr(k, "key", "") for k in path]
        if tp == 1 or len(names) < 2 or names[-2] not in splits or splits[names[-2]] % tp:
            return P()
        if names[-1] == "kernel" and names[-2] in ("query", "key", "value", "gate", "up"):
            return P(None, "model")  # column parallel
        if names[-1] == "kernel" and names[-2] in ("out", "down"):
            return P("model", None)  # row parallel
        if names[-2:] == ["embed", "embedding"]:
            return P("model", None)  # vocab parallel
        return P()

    return jax.tree_util.tree_map_with_path(spec, params)


# -------------------------------------------------------------------------- training
def make_optimizer(cfg: Config):
    """AdamW with warmup and cosine decay; weight decay on the matrices only (kernels and the
    embedding), as in GPT-3 and nanoGPT: decaying the RMSNorm scales would pull each layer's
    output gain toward zero for no regularising effect."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup, max(cfg.steps, cfg.warmup + 1), cfg.lr * 0.1)
    matrices = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay, mask=matrices))


def generate(model, params, prompt: np.ndarray, n: int, seq_len: int, key, temperature: float = 0.8) -> bytes:
    """Samples ``n`` bytes after ``prompt`` with a fixed-length causal window (no KV cache)."""
    apply = jax.jit(lambda p, x: model.apply({"params": p}, x)[0, -1])
    buf = list(prompt.tolist())
    for _ in range(n):
        window = ([32] * seq_len + buf)[-seq_len:]
        # on the host: on a mesh the logits are vocabulary-sharded, and categorical refuses
        # to sample along a sharded axis (jax >= 0.12.1)
        logits = jnp.asarray(jax.device_get(apply(params, jnp.asarray([window], jnp.int32))))
        key, sub = jax.random.split(key)
        buf.append(int(jax.random.categorical(sub, logits / temperature)))
    return bytes(buf[len(prompt):])


def check_grads(cfg: Config, implementation: Optional[str], x, y, head: str = "fused") -> float:
    """Max relative difference of first-step grads: jaxbwd model vs the plain JAX/flax model."""
    ours, plain = LM(cfg, jaxbwd_ops(implementation, head)), LM(cfg, plain_ops())
    params = ours.init(jax.random.PRNGKey(cfg.seed), x)["params"]
    p_plain = plain.init(jax.random.PRNGKey(cfg.seed), x)["params"]
    if jax.tree_util.tree_structure(params) != jax.tree_util.tree_structure(p_plain):
        raise SystemExit("check: parameter trees differ between jaxbwd.nn and flax modules")
    l1, g1 = jax.jit(jax.value_and_grad(make_loss(ours)))(params, x, y)
    l2, g2 = jax.jit(jax.value_and_grad(make_loss(plain)))(params, x, y)
    rel = jax.tree_util.tree_map(lambda a, b: float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-12)), g1, g2)
    worst = max(jax.tree_util.tree_leaves(rel))
    print(f"check: loss jaxbwd {float(l1):.6f} vs plain {float(l2):.6f}; max relative grad difference {worst:.2e}")
    return worst


def _run_name(name: str) -> str:
    """--name: one folder name under --out (a path there could write anywhere)."""
    if name in ("", ".", "..") or "/" in name or (os.altsep and os.altsep in name) or os.sep in name:
        raise argparse.ArgumentTypeError(f"a run name is one folder name under --out, got {name!r}")
    return name


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", help="a text file to train on (default: the Python stdlib sources)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="default",
                   help="model and schedule: default (820k params, 1200 steps, 3-12 minutes on CPU) or tiny "
                        "(90k params, 30 steps, under a minute)")
    p.add_argument("--steps", type=int, help="override the preset's number of steps (fewer steps shorten its "
                   "warmup in proportion)")
    p.add_argument("--implementation", choices=["xla", "pallas"], default=None,
                   help="jaxbwd implementation (default: pallas on GPU, xla elsewhere)")
    p.add_argument("--head", choices=["fused", "unfused"], default="fused",
                   help="loss of the tied head: fused linear_cross_entropy (default, logits never stored) or "
                        "unfused matmul + cross_entropy")
    p.add_argument("--check", action="store_true", help="compare first-step grads with the plain model and exit")
    p.add_argument("--name", default=None, type=_run_name, help="run name under --out (default: preset-implementation)")
    p.add_argument("--out", default="runs", help="output folder (default: runs/ in the current directory)")
    p.add_argument("--max-bytes", type=int, default=None, help="truncate the corpus (for quick runs)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--mesh", default=None, help="device mesh, e.g. data=4,model=2 (data and tensor parallel)")
    p.add_argument("--axis-type", choices=["explicit", "auto"], default="explicit",
                   help="mesh axis type: explicit (shardings in types) or auto (XLA propagates them)")
    args = p.parse_args(argv)
    try:
        mesh_axes = parse_mesh(args.mesh) if args.mesh else None
    except ValueError as e:
        p.error(str(e))
    if mesh_axes:
        # On CPU, simulate the devices (must precede the first use of the CPU backend).
        with contextlib.suppress(AttributeError, RuntimeError):  # absent option, or backend already up
            jax.config.update("jax_num_cpu_devices", max(math.prod(mesh_axes.values()), 1))
        if args.check:
            p.error("--check compares one-device grads; it does not take --mesh")
    elif args.axis_type != "explicit":
        p.error("--axis-type needs --mesh")

    cfg = PRESETS[args.preset]
    if args.steps is not None:
        if args.steps < 1:
            p.error("--steps must be >= 1")
        # The warmup keeps its share of the preset's run (100 of 1200 steps), so that a short
        # run still reaches the peak learning rate and decays from it.
        warmup = min(cfg.warmup, max(1, round(args.steps * cfg.warmup / cfg.steps)))
        cfg = dataclasses.replace(cfg, steps=args.steps, warmup=warmup, eval_every=min(cfg.eval_every, args.steps))
    if args.max_bytes is not None and args.max_bytes < 1:
        p.error(f"--max-bytes must be >= 1, got {args.max_bytes}")
    if args.data is not None and (os.path.isdir(args.data) or not os.path.exists(args.data)):
        p.error(f"--data {args.data}: {'is a folder, not a file' if os.path.isdir(args.data) else 'no such file'}")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        p.error(f"--out {args.out}: is a file, not a folder")
    impl = args.implementation
    if impl == "pallas" and jax.default_backend() != "gpu":
        jaxbwd.config.set_default(interpret=True)
        print("note: no GPU, Pallas kernels run in interpret mode (slow)"
              + ("; --preset tiny finishes in minutes" if args.preset != "tiny" else ""))

    try:
        train, held = load_data(args.data, args.max_bytes)
    except (OSError, ValueError) as e:
        if isinstance(e, OSError):
            p.error(f"{e.strerror or e}: {e.filename or args.data}")
        p.error(f"{e}" + (f" (--max-bytes {args.max_bytes})" if args.max_bytes else ""))
    rng = np.random.default_rng(cfg.seed)
    train_it = batches(train, cfg, rng)
    x0, y0 = next(train_it)

    if args.check:
        worst = check_grads(cfg, impl, jnp.asarray(x0), jnp.asarray(y0), args.head)
        print(f"check {'passed' if worst < 1e-3 else 'FAILED'}: the largest relative grad difference must be below 1e-3")
        return 0 if worst < 1e-3 else 1

    model = LM(cfg, jaxbwd_ops(impl, args.head))
    params = model.init(jax.random.PRNGKey(cfg.seed), jnp.asarray(x0))["params"]
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
    mesh = make_mesh(mesh_axes, args.axis_type) if mesh_axes else None
    if mesh is not None:
        if cfg.batch_size % mesh_axes.get("data", 1):
            p.error(f"--mesh: batch size {cfg.batch_size} is not divisible by data={mesh_axes['data']}")
        shard = lambda a, spec: jax.device_put(a, jax.sharding.NamedSharding(mesh, spec))  # noqa: E731
        specs = param_specs(params, mesh, cfg)
        params = jax.tree_util.tree_map(shard, params, specs)
        flat = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))[0]
        whole = sorted({path[-2].key for path, sp in flat if path[-1].key == "kernel" and sp == jax.sharding.PartitionSpec()})
        if mesh_axes.get("model", 1) > 1 and whole:
            print(f"note: model={mesh_axes['model']} does not divide their heads or width; replicated: {', '.join(whole)}")
        batch_spec = jax.sharding.PartitionSpec("data" if "data" in mesh_axes else None)
        put = lambda *a: tuple(shard(np.asarray(b), batch_spec) for b in a)  # noqa: E731
        print(f"mesh {dict(zip(mesh.axis_names, mesh.axis_sizes))} ({args.axis_type} axes) on {mesh.size} "
              f"{jax.default_backend()} devices")
    else:
        put = lambda *a: a  # noqa: E731
    # The run's folder after the checks and before training, so that a folder that cannot be
    # made stops the run before any step.
    mesh_tag = f"-{args.mesh.replace('=', '').replace(',', '-')}-{args.axis_type}" if args.mesh else ""
    head_tag = "-unfused" if args.head == "unfused" else ""
    name = args.name or f"{args.preset}-{impl or jaxbwd.config.default_implementation()}{head_tag}{mesh_tag}"
    out = pathlib.Path(args.out) / name
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        p.error(f"--out {args.out}: cannot create {out}: {e.strerror or e}")
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        return _train(args, cfg, out, model, params, train, held, train_it, x0, y0, put, n_params)


def _train(args, cfg, out, model, params, train, held, train_it, x0, y0, put, n_params) -> int:
    opt = make_optimizer(cfg)
    opt_state = opt.init(params)
    loss_fn = make_loss(model)

    @jax.jit
    def train_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    eval_loss_fn = jax.jit(loss_fn)

    # Every evaluation scores the same held-out windows, and the unigram baseline is taken on
    # exactly their target bytes, so that the two figures compare like with like (with few
    # windows, as in the tiny preset, the windows' bytes are not the whole held-out set's).
    it = batches(held, cfg, np.random.default_rng(cfg.seed + 1))
    eval_set = [next(it) for _ in range(cfg.eval_batches)]
    eval_bytes = np.concatenate([y.ravel() for _, y in eval_set])

    def evaluate(params) -> float:
        """Held-out bits per byte over ``eval_set`` (the loss is in nats)."""
        nats = np.mean([float(eval_loss_fn(params, *put(x, y))) for x, y in eval_set])
        return float(nats) / math.log(2)

    unigram = unigram_bits_per_byte(train, eval_bytes)
    unigram_all = unigram_bits_per_byte(train, held)
    print(f"jax {jax.__version__} on {jax.default_backend()}; {n_params:,} params; corpus {len(train):,} train "
          f"+ {len(held):,} held-out bytes; unigram baseline {unigram:.3f} bits/byte on the {eval_bytes.size:,} "
          f"held-out bytes evaluated ({unigram_all:.3f} on all)")

    history, evals = [], []
    tokens_per_step = cfg.batch_size * cfg.seq_len
    t_start = time.perf_counter()
    t_train = 0.0
    bar = tqdm(range(cfg.steps), disable=args.no_progress, desc="train", dynamic_ncols=True)
    x, y = x0, y0
    for step in bar:
        t0 = time.perf_counter()
        params, opt_state, loss = train_step(params, opt_state, *put(x, y))
        bpb = float(loss) / math.log(2)
        if step > 0:  # step 0 includes compilation
            t_train += time.perf_counter() - t0
        history.append(bpb)
        tps = tokens_per_step * max(step, 1) / max(t_train, 1e-9) if step else 0.0
        bar.set_postfix(bits_per_byte=f"{bpb:.3f}", tok_s=f"{tps:,.0f}")
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            ev = evaluate(params)
            evals.append({"step": step + 1, "bits_per_byte": ev})
            first = evals[-2]["step"] + 1 if len(evals) > 1 else 1
            recent = history[first - 1:]
            bar.write(f"step {step + 1}: train {sum(recent) / len(recent):.3f} bits/byte "
                      f"(mean of steps {first}-{step + 1}), held-out {ev:.3f} bits/byte")
        x, y = next(train_it)
    bar.close()

    final_bpb = evals[-1]["bits_per_byte"]
    # The first step (compilation) is not timed: with one step there is nothing to time.
    tok_s = tokens_per_step * (cfg.steps - 1) / max(t_train, 1e-9) if cfg.steps > 1 else None
    metrics = {
        "config": dataclasses.asdict(cfg), "mesh": args.mesh, "axis_type": args.axis_type if args.mesh else None, "implementation": args.implementation or jaxbwd.config.default_implementation(),
        "head": args.head,
        "jax": jax.__version__, "backend": jax.default_backend(), "params": n_params,
        "train_bits_per_byte": history, "eval": evals, "unigram_bits_per_byte": unigram,
        "unigram_bits_per_byte_all_held_out": unigram_all, "eval_bytes": int(eval_bytes.size),
        "final_bits_per_byte": final_bpb, "tokens_per_second": tok_s,
        "wall_seconds": time.perf_counter() - t_start,
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    _plot(history, evals, unigram, out / "loss.png")

    sample = generate(model, params, held[:cfg.seq_len // 2], 160, cfg.seq_len, jax.random.PRNGKey(1))
    speed = "tokens/s n/a: one step, compilation" if tok_s is None else f"{tok_s:,.0f} tokens/s"
    print(f"held-out {final_bpb:.3f} bits/byte vs unigram {unigram:.3f} ({speed}); wrote {out}/")
    if final_bpb >= unigram:
        print(f"note: {cfg.steps} step{'s were' if cfg.steps != 1 else ' was'} too few to beat the byte "
              "frequencies (unigram)" + ("" if args.data else f"; the default preset's {PRESETS['default'].steps} "
                                         "steps get well below them"))
    print("sample:\n" + bytes(held[:cfg.seq_len // 2].astype(np.uint8)).decode("utf-8", "replace")
          + "\033[1m" * sys.stdout.isatty() + sample.decode("utf-8", "replace") + "\033[0m" * sys.stdout.isatty())
    return 0


def _plot(history, evals, unigram, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(np.arange(1, len(history) + 1), history, lw=0.8, label="train (per step)")
    ax.plot([e["step"] for e in evals], [e["bits_per_byte"] for e in evals], "o-", label="held-out")
    ax.axhline(unigram, color="gray", ls="--", label="unigram baseline")
    ax.set_xlabel("step")
    ax.set_ylabel("bits per byte")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside the axes: hides no data
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
