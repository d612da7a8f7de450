"""Dispatch, config and the light ops' own cases; norm kernel paths the contract's shapes miss."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxbwd
from jaxbwd import config, reference
from jaxbwd.pallas import _common as C
from jaxbwd.pallas import _tuning


def test_config_context_manager_restores_and_validates():
    before = (config.default_implementation(), config.interpret())
    with config.use(implementation="pallas", interpret=False):
        assert config.default_implementation() == "pallas" and not config.interpret()
        with config.use(implementation="xla"):
            assert config.default_implementation() == "xla" and not config.interpret()
    assert (config.default_implementation(), config.interpret()) == before
    with pytest.raises(ValueError, match=r"config.use: implementation must be None, 'auto', 'pallas', 'xla', "
                                         r"'pallas:triton' or 'pallas:mosaic', got 'triton'"):
        with config.use(implementation="triton"):
            pass
    # a string would read as True ("no" turning interpret mode on): only booleans
    for name in ("interpret", "custom_partitioning"):
        with pytest.raises(TypeError, match=rf"jaxbwd.config.use: {name} must be True or False, got 'no'"):
            with config.use(**{name: "no"}):
                pass
        with pytest.raises(TypeError, match=rf"jaxbwd.config.set_default: {name} must be True or False, got 0"):
            config.set_default(**{name: 0})
    with config.use(custom_partitioning=False, interpret=np.bool_(True)):
        assert not config.custom_partitioning() and config.interpret()
    assert config.custom_partitioning()


def test_one_implementation_vocabulary_everywhere():
    # An op's argument, config.use, config.set_default and JAXBWD_IMPLEMENTATION take the same
    # values: "auto" per call is the default; "pallas:<backend>" in the settings is "pallas"
    # with that backend, and a pallas_backend that names another is refused.
    x = jnp.linspace(-2.0, 2.0, 6)
    chex.assert_trees_all_equal(jaxbwd.relu(x, implementation="auto"), jaxbwd.relu(x))
    assert config.resolve("auto", "relu") == config.default_implementation()
    q = jnp.ones((1, 4, 1, 272))  # a head dim past the kernels': "auto" falls back as None does
    with config.use(implementation="pallas"):
        assert jaxbwd.dot_product_attention(q, q, q, implementation="auto").shape == q.shape
        with pytest.raises(ValueError, match=r"head dim H must be <= 256 for the Pallas kernels, got H=272"):
            jaxbwd.dot_product_attention(q, q, q, implementation="pallas")
    with config.use(implementation="pallas:mosaic"):
        assert (config.default_implementation(), config.pallas_backend()) == ("pallas", "mosaic")
        with config.use(implementation="xla"):  # the backend stays as the outer block set it
            assert (config.default_implementation(), config.pallas_backend()) == ("xla", "mosaic")
    with config.use(implementation="pallas:triton", pallas_backend="triton"):
        assert config.pallas_backend() == "triton"
    for unset in (None, "auto"):  # no backend named: the implementation's, as JAXBWD_PALLAS_BACKEND=auto
        with config.use(implementation="pallas:mosaic", pallas_backend=unset):
            assert config.pallas_backend() == "mosaic"
    with pytest.raises(ValueError, match=r"^jaxbwd.config.use: implementation 'pallas:mosaic' and pallas_backend "
                                         r"'triton' name different Pallas backends$"):
        with config.use(implementation="pallas:mosaic", pallas_backend="triton"):
            pass
    for bad in (3, b"xla"):
        for call in (lambda: config.set_default(implementation=bad), lambda: jaxbwd.relu(x, implementation=bad)):
            with pytest.raises(TypeError, match=r"implementation must be a string or None \(None, 'auto', "):
                call()
    code = "from jaxbwd import config; print(config.default_implementation(), config.pallas_backend())"
    env = dict(os.environ, JAXBWD_IMPLEMENTATION="pallas:mosaic")
    env.pop("JAXBWD_PALLAS_BACKEND", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["pallas", "mosaic"]
    env["JAXBWD_PALLAS_BACKEND"] = "triton"
    bad = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and ("JAXBWD_IMPLEMENTATION=pallas:mosaic and JAXBWD_PALLAS_BACKEND=triton name "
                                    "different Pallas backends") in bad.stderr
    env = dict(os.environ, JAXBWD_IMPLEMENTATION="cuda")
    bad = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and ("JAXBWD_IMPLEMENTATION must be one of auto, none, pallas, xla, pallas:triton, "
                                    "pallas:mosaic or unset, got 'cuda'") in bad.stderr


def test_set_default_inside_use_changes_only_what_it_names():
    # The block's own settings must not become the process-wide default: set_default merges
    # into the defaults, and the block keeps its settings until it exits.
    before = (config.default_implementation(), config.interpret(), config.pallas_backend())
    try:
        with config.use(implementation="pallas", interpret=True):
            config.set_default(pallas_backend="mosaic")
            assert (config.default_implementation(), config.interpret(), config.pallas_backend()) == (
                "pallas", True, before[2])
        assert (config.default_implementation(), config.interpret(), config.pallas_backend()) == (
            before[0], before[1], "mosaic")
    finally:
        config.set_default(pallas_backend=before[2])
    assert (config.default_implementation(), config.interpret(), config.pallas_backend()) == before


def test_default_is_xla_on_cpu():
    assert jax.default_backend() == "cpu"
    assert config.resolve(None, "rms_norm") == "xla"


def test_environment_variables():
    code = "from jaxbwd import config; print(config.default_implementation(), config.interpret())"
    env = dict(os.environ, JAXBWD_IMPLEMENTATION="pallas", JAXBWD_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["pallas", "True"]
    env["JAXBWD_IMPLEMENTATION"] = "bogus"
    bad = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "JAXBWD_IMPLEMENTATION must be one of" in bad.stderr
    env = dict(os.environ, JAXBWD_INTERPRET="Off")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split()[1] == "False"
    env["JAXBWD_INTERPRET"] = "maybe"
    bad = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "JAXBWD_INTERPRET must be 1/true/yes/on, 0/false/no/off or unset, got 'maybe'" in bad.stderr
    code = "from jaxbwd import config; print(config.custom_partitioning())"
    for value, want in (("0", "False"), ("", "True"), ("yes", "True")):
        env = dict(os.environ, JAXBWD_CUSTOM_PARTITIONING=value)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.split() == [want], value
    env["JAXBWD_CUSTOM_PARTITIONING"] = "auto"
    bad = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "JAXBWD_CUSTOM_PARTITIONING must be 1/true/yes/on" in bad.stderr
    env = dict(os.environ, JAXBWD_TUNING="/no/such/tuning.json")
    bad = subprocess.run([sys.executable, "-c", "import jaxbwd"], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "jaxbwd: JAXBWD_TUNING names a file that cannot be read" in bad.stderr


def test_tuning_overrides_refuse_malformed_entries(tmp_path):
    key = "attention_fwd/h64/16bit"
    cases = [  # (overrides, error, message)
        ([1, 2], TypeError, r"the overrides must be a mapping \(a JSON object\), got list"),
        ({"sm_90": [1]}, TypeError, r"sm_90's entries must be a mapping"),
        ({"sm_90": {key: 5}}, TypeError, rf"sm_90 {key} must be a mapping .* got int: 5"),
        ({"sm_90": {key: {"block_m": None}}}, ValueError, r"block_m must be an int that is a power of two, got None"),
        ({"sm_90": {key: {"block_m": "abc"}}}, ValueError, r"block_m must be an int that is a power of two, got 'abc'"),
        ({"sm_90": {key: {"block_m": 1.7}}}, ValueError, r"block_m must be an int that is a power of two, got 1.7"),
        ({"sm_90": {key: {"block_m": True}}}, ValueError, r"block_m must be an int that is a power of two, got True"),
        ({"sm_90": {key: {"block_m": -64}}}, ValueError, r"block_m must be an int that is a power of two, got -64"),
        ({"sm_90": {key: {"block_m": 48}}}, ValueError, r"block_m must be an int that is a power of two, got 48"),
        ({"sm_90": {key: {"num_stages": 0}}}, ValueError, r"num_stages must be an int >= 1, got 0"),
        ({"sm_90": {"attention_bwd_dkdv/h64/f32": {"keys_first": 1}}}, ValueError,
         r"keys_first must be true or false, got 1"),
        # A field the kernel there does not read would be ignored: refused, naming what it reads.
        ({"sm_90": {key: {"keys_first": True}}}, ValueError,
         r"keys_first not read by the kernel there \(it reads block_m, block_n, head_split, num_stages, num_warps\)"),
        ({"sm_90": {"attention_jvp": {"keys_first": True}}}, ValueError,
         r"keys_first not read by the kernel there \(it reads block_m, block_n, head_split, num_stages, num_warps\)"),
        ({"sm_90": {key: {"head_split": 3}}}, ValueError, r"head_split must be an int that is a power of two, got 3"),
        ({"sm_90": {"attention_fwd": {"block_k": 32}}}, ValueError, r"block_k not read by the kernel there"),
        ({"sm_90": {"norm_bwd/rms": {"block_n": 2048}}}, ValueError,
         r"block_n not read by the kernel there \(it reads blocks_per_sm, num_stages, num_warps\)"),
        ({"sm_90": {"group_norm_bwd": {"block_m": 8, "num_stages": 2}}}, ValueError,
         r"block_m, num_stages not read by the kernel there"),
        ({"sm_90": {"conv2d_dgrad": {"blocks_per_sm": 2}}}, ValueError, r"blocks_per_sm not read"),
        ({"sm_90": {"conv2d_wgrad/depthwise": {"block_k": 32}}}, ValueError, r"block_k not read"),
        ({"sm_90": {"atention_fwd/h64/16bit": {"block_m": 64}}}, ValueError,
         r"sm_90: no kernel 'atention_fwd/h64/16bit' in the table \(kernels: \[.*'attention_fwd'"),
        ({"sm_70": {key: {"block_m": 64}}}, ValueError, r"architecture must be one of"),
        # A variant no heuristic asks for would apply nowhere: refused with what could follow.
        ({"sm_90": {"attention_fwd/h128/bf16": {"block_m": 64}}}, ValueError,
         r"sm_90: no variant 'attention_fwd/h128/bf16' of attention_fwd \(after attention_fwd/h128/ comes "
         r"one of: f32, 16bit\)"),
        ({"sm_90": {"attention_fwd/h96": {"block_m": 64}}}, ValueError, r"sm_90: no variant .*after attention_fwd/ comes one of: h64, "),
        ({"sm_90": {"linear_cross_entropy_bwd_dw/f32/x3/table": {"block_k": 16}}}, ValueError,
         r"sm_90: no variant .*\(linear_cross_entropy_bwd_dw/f32/x3 is a whole variant: nothing follows it\)"),
        ({"sm_90": {"linear_cross_entropy_bwd_dw/f32/x4": {"block_k": 16}}}, ValueError,
         r"sm_90: no variant .*after linear_cross_entropy_bwd_dw/f32/ comes one of: x3, table"),
        ({"sm_90": {"norm_bwd/rms/c3000": {"num_warps": 8}}}, ValueError,
         r"sm_90: no variant .*comes one of: c1, c2, c4, c8, \.\.\., c"),
        ({"sm_90": {"bias_add_dbias/16bit/x3": {"num_warps": 8}}}, ValueError,
         r"sm_90: no variant .*\(bias_add_dbias/16bit is a whole variant: nothing follows it\)"),
        ({"sm_90": {"attention_fwd/h64/16bit/": {"num_warps": 8}}}, ValueError,
         r"sm_90: no variant .*\(attention_fwd/h64/16bit is a whole variant: nothing follows it\)"),
    ]
    for overrides, error, message in cases:
        with pytest.raises(error, match=r"^jaxbwd tuning: (sm_90 [a-z_/0-9]+: )?" + message):
            with _tuning.use(overrides):
                pass
    assert _tuning.arch() == "sm_90"  # without a GPU, the H200 the kernels are built for
    before = _tuning.get(key)
    with _tuning.use({"sm_90": {key: {"block_m": 32, "num_stages": 3}}}):  # a good one still applies
        assert (_tuning.get(key).block_m, _tuning.get(key).num_stages) == (32, 3)
    assert _tuning.get(key) == before
    with _tuning.use({"sm_90": {"attention_bwd_dkdv/h64/f32": {"keys_first": False}}}):
        assert not _tuning.get("attention_bwd_dkdv/h64/f32").keys_first
    assert _tuning.get("attention_bwd_dkdv/h64/f32").keys_first
    # A prefix applies to every key under it, the more specific override last.
    over = {"attention_fwd/h128": {"num_stages": 4}, "attention_fwd/h128/f32": {"num_stages": 5}}
    h64 = _tuning.get("attention_fwd/h64/16bit")
    with _tuning.use({"sm_90": over}):
        assert _tuning.get("attention_fwd/h128/16bit").num_stages == 4
        assert _tuning.get("attention_fwd/h128/f32/x3").num_stages == 5
        assert _tuning.get("attention_fwd/h64/16bit") == h64
    # Block sizes from a prefix of a 3xTF32 key are taken as they are, as from the key itself
    # (the 64 x 32 cap is for tiles the table derives from its f32 entry).
    with jax.default_matmul_precision("highest"):
        capped = _tuning.attention("attention_bwd_dq", 64, jnp.float32, 4096, 4096)
        for k in ("attention_bwd_dq", "attention_bwd_dq/h64", "attention_bwd_dq/h64/f32/x3"):
            with _tuning.use({"sm_90": {k: {"block_m": 128, "block_n": 64}}}):
                cfg = _tuning.attention("attention_bwd_dq", 64, jnp.float32, 4096, 4096)
                assert (capped.block_m, capped.block_n, cfg.block_m, cfg.block_n) == (64, 32, 128, 64), k
    # From a file: the file is named, and JSON that does not parse is a ValueError too.
    bad = tmp_path / "tuning.json"
    bad.write_text("{bad json")
    with pytest.raises(ValueError, match=rf"^jaxbwd tuning file {re.escape(str(bad))}: not valid JSON"):
        _tuning.load(str(bad))
    bad.write_text('{"sm_90": {"attention_fwd": {"block_m": 0}}}')
    with pytest.raises(ValueError, match=rf"^jaxbwd tuning file {re.escape(str(bad))}: sm_90 attention_fwd: "
                                         r"block_m must be an int that is a power of two, got 0"):
        _tuning.load(str(bad))
    env = dict(os.environ, JAXBWD_TUNING=str(bad))
    out = subprocess.run([sys.executable, "-c", "import jaxbwd"], env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "ValueError: jaxbwd: JAXBWD_TUNING: jaxbwd tuning file" in out.stderr


@pytest.mark.parametrize("arch", sorted(_tuning.TABLE))
def test_tuning_table_serves_every_request(arch, monkeypatch):
    """Every key the heuristics can ask for resolves on every architecture, and every table
    entry is a request's key or a prefix of one (an entry under a misspelt variant would never
    be used; a prefix entry may still be shadowed by more specific ones)."""
    monkeypatch.setattr(_tuning, "arch", lambda: arch)
    keys = _tuning.requests()
    for key in keys:
        assert isinstance(_tuning.get(key), _tuning.Config), key
    unreached = [k for k in _tuning.TABLE[arch] if k not in keys and not any(r.startswith(k + "/") for r in keys)]
    assert not unreached, f"{arch}: table entries no heuristic asks for: {unreached}"
    with pytest.raises(KeyError, match=r"'attention_fwd/h128/bf16' is not a launch configuration the heuristics ask"):
        _tuning.get("attention_fwd/h128/bf16")


def test_pallas_on_cpu_without_interpret_fails_clearly():
    """A kernel launch names the kernel and the op it belongs to, also a kernel outside the
    op's backward (cross_entropy's ``cross_entropy_stats``, a loss not differentiated). What
    launches no kernel still runs: a forward that is XLA's, an op whose backward is XLA by
    design."""
    x, w = jnp.ones((4, 8)), jnp.ones((8,))
    with config.use(interpret=False):
        with pytest.raises(ValueError, match=r"kernel 'rms_norm_bwd' \(of jaxbwd\.rms_norm\) .* default backend is CPU"):
            jax.grad(lambda x: jaxbwd.rms_norm(x, w, implementation="pallas").sum())(x)
        with pytest.raises(ValueError, match=r"kernel 'cross_entropy_stats' \(of jaxbwd\.cross_entropy\) was asked"):
            jaxbwd.cross_entropy(jnp.ones((4, 10)), jnp.zeros(4, jnp.int32), implementation="pallas")
        chex.assert_trees_all_close(jaxbwd.rms_norm(x, w, implementation="pallas"), jaxbwd.rms_norm(x, w), atol=1e-6)
        chex.assert_trees_all_close(jax.grad(lambda x: jaxbwd.residual_add(x, x, implementation="pallas").sum())(x),
                                    2 * jnp.ones_like(x))

def test_implementation_is_fixed_at_trace_time():
    x, w = jnp.ones((4, 8)), jnp.ones((8,))
    f = jax.jit(jax.grad(lambda x: jaxbwd.rms_norm(x, w).sum()))
    with config.use(implementation="pallas", interpret=True):
        text = str(f.trace(x).jaxpr)
    assert "rms_norm_bwd" in text
    assert "rms_norm_bwd" not in str(jax.make_jaxpr(jax.grad(lambda x: jaxbwd.rms_norm(x, w).sum()))(x))


@pytest.mark.parametrize("D", [9000, 16384 + 5])
def test_norm_kernels_column_chunk_path(D):
    """Rows wider than one chunk: one program per chunk, each re-reading the other chunks of its
    rows for the full-row sums."""
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    x = jax.random.normal(k[0], (3, D))
    w, b, dy = jax.random.normal(k[1], (D,)), jax.random.normal(k[2], (D,)), jax.random.normal(k[3], (3, D))
    assert _tuning.norm_bwd(3, D)[0].num_col_blocks > 1
    for op, refop, args in (
        (jaxbwd.rms_norm, reference.rms_norm, (x, w)),
        (jaxbwd.layer_norm, reference.layer_norm, (x, w, b)),
    ):
        got = jax.vjp(lambda *a: op(*a, implementation="pallas"), *args)[1](dy)
        want = jax.vjp(refop, *args)[1](dy)
        chex.assert_trees_all_close(got, want, atol=2e-4, rtol=1e-4)


def test_norm_kernels_small_chunks_many_rows():
    """Chunks of 128 columns (four per row, the last a tail) over row blocks shared by few
    programs: each program's partials cover several rows of its own chunk."""
    k = jax.random.split(jax.random.PRNGKey(2), 4)
    x, dy = jax.random.normal(k[0], (45, 500)), jax.random.normal(k[3], (45, 500))
    w, b = jax.random.normal(k[1], (500,)), jax.random.normal(k[2], (500,))
    tune = {"sm_90": {"norm_bwd": {"block_n": 128, "blocks_per_sm": 1}}}
    with _tuning.use(tune), pytest.MonkeyPatch.context() as mp:
        mp.setattr(C, "num_sms", lambda: 5)
        t, cfg = _tuning.norm_bwd(45, 500)
        assert t.num_col_blocks == 4 and _tuning.split(4, t.num_row_blocks, cfg) == 1
        got = jax.vjp(lambda *a: jaxbwd.layer_norm(*a, implementation="pallas"), x, w, b)[1](dy)
        got_rms = jax.vjp(lambda *a: jaxbwd.rms_norm(*a, implementation="pallas"), x, w)[1](dy)
    chex.assert_trees_all_close(got, jax.vjp(reference.layer_norm, x, w, b)[1](dy), atol=2e-4, rtol=1e-4)
    chex.assert_trees_all_close(got_rms, jax.vjp(reference.rms_norm, x, w)[1](dy), atol=2e-4, rtol=1e-4)


