"""The user-op hook: ``jaxbwd.define_op`` / ``define_elementwise``, ``jaxbwd.testing``'s
contract on the worked example ``examples/squared_relu.py``, and the command line's
``--ops module:ATTR``."""
import os
import sys

import jax
import jax.numpy as jnp
import pytest

import jaxbwd
import jaxbwd.testing
from jaxbwd import __main__ as cli
from jaxbwd import config, registry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from examples import squared_relu  # noqa: E402


class TestSquaredReluContract(jaxbwd.testing.OpContract):
    spec = squared_relu.SPEC


# define_elementwise: a derivative formula in, the XLA formula and the Pallas kernel out.
softplus = jaxbwd.define_elementwise(
    "softplus_test", lambda x: jnp.logaddexp(x, 0.0), lambda x: 1.0 / (1.0 + jnp.exp(-x)))

SOFTPLUS = registry.OpSpec(
    name="softplus_test", family="user", fn=softplus, reference=jax.nn.softplus, diff_argnums=(0,),
    static_params=(), kernels=softplus.kernels, backward="Pallas: generated elementwise kernel",
    examples=(registry.Example("7x300", lambda k, dt: ((jax.random.normal(k, (7, 300), jnp.float32).astype(dt),), {})),),
    lowering=(registry.Example("4096x4096", lambda k, d: ((jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16),), {})),),
    bad_inputs=(registry.BadInput("integer x", lambda: ((jnp.ones(3, jnp.int32),), {}), TypeError, "floating"),),
    residual_budget=lambda x: x.size * x.dtype.itemsize,
)


class TestDefineElementwiseContract(jaxbwd.testing.OpContract):
    spec = SOFTPLUS


def test_second_order_on_the_kernel_path():
    """grad of grad through the Pallas backward differentiates the XLA formula."""
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 33))
    with config.use(interpret=True):
        gg = jax.grad(lambda x: jnp.sum(jax.grad(lambda x: jnp.sum(squared_relu.squared_relu(
            x, implementation="pallas")))(x) * x))(x)
    want = jax.grad(lambda x: jnp.sum(jax.grad(lambda x: jnp.sum(squared_relu.reference(x)))(x) * x))(x)
    jaxbwd.testing.assert_close(gg, want, 1e-5)


def test_define_op_needs_kernel_names():
    with pytest.raises(ValueError, match="give kernels="):
        jaxbwd.define_op("nameless", forward=lambda x: x, backward=lambda r, d: (d,),
                         pallas_backward=lambda r, d, *, interpret: (d,))


def test_cli_takes_an_import_path(capsys):
    assert cli.main(["list", "--ops", "examples.squared_relu:SPEC", "--wide"]) == 0
    out = capsys.readouterr().out
    assert "squared_relu" in out and "squared_relu_bwd" in out
    assert cli.main(["check", "--ops", "examples.squared_relu:SPEC"]) == 0
    assert "4 checks ok, 0 failing" in capsys.readouterr().out


def test_cli_import_path_errors(capsys):
    assert cli.main(["list", "--ops", "examples.squared_relu:NOPE"]) == 2
    assert "examples.squared_relu has no attribute 'NOPE'" in capsys.readouterr().err


def test_float64_rule_spares_user_kernels():
    """jaxbwd's float32 kernels refuse float64 by name (define_elementwise's generated kernel
    among them); a define_op kernel is its author's and receives float64 as given."""
    seen = []

    def pallas_backward(res, dy, *, interpret):
        seen.append(dy.dtype)
        return (2.0 * dy,)

    double = jaxbwd.define_op("double_f64_test", forward=lambda x: 2.0 * x, backward=lambda r, d: (2.0 * d,),
                              pallas_backward=pallas_backward, kernels=("double_f64_test_bwd",))
    with jax.enable_x64(True):
        x = jnp.ones((3,), jnp.float64)
        g = jax.grad(lambda x: jnp.sum(double(x, implementation="pallas")))(x)
        with pytest.raises(TypeError, match="softplus_test: implementation='pallas' has no float64 kernels"):
            softplus(x, implementation="pallas")
    assert seen == [jnp.float64] and g.dtype == jnp.float64


@pytest.mark.parametrize("backward", [lambda r, d: (r[1] * d,), lambda r, d: (r[1] * d, r[0] * d, d)],
                         ids=["too-few", "too-many"])
def test_backward_with_the_wrong_number_of_cotangents_is_an_error(backward):
    # A missing cotangent would otherwise leave that argument's gradient at zero.
    op = jaxbwd.define_op("mul_count_test", forward=lambda x, w: x * w, backward=backward)
    x = jnp.arange(6.0).reshape(2, 3)
    with pytest.raises(TypeError, match=r"mul_count_test: backward returned|Custom VJP bwd rule must produce"):
        jax.grad(lambda x, w: jnp.sum(op(x, w)), (0, 1))(x, x + 1)
