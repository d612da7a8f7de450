"""The bench's baselines (``jaxbwd.baselines``) compute the op's function: value and
gradients equal the reference's in float32 on every registry example they support, they take
every option the bench's inputs use, and they keep 16-bit inputs in 16 bits."""
from __future__ import annotations

import inspect

import chex
import jax
import jax.numpy as jnp
import pytest

from jaxbwd import baselines, bench, registry

SPECS = [s for s in registry.ops() if s.baseline is not None]
CASES = [(s, e) for s in SPECS for e in s.examples]


def _close(actual, desired):
    """float32 rounding, absolute error scaled by each array's largest value (a summed
    gradient near 0 loses the digits of its largest terms)."""
    chex.assert_trees_all_equal_shapes_and_dtypes(actual, desired)
    for a, d in zip(jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(desired)):
        chex.assert_trees_all_close(a, d, rtol=2e-5, atol=2e-6 * max(1.0, float(jnp.max(jnp.abs(d)))))


def _diff(spec, args):
    return [args[i] for i in spec.diff_argnums]


@pytest.mark.parametrize("spec,example", CASES, ids=[f"{s.name}-{e.name}" for s, e in CASES])
def test_baseline_equals_the_reference_in_float32(spec, example):
    args, kwargs = example.make(jax.random.PRNGKey(0), jnp.dtype("float32"))
    diff = _diff(spec, args)
    base = spec.bind(args, kwargs, spec.baseline)
    try:
        jax.eval_shape(base, *diff)
    except baselines.Unsupported as e:  # the bench measures the reference instead, and says so
        assert spec.name in str(e)
        assert bench.baseline_fn(spec, list(args), kwargs) == (spec.reference, "jaxbwd.reference")
        return
    ref = spec.bind(args, kwargs, spec.reference)
    out_b, vjp_b = jax.vjp(base, *diff)
    out_r, vjp_r = jax.vjp(ref, *diff)
    _close(out_b, out_r)
    ct = jax.random.normal(jax.random.PRNGKey(1), out_r.shape, out_r.dtype)
    _close(vjp_b(ct), vjp_r(ct))


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
@pytest.mark.parametrize("size", ["small", "llm"])
def test_bench_measures_the_library_call_at_both_sizes(spec, size):
    """The bench's inputs use options the library has: its rows name the library call."""
    for name, ex in spec.bench:
        if name == size:
            args, kwargs = ex.make(jax.random.PRNGKey(0), jnp.dtype("bfloat16"))
            break
    else:
        example = (spec.lowering or spec.examples)[0] if size == "llm" else spec.examples[0]
        args, kwargs = example.make(jax.random.PRNGKey(0), jnp.dtype("float32"))
    if spec.baseline.calls.startswith("flax"):
        pytest.importorskip("flax")
    _, name = bench.baseline_fn(spec, list(args), kwargs)
    assert name == spec.baseline.calls


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_baseline_keeps_bfloat16_inputs_in_bfloat16(spec):
    """The op's output dtype, and no float32 copy of a 16-bit input kept for the backward
    (which would overstate what 16-bit jnp code costs). flax's norms compute their
    statistics in float32 and may keep float32 arrays: that is what flax costs."""
    if spec.baseline.calls.startswith("flax"):
        pytest.importorskip("flax")
    args, kwargs = spec.examples[0].make(jax.random.PRNGKey(0), jnp.dtype("bfloat16"))
    diff = _diff(spec, args)
    out, vjp = jax.vjp(spec.bind(args, kwargs, spec.baseline), *diff)
    assert out.dtype == spec.bind(args, kwargs)(*diff).dtype == jnp.bfloat16
    if not spec.baseline.calls.startswith("flax"):
        saved = [x for x in jax.tree_util.tree_leaves(vjp) if hasattr(x, "dtype")]
        assert not [x for x in saved if x.dtype == jnp.float32 and x.size >= diff[0].size], \
            [(x.dtype, x.shape) for x in saved]


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_baseline_takes_every_argument_of_the_op(spec):
    """An option the library has no counterpart for must raise Unsupported (the bench then
    falls back), never a TypeError that stops the bench."""
    op = [p for p in inspect.signature(spec.fn).parameters if p != "implementation"]
    base = list(inspect.signature(spec.baseline).parameters)
    assert base[:len(op)] == op, (op, base)