def test_norm_and_bias_kernels_persistent_loop(monkeypatch):
    """More row blocks than programs: each program walks several row blocks."""
    monkeypatch.setattr(C, "num_sms", lambda: 1)  # one program per column block
    k = jax.random.split(jax.random.PRNGKey(1), 4)
    x, dy = jax.random.normal(k[0], (37, 1000)), jax.random.normal(k[3], (37, 1000))
    w, b = jax.random.normal(k[1], (1000,)), jax.random.normal(k[2], (1000,))
    got = jax.vjp(lambda *a: jaxbwd.layer_norm(*a, implementation="pallas"), x, w, b)[1](dy)
    chex.assert_trees_all_close(got, jax.vjp(reference.layer_norm, x, w, b)[1](dy), atol=2e-4, rtol=1e-4)
    got = jax.vjp(lambda *a: jaxbwd.bias_add(*a, implementation="pallas"), x, b)[1](dy)
    chex.assert_trees_all_close(got[1], dy.sum(0), atol=1e-4, rtol=1e-5)


def test_rms_norm_weight_offset_is_gemma():
    x, w = jax.random.normal(jax.random.PRNGKey(0), (4, 16)), jnp.zeros((16,))
    y = jaxbwd.rms_norm(x, w, weight_offset=1.0)
    chex.assert_trees_all_close(y, x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6), atol=1e-6)


