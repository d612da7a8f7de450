"""The bench's baselines (``jaxbwd.baselines``) compute the op's function: value and
gradients equal the reference's in float32 on every registry example they support, they take
every option the bench's inputs use, and they keep 16-bit inputs in 16 bits."""
from __future__ import annotations

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


def test_a_reference_row_says_so():
    """Options without a library counterpart (here a softcap) fall back to the reference, named in the row."""
    spec = registry.get("dot_product_attention")
    ex = next(e for e in spec.examples if "cap" in e.name)
    args, kwargs = ex.make(jax.random.PRNGKey(0), jnp.dtype("float32"))
    assert bench.baseline_fn(spec, list(args), kwargs)[1] == "jaxbwd.reference"
    row = bench.bench_op(spec, "small", "xla", copy_gb_s=0.0, repeats=1)
    assert row.baseline == spec.baseline.calls
    report = {"size": "small", "device": "cpu", "backend": "cpu", "jax": jax.__version__, "date": "-",
              "copy_gb_s": 1.0, "rows": [dict(row.__dict__, baseline="jaxbwd.reference")]}
    assert "dot_product_attention*" in bench.format_table(report)
