"""``jax.export`` of the ops: with static shapes on both implementations, and with a symbolic
batch (shape polymorphism) on the XLA formulas, where a kernel cannot go (its grid is fixed
when it is lowered): under the default or settings-chosen implementation the ops take XLA
there, and naming ``"pallas"`` in the call is a ValueError naming the op."""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import pytest
from jax import export

import jaxbwd
from jaxbwd import config

f32, i32 = jnp.float32, jnp.int32
KEY = jax.random.key(0)

# (name, fn(*args, impl), shapes with "b" for the symbolic batch); embed (symbolic ids) below
CASES = [
    ("rms_norm", lambda x, w, impl: jaxbwd.rms_norm(x, w, implementation=impl), [("b", 16), (16,)]),
    ("layer_norm", lambda x, w, c, impl: jaxbwd.layer_norm(x, w, c, implementation=impl), [("b", 16), (16,), (16,)]),
    ("softmax", lambda x, impl: jaxbwd.softmax(x, implementation=impl), [("b", 16)]),
    ("gelu", lambda x, impl: jaxbwd.gelu(x, implementation=impl), [("b", 16)]),
    ("swiglu", lambda g, u, impl: jaxbwd.swiglu(g, u, implementation=impl), [("b", 16), ("b", 16)]),
    ("bias_add", lambda x, c, impl: jaxbwd.bias_add(x, c, implementation=impl), [("b", 16), (16,)]),
    ("cross_entropy", lambda x, impl: jaxbwd.cross_entropy(x, jnp.arange(x.shape[0]) % 16, implementation=impl),
     [("b", 16)]),
    ("rope", lambda x, impl: jaxbwd.rope(x, implementation=impl), [("b", 8, 2, 16)]),
    ("dot_product_attention", lambda q, impl: jaxbwd.dot_product_attention(q, q, q, is_causal=True,
                                                                           implementation=impl), [("b", 8, 2, 16)]),
    ("dot_product_attention/seq", lambda q, impl: jaxbwd.dot_product_attention(q, q, q, is_causal=True,
                                                                               implementation=impl), [(1, "b", 2, 16)]),
    ("conv2d", lambda x, w, impl: jaxbwd.conv2d(x, w, implementation=impl), [("b", 6, 6, 4), (3, 3, 4, 4)]),
    ("group_norm", lambda x, w, c, impl: jaxbwd.group_norm(x, w, c, num_groups=2, implementation=impl),
     [("b", 4, 4, 4), (4,), (4,)]),
    ("max_pool2d", lambda x, impl: jaxbwd.max_pool2d(x, (2, 2), implementation=impl), [("b", 4, 4, 4)]),
    ("batch_norm", lambda x, w, c, impl: jaxbwd.batch_norm(x, w, c, implementation=impl)[0], [("b", 4), (4,), (4,)]),
    ("dropout/deterministic", lambda x, impl: jaxbwd.dropout(x, 0.5, deterministic=True, implementation=impl),
     [("b", 16)]),
    ("mse_loss", lambda p, q, impl: jaxbwd.mse_loss(p, q, implementation=impl), [("b", 16), ("b", 16)]),
    ("reshape", lambda x, impl: jaxbwd.reshape(x, (x.shape[0], 4, 4), implementation=impl), [("b", 16)]),
    ("reshape/-1", lambda x, impl: jaxbwd.reshape(x, (-1, 4, 4), implementation=impl), [("b", 16)]),
]
NO_KERNELS = ("dropout/deterministic", "mse_loss", "reshape", "reshape/-1")  # "pallas" runs XLA anyway
IDS = [c[0] for c in CASES]


def _specs(shapes):
    b, = export.symbolic_shape("b")
    return [jax.ShapeDtypeStruct(tuple(b if d == "b" else d for d in s), f32) for s in shapes]


def _args(shapes, batch, seed=0):
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return [jax.random.normal(k, tuple(batch if d == "b" else d for d in s), f32) for k, s in zip(keys, shapes)]


def _loss(fn, impl):
    return lambda *a: jnp.sum(jnp.sin(fn(*a, impl)))  # a cotangent that is not all ones