def test_row_slice_traced_start_under_jit():
    x = jnp.arange(40.0).reshape(10, 4)

    @jax.jit
    def f(x, s):
        return jax.grad(lambda x: jnp.sum(jaxbwd.row_slice(x, s, 3) ** 2))(x), jaxbwd.row_slice(x, s, 3)

    g, y = f(x, jnp.int32(2))
    np.testing.assert_array_equal(y, x[2:5])
    want = np.zeros((10, 4), np.float32)
    want[2:5] = 2 * np.asarray(x[2:5])
    np.testing.assert_array_equal(g, want)
    # A traced start past the end clamps like lax.dynamic_slice, in both passes.
    g, y = f(x, jnp.int32(9))
    np.testing.assert_array_equal(y, x[7:10])
    assert float(jnp.abs(g[:7]).sum()) == 0.0


def test_residual_add_reduces_broadcast_dims():
    a = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 5))
    b = jax.random.normal(jax.random.PRNGKey(1), (3, 1))
    ga, gb = jax.grad(lambda a, b: jnp.sum(jnp.sin(jaxbwd.residual_add(a, b))), argnums=(0, 1))(a, b)
    wa, wb = jax.grad(lambda a, b: jnp.sum(jnp.sin(a + b)), argnums=(0, 1))(a, b)
    assert gb.shape == (3, 1)
    chex.assert_trees_all_close((ga, gb), (wa, wb), atol=1e-6)