def _normal(i, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.PRNGKey(i), shape, dtype)


_QKV = (_normal(0, (2, 12, 4, 16)), _normal(1, (2, 12, 2, 16)), _normal(2, (2, 12, 2, 16)))
OPTION_CASES = [
    ("dot_product_attention", _QKV, {"bias": _normal(3, (2, 1, 12, 12))}),
    ("dot_product_attention", _QKV, {"mask": _normal(4, (12, 12)) > -1.0, "is_causal": True}),
    ("dot_product_attention", _QKV, {"query_seq_lengths": jnp.array([12, 7]),
                                     "key_value_seq_lengths": jnp.array([9, 12])}),
    ("dot_product_attention", _QKV, {"local_window_size": (3, 1)}),
    ("dot_product_attention", _QKV, {"sliding_window": 4}),
    ("dot_product_attention", _QKV, {"segment_ids": (jnp.array([[0] * 6 + [1] * 6] * 2),) * 2}),
    ("dot_product_attention", tuple(a[0] for a in _QKV), {"segment_ids": jnp.array([0] * 5 + [1] * 7)}),
    ("batch_norm", (_normal(5, (4, 3, 8)), _normal(6, (8,)), _normal(7, (8,))),
     {"running_mean": _normal(8, (8,)), "running_var": jnp.exp(_normal(9, (8,))), "momentum": 0.9}),
    ("batch_norm", (_normal(5, (4, 3, 8)), _normal(6, (8,)), _normal(7, (8,))),
     {"running_mean": _normal(8, (8,)), "running_var": jnp.exp(_normal(9, (8,))), "training": False}),
    ("cross_entropy", (_normal(10, (6, 37)), jnp.arange(6)), {"axis": 1}),
]


@pytest.mark.parametrize("name,args,kwargs", OPTION_CASES, ids=[f"{c[0]}-{'-'.join(c[2])}" for c in OPTION_CASES])
def test_baseline_options_compute_what_the_op_computes(name, args, kwargs):
    """Options beyond the registry's examples: the baseline against the op's XLA path."""
    spec = registry.get(name)
    if spec.baseline.calls.startswith("flax"):
        pytest.importorskip("flax")
    _close(spec.baseline(*args, **kwargs), spec.fn(*args, **kwargs, implementation="xla"))


def test_options_without_a_counterpart_fall_back_to_the_reference():
    logits = _normal(11, (6, 37))
    kwargs = {"where": jnp.ones((6, 37), bool)}
    spec = registry.get("cross_entropy")
    with pytest.raises(baselines.Unsupported, match=r"cross_entropy: where=an array of shape \(6, 37\)"):
        spec.baseline(logits, jnp.arange(6), **kwargs)
    assert bench.baseline_fn(spec, [logits, jnp.arange(6)], kwargs)[1] == "jaxbwd.reference"


def test_a_reference_row_says_so():
    """A bench row whose options have no library counterpart (here a softcap) measures the
    reference, names it, and is marked * in the table."""
    import dataclasses

    spec = registry.get("dot_product_attention")
    capped = dataclasses.replace(spec, examples=tuple(e for e in spec.examples if "cap" in e.name))
    row = bench.bench_op(capped, "small", "xla", copy_gb_s=0.0, repeats=1)
    assert row.baseline == "jaxbwd.reference"
    plain = bench.bench_op(spec, "small", "xla", copy_gb_s=0.0, repeats=1)
    assert plain.baseline == spec.baseline.calls
    report = {"size": "small", "device": "cpu", "backend": "cpu", "jax": jax.__version__, "date": "-",
              "copy_gb_s": 1.0, "rows": [dataclasses.asdict(row), dataclasses.asdict(plain)]}
    names = [line.split()[0] for line in bench.format_table(report).splitlines() if "  xla  " in line]
    assert names == ["dot_product_attention*", "dot_product_attention"]


def test_without_flax_the_norms_fall_back_to_the_reference(monkeypatch):
    def missing(op):
        raise baselines.Unsupported(f"baseline of {op}: flax is not installed")

    monkeypatch.setattr(baselines, "_flax_linen", missing)
    spec = registry.get("rms_norm")
    args, kwargs = spec.examples[0].make(jax.random.PRNGKey(0), jnp.dtype("float32"))
    assert bench.baseline_fn(spec, list(args), kwargs) == (spec.reference, "jaxbwd.reference")
