"""jaxbwd.checkpoint_policies: JAX's dot-saving remat policies extended to the ops, which on
jax >= 0.12 are single primitives that JAX's policies do not recognise."""
from __future__ import annotations

import contextlib
import io

import chex
import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import print_saved_residuals

import jaxbwd
from jaxbwd.vjp._derivatives import FORWARD_MODE

P = jaxbwd.checkpoint_policies
CP = jax.checkpoint_policies
D, H, T = 32, 64, 16


def saved_residuals(f, *args) -> list[str]:
    """What ``jax.checkpoint``'d ``f`` saves, one line per value (``f32[16,64] output of ...``)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(f, *args)
    return out.getvalue().splitlines()


def _params(key=0):
    k = jax.random.split(jax.random.key(key), 4)
    return {"gate": jax.random.normal(k[0], (2, D, H)) * 0.1, "up": jax.random.normal(k[1], (2, D, H)) * 0.1,
            "down": jax.random.normal(k[2], (2, H, D)) * 0.1}, jax.random.normal(k[3], (2, T, D))


def _jaxbwd_layer(impl):
    mm = lambda a, b: jaxbwd.matmul(a, b, implementation=impl)
    return lambda x, p: x + mm(jaxbwd.swiglu(mm(x, p["gate"]), mm(x, p["up"]), implementation=impl), p["down"])


def _jnp_layer(x, p):
    return x + (jax.nn.silu(x @ p["gate"]) * (x @ p["up"])) @ p["down"]


def _loss(layer, policy):
    body = layer if policy is None else jax.checkpoint(layer, policy=policy)
    return lambda x, p: jnp.sum(jax.lax.scan(lambda c, q: (body(c, q), None), x, p)[0] ** 2)


def _grad_flops(layer, policy):
    p, x = _params()
    cost = jax.jit(jax.grad(_loss(layer, policy), argnums=1)).lower(x, p).compile().cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["flops"]


@pytest.mark.parametrize("name", ["dots_saveable", "dots_with_no_batch_dims_saveable"])
def test_policy_saves_the_products_jax_saves_in_plain_jnp(name):
    # The compiled gradient step of a scanned SwiGLU MLP: jaxbwd's ops under jaxbwd's policy
    # cost what the jnp model costs under JAX's policy of the same name (the products are
    # saved, not recomputed), and less than recomputing everything.
    # (Equal to a few elementwise FLOPs: the ops' f32-accumulating products differ in casts.)
    ours = _grad_flops(_jaxbwd_layer("xla"), getattr(P, name))
    assert ours == pytest.approx(_grad_flops(_jnp_layer, getattr(CP, name)), rel=1e-4)
    assert ours < 0.9 * _grad_flops(_jaxbwd_layer("xla"), CP.nothing_saveable)
    # JAX's own policy saves none of jaxbwd's products on jax >= 0.12 (the defect this fixes).
    jax_own = _grad_flops(_jaxbwd_layer("xla"), getattr(CP, name))
    assert jax_own == (_grad_flops(_jaxbwd_layer("xla"), CP.nothing_saveable) if FORWARD_MODE else ours)


def _stacked(loss, x, p):
    """The per-layer values the forward scan of ``jax.grad(loss)`` stacks for the backward."""
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=1))(x, p)
    (scan,) = [e for e in jaxpr.eqns if e.primitive.name == "scan" and not e.params["reverse"]]
    return sorted(v.aval.str_short() for v in scan.outvars if v.aval.ndim and v.aval.shape[0] == 2)


@pytest.mark.skipif(not FORWARD_MODE, reason="the ops are single primitives on jax >= 0.12 only")
@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("name", ["dots_saveable", "dots_with_no_batch_dims_saveable"])
def test_policy_in_a_scan_stacks_no_copy_of_the_weights(impl, name):
    # A scan over layers already holds every layer's weights: the policy saves what JAX's
    # saves for the jnp model (the products), not a second, stacked copy of the weights
    # that the matmuls' fwd rules pass through as residuals.
    p, x = _params()
    with jaxbwd.config.use(interpret=True):
        ours = _stacked(_loss(_jaxbwd_layer(impl), getattr(P, name)), x, p)
    assert ours == _stacked(_loss(_jnp_layer, getattr(CP, name)), x, p)
    assert not any(f"[2,{D},{H}]" in a or f"[2,{H},{D}]" in a for a in ours), ours


def test_offload_policy_offloads_the_ops_products():
    f = jax.checkpoint(_jaxbwd_layer("xla"), policy=P.offload_dot_with_no_batch_dims("device", "pinned_host"))
    p, x = _params()
    saved = saved_residuals(f, x[0], jax.tree.map(lambda a: a[0], p))
    offloaded = [line for line in saved if line.startswith("f32<host>")]
    # The gate and up products ([T, H], which the backward of swiglu needs) go to the host.
    assert sum(line.startswith(f"f32<host>[{T},{H}]") for line in offloaded) >= 2, saved


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("name", ["dots_saveable", "dots_with_no_batch_dims_saveable"])
def test_gradients_under_the_policies_equal_no_remat(impl, name):
    p, x = _params()
    q = jax.random.normal(jax.random.key(5), (1, 8, 2, 16))

    def layer(x, p):  # products, attention and a norm, so every kind of rule is saved or not
        h = _jaxbwd_layer(impl)(x, p)
        a = jaxbwd.dot_product_attention(q, q, q, is_causal=True, implementation=impl)
        return jaxbwd.rms_norm(h, jnp.ones(D), implementation=impl) + jnp.mean(a)

    want = jax.grad(_loss(layer, None), argnums=1)(x, p)
    got = jax.grad(_loss(layer, getattr(P, name)), argnums=1)(x, p)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not FORWARD_MODE, reason="save_ops needs jax >= 0.12 (tested below)")
def test_save_ops_saves_the_named_op_only():
    w = jnp.ones(D)
    f = lambda x: jnp.sum(jnp.sin(jaxbwd.rms_norm(jnp.tanh(x), w)) * jaxbwd.silu(x))
    x = jax.random.normal(jax.random.key(1), (T, D))
    named = saved_residuals(jax.checkpoint(f, policy=P.save_ops("rms_norm")), x)
    nothing = saved_residuals(jax.checkpoint(f, policy=CP.nothing_saveable), x)
    # The norm's output and its saved [T] rstd, beyond the argument.
    assert len(named) > len(nothing)
    assert any(line.startswith(f"f32[{T}] output of") for line in named), named
    chex.assert_trees_all_close(jax.grad(jax.checkpoint(f, policy=P.save_ops("rms_norm")))(x), jax.grad(f)(x),
                                rtol=1e-6)


@pytest.mark.skipif(not FORWARD_MODE, reason="save_ops needs jax >= 0.12 (tested below)")
def test_save_ops_saves_input_residuals_with_their_producers():
    # swiglu's residuals are its inputs, gate and up: saved when the matmuls that make them
    # are named too, recomputed from x when only swiglu is (as JAX's policies treat the
    # inputs of any equation), and never saved as extra copies.
    p, x = _params()
    f = lambda x, p: jnp.sum(_jaxbwd_layer("xla")(x, p))  # noqa: E731
    x0, p0 = x[0], jax.tree.map(lambda a: a[0], p)
    products = lambda policy: sum(line.startswith(f"f32[{T},{H}] output of")  # noqa: E731
                                  for line in saved_residuals(jax.checkpoint(f, policy=policy), x0, p0))
    assert products(P.save_ops("matmul", "swiglu")) == 3  # gate, up and swiglu's output
    assert products(P.save_ops("swiglu")) == 1  # its output only


def test_save_ops_needs_names_of_ops():
    with pytest.raises(TypeError, match="jaxbwd.checkpoint_policies.save_ops: op names must be strings, got 3"):
        P.save_ops("matmul", 3)
    with pytest.raises(ValueError, match="save_ops: give at least one op name"):
        P.save_ops()
    with pytest.raises(ValueError, match=r"save_ops: no op is named 'rmsnorm'; ops: .*rms_norm"):
        P.save_ops("rms_norm", "rmsnorm")
    with pytest.raises(ValueError, match=r"save_ops: no op is named 'adaptive_avg_pool2d'"):
        P.save_ops("adaptive_avg_pool2d")  # plain XLA code, no primitive of its own
    jaxbwd.define_op("policy_named_test", forward=lambda x: x, backward=lambda r, d: (d,))
    if FORWARD_MODE:
        assert P.save_ops("policy_named_test", "rms_norm").__name__ == "save_ops('policy_named_test', 'rms_norm')"
    else:
        with pytest.raises(NotImplementedError, match=r"save_ops: needs jax >= 0.12 .* jax.ad_checkpoint.checkpoint_name"):
            P.save_ops("rms_norm")
