"""The README's derivatives example runs as written and gives the plain-JAX model's numbers."""
from __future__ import annotations

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxbwd
from jaxbwd.vjp._derivatives import FORWARD_MODE

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
pytestmark = pytest.mark.skipif(not FORWARD_MODE, reason="forward mode needs jax >= 0.12 (README says so)")


def _derivatives_example() -> str:
    text = README.read_text()
    start = text.index("Example (run by `tests/test_readme.py`)")
    return re.search(r"```python\n(.*?)```", text[start:], re.S).group(1)


def _plain_lm_loss(params, tokens):
    x = params["embed"][tokens[:, :-1]]
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * params["norm"]
    logp = jax.nn.log_softmax(x @ params["embed"].T)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_readme_derivatives_example(implementation):
    scope = {}
    with jaxbwd.config.use(implementation=implementation):
        exec(compile(_derivatives_example(), str(README), "exec"), scope)
    params, tokens, v, x, t = (scope[k] for k in ("params", "tokens", "v", "x", "t"))
    grads, hvp = jax.jvp(lambda p: jax.grad(_plain_lm_loss)(p, tokens), (params,), (v,))
    for got, want in ((scope["grads"], grads), (scope["hvp"], hvp)):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=1e-6)
    assert float(jnp.max(jnp.abs(hvp["embed"]))) > 0

    def velocity(x, t):
        h = x * (1.0 + t[:, None, None, None])
        return jax.nn.dot_product_attention(h, h, h, is_causal=True, implementation="xla")

    u, du_dt = jax.jvp(velocity, (x, t), (x, jnp.ones_like(t)))
    np.testing.assert_allclose(np.asarray(scope["u"]), np.asarray(u), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(scope["du_dt"]), np.asarray(du_dt), rtol=1e-4, atol=1e-5)


def test_readme_op_table_is_the_registry():
    """The README's op table says what ``python -m jaxbwd list`` prints: the same ops in the
    same order, with the same differentiable arguments, static params, kernels and backward."""
    from jaxbwd import registry
    from jaxbwd.__main__ import _diff_names

    text = README.read_text()
    table = text[text.index("## Ops"):]
    table = table[:table.index("\n\n", table.index("| op |"))]
    rows = [[c.strip() for c in line.strip().strip("|").split(" | ")] for line in table.splitlines()
            if line.startswith("| `")]
    want = [[f"`{s.name}`", ", ".join(_diff_names(s)), ", ".join(s.static_params) or "-",
             ", ".join(f"`{k}`" for k in s.kernels) or "- (XLA by design)", s.backward]
            for s in registry.ops() if s.family != "user"]  # not ops a test loaded through the CLI
    assert [r[0] for r in rows] == [w[0] for w in want]
    for got, exp in zip(rows, want):
        assert got == exp, f"README row {got[0]} differs from the registry"
