"""Smoke tests of the training examples: a few steps of a tiny config; the loss must go down."""
from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _example_module(name):
    """examples/<name>.py imported as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # flax modules are dataclasses, which look their module up
    spec.loader.exec_module(mod)
    return mod


def _run(args, tmp_path, env=None):
    out = subprocess.run([sys.executable, *args, "--out", str(tmp_path), "--no-progress"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def test_train_lm_tiny_loss_goes_down(tmp_path):
    stdout = _run(["examples/train_lm.py", "--preset", "tiny", "--steps", "40", "--max-bytes", "400000",
                   "--name", "smoke"], tmp_path)
    m = json.loads((tmp_path / "smoke" / "metrics.json").read_text())
    first, last = sum(m["train_bits_per_byte"][:5]) / 5, sum(m["train_bits_per_byte"][-5:]) / 5
    assert last < first - 0.7, (first, last)  # bits/byte (0.7 bits = 0.49 nats)
    assert (tmp_path / "smoke" / "loss.png").stat().st_size > 1000
    assert "bits/byte" in stdout and "sample:" in stdout
    assert "nats" not in stdout.split("sample:")[0]  # one unit throughout
    assert re.search(r"^step 40: train \d+\.\d{3} bits/byte \(mean of steps 31-40\), held-out \d+\.\d{3} bits/byte$",
                     stdout, re.M), stdout


def test_train_lm_unigram_baseline_on_the_evaluated_bytes(tmp_path):
    """The held-out figure and the unigram baseline it is printed against are taken on the
    same bytes (with the tiny preset's 512 evaluated bytes, the whole held-out set's unigram
    figure is not comparable)."""
    lm = _example_module("train_lm")
    _run(["examples/train_lm.py", "--preset", "tiny", "--steps", "2", "--max-bytes", "200000", "--name", "u"], tmp_path)
    m = json.loads((tmp_path / "u" / "metrics.json").read_text())
    cfg = lm.PRESETS["tiny"]
    train, held = lm.load_data(None, 200000)
    it = lm.batches(held, cfg, np.random.default_rng(cfg.seed + 1))
    targets = np.concatenate([next(it)[1].ravel() for _ in range(cfg.eval_batches)])
    assert m["eval_bytes"] == targets.size == cfg.eval_batches * cfg.batch_size * cfg.seq_len
    assert m["unigram_bits_per_byte"] == pytest.approx(lm.unigram_bits_per_byte(train, targets), abs=1e-9)
    assert m["unigram_bits_per_byte_all_held_out"] == pytest.approx(lm.unigram_bits_per_byte(train, held), abs=1e-9)


@pytest.mark.parametrize("script", ["train_lm.py", "train_superres.py"])
def test_an_out_folder_that_cannot_be_made_stops_before_training(script, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = subprocess.run([sys.executable, f"examples/{script}", "--steps", "1", "--max-bytes", "200000"][
                         : 4 if script == "train_superres.py" else None] + ["--out", str(blocker / "runs"), "--no-progress"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert f"error: --out {blocker / 'runs'}: cannot create" in out.stderr
    assert "train" not in out.stdout and "Traceback" not in out.stderr


def test_squared_relu_script_exits_1_when_a_row_fails(tmp_path):
    """examples/squared_relu.py as a check: rc 0 with every row ok; a copy with a wrong
    backward formula (3 max(x, 0) instead of 2) prints FAIL rows and exits 1."""
    source = (ROOT / "examples" / "squared_relu.py").read_text()
    good = subprocess.run([sys.executable, "examples/squared_relu.py"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert good.returncode == 0, good.stdout + good.stderr
    assert len(re.findall(r"scaled err \S+ ok$", good.stdout, re.M)) == 4
    broken = tmp_path / "broken_relu.py"
    assert source.count("2.0 * jnp.maximum") == 2
    broken.write_text(source.replace("2.0 * jnp.maximum", "3.0 * jnp.maximum"))
    bad = subprocess.run([sys.executable, str(broken)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert bad.stdout.count("FAIL") == 2 and "scaled err 5.00e-01 FAIL" in bad.stdout


def test_train_lm_weight_decay_skips_the_norm_scales():
    # With zero gradients, AdamW's update is the weight decay alone: the model's matrices
    # shrink, its RMSNorm scales (the 1-D parameters) stay as they are.
    import jax
    import jax.numpy as jnp

    lm = _example_module("train_lm")
    cfg = lm.PRESETS["tiny"]
    params = lm.LM(cfg, lm.plain_ops()).init(jax.random.key(0), jnp.zeros((1, cfg.seq_len), jnp.int32))["params"]
    opt = lm.make_optimizer(cfg)
    state = opt.init(params)
    for _ in range(cfg.warmup + 1):  # past the warmup, where the learning rate is not 0
        updates, state = opt.update(jax.tree.map(jnp.zeros_like, params), state, params)
    moved = jax.tree.map(lambda u: bool(jnp.any(u != 0)), updates)
    flat = {jax.tree_util.keystr(k): (v.ndim, moved_v) for (k, v), moved_v in
            zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(moved))}
    assert any(n == 1 for n, _ in flat.values()) and any(n >= 2 for n, _ in flat.values())
    assert all(m == (n >= 2) for n, m in flat.values()), flat


def test_train_lm_check_grads_match_plain_model(tmp_path):
    out = subprocess.run([sys.executable, "examples/train_lm.py", "--preset", "tiny", "--check", "--max-bytes", "200000"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "max relative grad difference" in out.stdout


def test_train_lm_heads_fused_and_unfused():
    """--head: the fused head runs linear_cross_entropy and no cross_entropy, the unfused
    one the reverse, and both give the same loss and gradients on a batch."""
    import jax

    lm = _example_module("train_lm")
    cfg = lm.PRESETS["tiny"]
    x = jax.random.randint(jax.random.PRNGKey(0), (2, cfg.seq_len), 0, 256)
    y = jax.random.randint(jax.random.PRNGKey(1), (2, cfg.seq_len), 0, 256)
    results = {}
    for head in ("fused", "unfused"):
        model = lm.LM(cfg, lm.jaxbwd_ops("xla", head))
        params = model.init(jax.random.PRNGKey(cfg.seed), x)["params"]
        loss = lm.make_loss(model)
        # Each jaxbwd op is one primitive named after it (jax >= 0.12: name='op'; a
        # custom_vjp_call[name=op] before).
        text = str(jax.make_jaxpr(loss)(params, x, y))
        used = lambda op: re.search(rf"name='?{op}\b", text) is not None  # noqa: E731
        assert used("linear_cross_entropy") == (head == "fused"), head
        assert used("cross_entropy") == (head == "unfused"), head
        results[head] = jax.value_and_grad(loss)(params, x, y)
    np.testing.assert_allclose(results["unfused"][0], results["fused"][0], rtol=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(results["unfused"][1]), jax.tree_util.tree_leaves(results["fused"][1])):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("implementation,axis_types", [("xla", ("explicit",)), ("pallas", ("explicit", "auto"))])
def test_train_lm_mesh_matches_single_device(tmp_path, implementation, axis_types):
    """--mesh data=4,model=2 on 8 simulated CPU devices: the same loss curve as one device.
    The single-device run is shared by the mesh runs (with Pallas, the kernels in interpret
    mode, which the example says)."""
    common = ["examples/train_lm.py", "--preset", "tiny", "--steps", "4", "--max-bytes", "200000",
              "--implementation", implementation]
    cpu = dict(os.environ, JAX_PLATFORMS="cpu")  # the 8 devices are simulated CPUs, on any host
    stdout = _run(common + ["--name", "one"], tmp_path, env=cpu)
    one = json.loads((tmp_path / "one" / "metrics.json").read_text())
    assert one["implementation"] == implementation and len(one["train_bits_per_byte"]) == 4
    if implementation == "pallas":
        assert "interpret mode" in stdout and "--preset tiny" not in stdout  # no advice to do what was done
    for axis_type in axis_types:
        name = f"mesh-{axis_type}"
        stdout = _run(common + ["--name", name, "--mesh", "data=4,model=2", "--axis-type", axis_type], tmp_path, env=cpu)
        assert f"({axis_type} axes) on 8 cpu devices" in stdout
        mesh = json.loads((tmp_path / name / "metrics.json").read_text())
        assert mesh["mesh"] == "data=4,model=2" and len(mesh["train_bits_per_byte"]) == 4
        # sums run in a different order across shards: equal to float32 rounding, not bitwise
        np.testing.assert_allclose(mesh["train_bits_per_byte"], one["train_bits_per_byte"], rtol=1e-5)


def test_train_superres_tiny_loss_goes_down(tmp_path):
    stdout = _run(["examples/train_superres.py", "--steps", "40", "--batch", "4", "--crop", "24", "--name", "sr"], tmp_path)
    m = json.loads((tmp_path / "sr" / "metrics.json").read_text())
    first, last = sum(m["train_loss"][:5]) / 5, sum(m["train_loss"][-5:]) / 5
    assert last < first, (first, last)
    assert (tmp_path / "sr" / "superres.png").stat().st_size > 10000
    assert "PSNR" in stdout and m["psnr_model"] > 15
    assert (m["steps"], m["batch"], m["crop"], m["lr"]) == (40, 4, 24, 3e-3)  # the run's settings


def test_train_superres_r1_penalty_pallas_interpret(tmp_path):
    stdout = _run(["examples/train_superres.py", "--steps", "2", "--batch", "2", "--crop", "16", "--implementation", "pallas",
                   "--r1", "1.0", "--name", "r1"], tmp_path)
    m = json.loads((tmp_path / "r1" / "metrics.json").read_text())
    assert m["implementation"] == "pallas"
    assert m["r1_gamma"] == 1.0 and len(m["r1_penalty"]) == len(m["d_loss"]) == 2
    assert all(np.isfinite(m["r1_penalty"])) and min(m["r1_penalty"]) > 0, m["r1_penalty"]
    assert "R1 penalty" in stdout


def test_r1_penalty_gradient_kernels_match_xla():
    """The R1 penalty's parameter gradient (second order through conv2d, group_norm, bias_add,
    upsample2d, residual_add) is the same on the kernel path as on the XLA path."""
    import jax
    import jax.numpy as jnp

    mod = _example_module("train_superres")
    real = jax.random.uniform(jax.random.PRNGKey(0), (2, 8, 8, 3))
    params = mod.Discriminator(channels=16, implementation="xla").init(jax.random.PRNGKey(1), real)["params"]
    grads = {}
    for impl in ("xla", "pallas"):
        disc = mod.Discriminator(channels=16, implementation=impl)
        grads[impl] = jax.jit(jax.grad(lambda p: mod.r1_penalty(disc, p, real, 1.0)))(params)
    # every parameter but the output bias (which grad_x D does not depend on) gets a gradient
    zero = {"/".join(k.key for k in path) for path, g in jax.tree_util.tree_leaves_with_path(grads["xla"])
            if float(jnp.max(jnp.abs(g))) == 0}
    assert zero == {"logits/bias"}, zero
    for a, b in zip(jax.tree.leaves(grads["xla"]), jax.tree.leaves(grads["pallas"])):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-4, atol=1e-6)
