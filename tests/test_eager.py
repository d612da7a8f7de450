"""Eager (un-jitted) calls: after the first call at a shape, calling an op again, its vjp or
its jvp compiles nothing on the XLA path. An XLA formula whose ``lax.scan`` body is a closure
made per call misses JAX's scan cache and recompiles on every call (attention and
linear_cross_entropy did: 1-2 compiles and 90-230 ms per eager call at test sizes)."""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import pytest

from jaxbwd import registry
from jaxbwd.vjp._derivatives import FORWARD_MODE

SPECS = registry.ops()


@contextlib.contextmanager
def _compiles():
    """Counts XLA compilations (JAX's own event) while the block runs."""
    count = [0]

    def listen(event, *_, **__):
        if event == "/jax/core/compile/backend_compile_duration":
            count[0] += 1

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield count
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_eager_calls_compile_once(spec):
    args, kwargs = spec.examples[0].make(jax.random.PRNGKey(0), jnp.dtype("float32"))
    diff = [args[i] for i in spec.diff_argnums]
    f = spec.bind(args, kwargs, implementation="xla")
    calls = {"forward": lambda: f(*diff), "vjp": lambda: jax.vjp(f, *diff)[1](f(*diff))}
    if FORWARD_MODE and spec.forward_mode:
        calls["jvp"] = lambda: jax.jvp(f, tuple(diff), tuple(diff))
    for name, call in calls.items():
        jax.block_until_ready(call())  # the first call at this shape compiles
        with _compiles() as count:
            jax.block_until_ready(call())
        assert count[0] == 0, f"{spec.name} {name}: {count[0]} compilations on a repeated eager call"


def test_block_settings_changed_after_a_call_take_effect(monkeypatch):
    """The cached jits take attention's key block and linear_cross_entropy's chunk width as
    static arguments read at each call: a setting changed after a call at the same shapes
    is traced with (a cache keyed without it would run the old blocks)."""
    import jaxbwd
    from jaxbwd.vjp import attention as A
    from jaxbwd.vjp import linear_cross_entropy as L

    seen = []

    def record(fn, arg):
        def wrapped(*a):
            seen.append(a[arg])
            return fn(*a)
        return wrapped

    q = jnp.ones((1, 64, 2, 16))
    jaxbwd.dot_product_attention(q, q, q, is_causal=True, implementation="xla")
    monkeypatch.setattr(A, "_xla_blocks", record(A._xla_blocks, 1))
    monkeypatch.setattr(A, "XLA_BLOCK", 16)
    jaxbwd.dot_product_attention(q, q, q, is_causal=True, implementation="xla")
    assert seen == [16]

    seen.clear()
    x, w, lab = jnp.ones((8, 16)), jnp.ones((16, 64)), jnp.zeros((8,), jnp.int32)
    jaxbwd.linear_cross_entropy(x, w, lab, implementation="xla")
    monkeypatch.setattr(L, "_chunk", record(L._chunk, 4))
    with L.chunk_size(16):
        jaxbwd.linear_cross_entropy(x, w, lab, implementation="xla")
    assert seen == [16]