@pytest.mark.parametrize("name,fn,shapes", CASES, ids=IDS)
def test_symbolic_batch_exports_the_xla_formulas(name, fn, shapes):
    # Exported once with a symbolic batch, called at two batch sizes: values and gradients
    # (through the exported VJP) equal the op's own.
    loss = _loss(fn, "xla")
    exp = export.export(jax.jit(loss))(*_specs(shapes))
    for batch in (3, 5):
        args = _args(shapes, batch)
        chex.assert_trees_all_close(exp.call(*args), loss(*args), rtol=1e-5, atol=1e-6)
        argnums = tuple(range(len(args)))
        chex.assert_trees_all_close(jax.grad(exp.call, argnums)(*args), jax.grad(loss, argnums)(*args),
                                    rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name,fn,shapes", CASES, ids=IDS)
def test_symbolic_batch_under_pallas_settings_takes_xla(name, fn, shapes):
    # Pallas chosen by the settings (as on a GPU by default): the op exports on the XLA
    # formulas instead of failing inside a kernel's tiling, backward included.
    loss = _loss(fn, None)
    with config.use(implementation="pallas"):
        exp = export.export(jax.jit(loss))(*_specs(shapes))
        exp.vjp()
        jaxpr = str(jax.make_jaxpr(jax.grad(loss, tuple(range(len(shapes)))))(*_specs(shapes)))
    assert "pallas_call" not in jaxpr
    args = _args(shapes, 3)
    chex.assert_trees_all_close(exp.call(*args), _loss(fn, "xla")(*args), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name,fn,shapes", [c for c in CASES if c[0] not in NO_KERNELS],
                         ids=[i for i in IDS if i not in NO_KERNELS])
def test_symbolic_shape_with_pallas_named_is_an_error_naming_the_op(name, fn, shapes):
    op = name.split("/")[0]
    with pytest.raises(ValueError, match=rf"jaxbwd.{op}: implementation='pallas' needs static shapes"):
        export.export(jax.jit(jax.grad(_loss(fn, "pallas"))))(*_specs(shapes))


def test_embed_with_symbolic_ids():
    b, = export.symbolic_shape("b")
    loss = lambda t, ids, impl: jnp.sum(jnp.sin(jaxbwd.embed(ids, t, implementation=impl)))
    specs = (jax.ShapeDtypeStruct((16, 8), f32), jax.ShapeDtypeStruct((b,), i32))
    exp = export.export(jax.jit(jax.grad(lambda t, ids: loss(t, ids, "xla"))))(*specs)
    t, ids = _args([(16, 8)], 1)[0], jnp.array([1, 5, 1, 0], i32)
    chex.assert_trees_all_close(exp.call(t, ids), jax.grad(loss)(t, ids, "xla"), rtol=1e-6)
    with pytest.raises(ValueError, match="jaxbwd.embed: implementation='pallas' needs static shapes"):
        export.export(jax.jit(jax.grad(lambda t, ids: loss(t, ids, "pallas"))))(*specs)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_static_shapes_export_both_implementations(impl):
    # With static shapes the kernels export too (interpret mode here: the exported module
    # runs on CPU), forward and the exported VJP.
    fn = lambda x, w: jnp.sum(jnp.sin(jaxbwd.rms_norm(x, w, implementation=impl)))
    x, w = _args([(4, 16), (16,)], 4)
    exp = export.export(jax.jit(fn))(x, w)
    chex.assert_trees_all_close(exp.call(x, w), fn(x, w), rtol=1e-6)
    chex.assert_trees_all_close(jax.grad(exp.call, (0, 1))(x, w), jax.grad(fn, (0, 1))(x, w), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op", ["dropout", "bias_dropout_add", "linear_cross_entropy", "row_slice"])
def test_ops_that_need_static_shapes_say_so(op):
    # The XLA formulas of these ops are sized from the shapes (a mask hashed on a static 2-D
    # view; token chunks; a window checked against the rows), so a symbolic batch is refused
    # by name, not deep inside JAX.
    b, = export.symbolic_shape("b")
    x = jax.ShapeDtypeStruct((b, 16), f32)
    fns = {
        "dropout": lambda x: jaxbwd.dropout(x, 0.5, rng=KEY, implementation="xla"),
        "bias_dropout_add": lambda x: jaxbwd.bias_dropout_add(x, jnp.ones(16), x, 0.5, rng=KEY, implementation="xla"),
        "linear_cross_entropy": lambda x: jaxbwd.linear_cross_entropy(x, jnp.ones((16, 32)), jnp.zeros(x.shape[0], i32),
                                                                      implementation="xla"),
        "row_slice": lambda x: jaxbwd.row_slice(x, 0, 1, implementation="xla"),
    }
    what = r"x's row count must be static, got \(b,\)" if op == "row_slice" else r"x's shape must be static, got \(b, 16\)"
    with pytest.raises(ValueError, match=rf"jaxbwd.{op}: {what} \(symbolic\)"):
        export.export(jax.jit(fns[op]))(x)


def test_bias_dropout_add_deterministic_exports_with_a_symbolic_batch():
    b, = export.symbolic_shape("b")
    x = jax.ShapeDtypeStruct((b, 16), f32)
    fn = lambda x, c: jaxbwd.bias_dropout_add(x, c, x, 0.5, deterministic=True, implementation="xla")
    exp = export.export(jax.jit(fn))(x, jax.ShapeDtypeStruct((16,), f32))
    xv, c = _args([(3, 16), (16,)], 3)
    chex.assert_trees_all_close(exp.call(xv, c), 2 * xv + c, rtol=1e-6)
