"""Eager (un-jitted) calls: after the first calls at a shape, calling an op again, its vjp or
its jvp compiles nothing, on the XLA path and on the Pallas path. An XLA formula whose ``lax.scan`` body is a closure
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


def _repeated_calls_compile_nothing(spec, implementation: str, warmups: int):
    """Calls the op, its vjp and its jvp ``warmups`` times at its first example's shapes, then
    once more, asserting that last call compiles nothing."""
    args, kwargs = spec.examples[0].make(jax.random.PRNGKey(0), jnp.dtype("float32"))
    diff = [args[i] for i in spec.diff_argnums]
    f = spec.bind(args, kwargs, implementation=implementation)
    calls = {"forward": lambda: f(*diff), "vjp": lambda: jax.vjp(f, *diff)[1](f(*diff))}
    if FORWARD_MODE and spec.forward_mode:
        calls["jvp"] = lambda: jax.jvp(f, tuple(diff), tuple(diff))
    for name, call in calls.items():
        for _ in range(warmups):  # the first calls at this shape compile
            jax.block_until_ready(call())
        with _compiles() as count:
            jax.block_until_ready(call())
        assert count[0] == 0, f"{spec.name} {name}: {count[0]} compilations on a repeated eager call"


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_eager_calls_compile_once(spec):
    _repeated_calls_compile_nothing(spec, "xla", warmups=1)


KERNEL_SPECS = [s for s in SPECS if s.has_kernels]


@pytest.mark.parametrize("spec", KERNEL_SPECS, ids=[s.name for s in KERNEL_SPECS])
def test_eager_pallas_calls_compile_once(spec, monkeypatch):
    """The Pallas path (interpret mode here): a kernel launched outside ``jax.jit`` runs through
    a jit kept per kernel and settings (``_common.call``), so a repeated eager call compiles
    nothing (each compiled its kernels again: 0.26-1.9 s per call before); the first call of
    a fresh process is :func:`test_second_eager_call_in_a_fresh_process_compiles_nothing`'s."""
    from jaxbwd.pallas import _common as C

    cached, real = [], C._cached_launcher
    monkeypatch.setattr(C, "_cached_launcher", lambda *a: cached.append(a[0]) or real(*a))
    _repeated_calls_compile_nothing(spec, "pallas", warmups=1)
    assert cached, f"{spec.name}: no kernel launched through the cache"


_TRACED = []


def _dot_kernel(x_ref, y_ref, o_ref):
    from jaxbwd.pallas import _common as C

    _TRACED.append(jax.config.jax_default_matmul_precision)  # once per trace of the kernel body
    o_ref[...] = C.dot(x_ref[...], y_ref[...])


_dot_kernel.__module__ = "jaxbwd.pallas.test_kernel"  # the cache keys jaxbwd's own kernels only


def test_eager_pallas_launch_follows_matmul_precision():
    """The jit kept per launch (``_common.call``) traces its kernel once per setting: again
    under another ``jax.default_matmul_precision`` (f32 dots follow it), with the same key, so
    the cache never runs a TF32 kernel for 'highest'; and not at all on a repeated call."""
    from jaxbwd.pallas import _common as C

    x = jnp.ones((16, 16))
    launch = lambda: C.call(_dot_kernel, name="eager_dot_test", grid=(1,),  # noqa: E731
                            out_shape=jax.ShapeDtypeStruct((16, 16), jnp.float32), interpret=True)(x, x)
    launch()
    _TRACED.clear()  # (JAX's tracing context may change once after a process's first jit)
    launch(), launch(), launch()
    assert _TRACED in ([], [None]), _TRACED
    n = len(_TRACED)
    with jax.default_matmul_precision("highest"):
        launch(), launch()
    assert _TRACED[n:] == ["highest"], _TRACED  # (f32_dot_precision: 3xTF32 on a GPU)
    assert sum(k is not None and "eager_dot_test" in repr(k) for k in C._LAUNCHERS) == 1


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


def test_launch_keys_tell_kernels_apart():
    """Two launches share a cached jit only where their kernels and settings are the same:
    values by type and repr (0.0 and -0.0, 1 and True apart), jaxbwd's functions by code and
    closure contents; arrays, other objects and functions from outside jaxbwd are never part
    of a key (such a launch compiles per call)."""
    import functools

    import numpy as np

    from jaxbwd.pallas import _common as C

    def kernel(x_ref, o_ref, *, scale):
        o_ref[...] = x_ref[...] * scale

    def make(c, module="jaxbwd.pallas.test_kernel"):
        def body(x_ref, o_ref):
            o_ref[...] = x_ref[...] * c
        body.__module__ = module
        return body

    user = make(2.0, module=__name__)  # a user's function: its globals may change between calls
    kernel.__module__ = "jaxbwd.pallas.test_kernel"  # as if it were one of jaxbwd's kernels

    key = lambda k, **kw: C._launch_key(k, "t", (1,), jax.ShapeDtypeStruct((8,), jnp.float32), True, 4, None,  # noqa: E731
                                        0, 0, 0, None, None)
    part = lambda v: key(functools.partial(kernel, scale=v))  # noqa: E731
    assert part(2.0) == part(2.0) and part(0.0) != part(-0.0) and part(1) != part(True) and part(1) != part(1.0)
    assert key(make(2.0)) == key(make(2.0)) and key(make(2.0)) != key(make(3.0))
    assert part(np.ones(3)) is None and key(make(jnp.ones(3))) is None
    assert key(kernel) != key(make(2.0))
    assert key(user) is None and key(functools.partial(kernel, scale=object())) is None
    assert part(np.float32(2.0)) == part(np.float32(2.0)) != part(2.0)


_FRESH = """
import jax, jax.numpy as jnp
import jaxbwd
compiles = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, *a, **k: compiles.append(1) if event == "/jax/core/compile/backend_compile_duration" else None)
step = jax.jit(lambda x: (x * 2.0).sum())
x = jnp.ones((64, 128)); w = jnp.ones(128)
jax.block_until_ready(step(x))
grad = lambda: jax.grad(lambda x: jaxbwd.rms_norm(x, w, implementation="pallas").sum())(x)
with jaxbwd.config.use(interpret=True):
    jax.block_until_ready(grad())
    n = len(compiles)
    jax.block_until_ready(grad())
    second = len(compiles) - n
n = len(compiles)
jax.block_until_ready(step(x))
print("RESULT", second, len(compiles) - n, step._cache_size())
"""


def test_second_eager_call_in_a_fresh_process_compiles_nothing():
    """In a fresh process, the second eager call of an op on the Pallas path (interpret mode)
    compiles nothing, and a user's jitted function called before the op's first call is not
    compiled again after it. Pallas's interpreter imported a module on its first lowering
    that registered a JAX setting, which changed every later jit cache key (jaxbwd imports it
    up front, ``pallas/_common.py``): both compiled again."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("JAXBWD_TEST_XLA_CACHE_DIR", None)  # no persistent cache: count real compiles
    out = subprocess.run([sys.executable, "-c", _FRESH], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    second, step_compiles, step_cache = map(int, out.stdout.split("RESULT")[-1].split())
    assert (second, step_compiles, step_cache) == (0, 0, 1), (second, step_compiles, step_cache)