def test_matmul_bf16_accumulates_in_f32():
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 4096)).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.PRNGKey(1), (4096, 8)).astype(jnp.bfloat16)
    y = jaxbwd.matmul(x, w)
    assert y.dtype == jnp.bfloat16
    exact = x.astype(jnp.float32) @ w.astype(jnp.float32)
    assert float(jnp.max(jnp.abs(y.astype(jnp.float32) - exact) / (jnp.abs(exact) + 1))) < 2e-2


def test_cli_list_and_check_run():
    out = subprocess.run([sys.executable, "-m", "jaxbwd", "list"], capture_output=True, text=True, check=True)
    assert "rms_norm_bwd" in out.stdout and "XLA by design" in out.stdout
    out = subprocess.run(
        [sys.executable, "-m", "jaxbwd", "check", "--ops", "rms_norm", "bias_add"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "rms_norm  pallas" in out.stdout and "FAIL" not in out.stdout
    bad = subprocess.run([sys.executable, "-m", "jaxbwd", "check", "--ops", "nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown op 'nope'" in bad.stderr


def test_set_default_is_process_wide_and_keeps_unset_fields():
    import threading

    seen = {}
    try:
        config.set_default(implementation="pallas")
        config.set_default(interpret=True)
        assert config.default_implementation() == "pallas" and config.interpret()
        t = threading.Thread(target=lambda: seen.update(impl=config.default_implementation(), interp=config.interpret()))
        t.start()
        t.join()
        assert seen == {"impl": "pallas", "interp": True}
    finally:
        config.set_default(implementation="auto", interpret=True)
    assert config.default_implementation() == "xla"  # auto on CPU


def test_jitted_function_keeps_the_implementation_it_was_traced_with():
    """What the README says of its `step`: the setting is read at trace time only."""
    x = jnp.linspace(-2.0, 2.0, 24, dtype=jnp.float32).reshape(3, 8)

    def loss(x):
        return jaxbwd.silu(x).sum()

    def has_kernel(f):
        return "pallas_call" in str(jax.make_jaxpr(f)(x))

    step = jax.jit(jax.grad(loss))
    with config.use(implementation="xla"):
        want = step(x)  # traced and compiled here, with XLA
    with config.use(implementation="pallas", interpret=True):
        assert has_kernel(jax.grad(loss))  # a function traced in the block sees its setting ...
        assert not has_kernel(step)  # ... the step traced before it keeps XLA
        assert not has_kernel(jax.jit(step.__wrapped__))  # jax caches traces per function
        fresh = jax.jit(jax.grad(loss))  # the README's remedy: a new function, traced here
        assert has_kernel(fresh)
        np.testing.assert_allclose(fresh(x), want, rtol=1e-5, atol=1e-6)
