"""The user-op hook: ``jaxbwd.define_op`` / ``define_elementwise``, ``jaxbwd.testing``'s
contract on the worked example ``examples/squared_relu.py``, and the command line's
``--ops module:ATTR``."""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxbwd
import jaxbwd.testing
from jaxbwd import __main__ as cli
from jaxbwd import config, registry
from jaxbwd.vjp._derivatives import FORWARD_MODE

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


# saves="branch": a derivative that only the sign of x determines, from one int8 per element
# (the residual budget holds it to that).
def _kinked(x):
    return jnp.where(x >= 0, 2.0 * x, -3.0 * x)


kinked = jaxbwd.define_elementwise("kinked_test", _kinked, lambda v: jnp.where(v >= 0, 2.0, -3.0), saves="branch")
KINKED = registry.OpSpec(
    name="kinked_test", family="user", fn=kinked, reference=lambda x: _kinked(x.astype(jnp.float32)).astype(x.dtype),
    diff_argnums=(0,), static_params=(), kernels=kinked.kernels, backward="Pallas: generated elementwise kernel",
    examples=(registry.Example("7x300", lambda k, dt: ((jax.random.normal(k, (7, 300), jnp.float32).astype(dt),), {})),),
    lowering=(registry.Example("4096x4096", lambda k, d: ((jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16),), {})),),
    bad_inputs=(registry.BadInput("integer x", lambda: ((jnp.ones(3, jnp.int32),), {}), TypeError, "floating"),),
    residual_budget=lambda x: x.size,
)


class TestBranchResidualContract(jaxbwd.testing.OpContract):
    spec = KINKED


# A fwd rule (what is saved) and no tangent rule: reverse mode only.
cube_fwd = jaxbwd.define_op("cube_fwd_test", forward=lambda x: x ** 3, fwd=lambda x: (x ** 3, (x * x,)),
                            backward=lambda res, dy: (3.0 * res[0] * dy,))
CUBE_FWD = cube_fwd.spec(
    reference=lambda x: x ** 3,
    examples=(registry.Example("5x7", lambda k, dt: ((jax.random.normal(k, (5, 7), jnp.float32).astype(dt),), {})),),
    residual_budget=lambda x: x.size * x.dtype.itemsize)


class TestFwdWithoutTangentContract(jaxbwd.testing.OpContract):
    """Checkpoint and scan (in the transforms) linearise the op; only jax.jvp may refuse it."""
    spec = CUBE_FWD


def test_fwd_rule_runs_on_values_outside_transformations_on_both_paths():
    # Outside jit a fwd rule sees concrete arrays (it may check them) on the kernel path as on
    # the XLA path; under jit both see tracers.
    import jax.experimental.pallas as pl

    def kernel_backward(res, dy, *, interpret):
        def k(d_ref, o_ref):
            o_ref[...] = d_ref[...] * 2

        return (pl.pallas_call(k, out_shape=jax.ShapeDtypeStruct(dy.shape, dy.dtype), interpret=interpret,
                               name="double_test")(dy),)

    def fwd(x):
        if not bool(jnp.all(jnp.isfinite(x))):
            raise ValueError("non-finite input")
        return x * 2, (x,)

    op = jaxbwd.define_op("eager_fwd_test", forward=lambda x: x * 2, fwd=fwd, backward=lambda r, d: (d * 2,),
                          pallas_backward=kernel_backward, kernels=("double_test",))
    with config.use(interpret=True):
        for impl in ("xla", "pallas"):
            g = jax.grad(lambda x: jnp.sum(op(x, implementation=impl)))(jnp.ones((4, 8)))
            np.testing.assert_array_equal(g, 2.0)


def test_op_without_forward_mode_runs_reverse_mode_under_checkpoint():
    assert not CUBE_FWD.forward_mode
    x = jnp.linspace(-2.0, 2.0, 6)
    loss = lambda x: jnp.sum(cube_fwd(x))  # noqa: E731
    for g in (jax.grad(jax.checkpoint(loss)), jax.jit(jax.grad(jax.checkpoint(
            loss, policy=jax.checkpoint_policies.nothing_saveable)))):
        jaxbwd.testing.assert_close(g(x), 3.0 * x * x, 1e-6)
    with pytest.raises(NotImplementedError, match=r"jaxbwd\.cube_fwd_test: forward-mode"):
        jax.jvp(cube_fwd, (x,), (x,))


@pytest.mark.skipif(not FORWARD_MODE, reason="jvp mode needs jax >= 0.12")
def test_bench_jvp_refuses_an_op_without_forward_mode(monkeypatch):
    from jaxbwd import bench

    monkeypatch.setattr(registry, "REGISTRY", {**registry.REGISTRY, CUBE_FWD.name: CUBE_FWD})
    with pytest.raises(ValueError, match=r"mode 'jvp' needs forward mode, which cube_fwd_test does not have"):
        bench.run([CUBE_FWD.name], size="small", implementation="xla", mode="jvp", repeats=1)


def test_check_fails_a_pallas_path_that_runs_no_named_kernel():
    from jaxbwd.check import check_op

    op = jaxbwd.define_op("fallback_test", forward=lambda x: 2.0 * x, backward=lambda r, d: (2.0 * d,),
                          pallas_backward=lambda r, d, *, interpret: (2.0 * d,), kernels=("fallback_test_bwd",))
    spec = op.spec(reference=lambda x: 2.0 * x,
                   examples=(registry.Example("4", lambda k, dt: ((jnp.ones((4,), dt),), {})),),
                   lowering=(registry.Example("4096", lambda k, d: ((jax.ShapeDtypeStruct((4096,), jnp.float32),), {})),))
    forward, grad = check_op(spec, "pallas")
    assert forward.ok and grad.max_rel == 0.0
    assert not grad.ok and grad.note == "no fallback_test_bwd in the backward"
    assert all(r.ok for r in check_op(spec, "xla"))


def _small_spec(name, forward, backward, reference):
    op = jaxbwd.define_op(name, forward=forward, backward=backward)
    return op.spec(reference=reference, examples=(registry.Example(
        "4x64", lambda k, dt: ((jax.random.normal(k, (4, 64), jnp.float32).astype(dt),), {})),))


def test_check_fails_a_wrong_gradient_of_small_scale():
    # f(x) = 1e-5 x^2 with a backward of half the true gradient (about 1e-5): the error is
    # judged against the gradient's own scale, not an absolute floor of 1.
    from jaxbwd.check import check_op

    half = _small_spec("half_grad_test", lambda x: 1e-5 * x ** 2, lambda r, d: (1e-5 * r[0] * d,),
                       lambda x: 1e-5 * x ** 2)
    forward, grad = check_op(half, "xla")
    assert forward.ok and not grad.ok and grad.max_rel == pytest.approx(0.5, rel=1e-3)
    right = _small_spec("small_grad_test", lambda x: 1e-5 * x ** 2, lambda r, d: (2e-5 * r[0] * d,),
                        lambda x: 1e-5 * x ** 2)
    assert all(r.ok for r in check_op(right, "xla"))


def test_check_reports_an_op_that_raises_and_checks_the_rest(monkeypatch):
    from jaxbwd import check as C

    bad = _small_spec("bad_shape_test", lambda x: 2 * x, lambda r, d: (d[:1],), lambda x: 2 * x)
    good = _small_spec("good_test", lambda x: 2 * x, lambda r, d: (2 * d,), lambda x: 2 * x)
    monkeypatch.setattr(registry, "ops", lambda names=None: [bad, good])
    rows = C.check(implementations=("xla",))
    assert [(r.op, r.ok) for r in rows] == [("bad_shape_test", False), ("good_test", True), ("good_test", True)]
    assert rows[0].arg == "" and rows[0].note.startswith("ValueError: jaxbwd.bad_shape_test: backward's cotangent")


def test_spec_needs_examples_and_lowering_shapes_for_kernels():
    with pytest.raises(ValueError, match=r"cube_fwd_test.spec: examples must hold at least one Example"):
        cube_fwd.spec(reference=lambda x: x ** 3, examples=())
    op = jaxbwd.define_op("lowerless_test", forward=lambda x: x, backward=lambda r, d: (d,),
                          pallas_backward=lambda r, d, *, interpret: (d,), kernels=("lowerless_test_bwd",))
    with pytest.raises(ValueError, match=r"lowerless_test.spec: an op with kernels \('lowerless_test_bwd',\) "
                                         r"needs lowering= shapes"):
        op.spec(reference=lambda x: x, examples=CUBE_FWD.examples)


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


def test_cli_refuses_two_user_ops_of_one_name(capsys, tmp_path, monkeypatch):
    # The second silently replaced the first, so `check` checked one op of two.
    (tmp_path / "dup_ops_mod.py").write_text(
        "import jax.numpy as jnp, jaxbwd\n"
        "from jaxbwd.registry import Example\n"
        "ex = [Example('4', lambda k, dt: ((jnp.ones(4, dt),), {}))]\n"
        "A = jaxbwd.define_op('dup_name_test', forward=lambda x: 2 * x, backward=lambda r, d: (2 * d,))"
        ".spec(reference=lambda x: 2 * x, examples=ex)\n"
        "B = jaxbwd.define_op('dup_name_test', forward=lambda x: 3 * x, backward=lambda r, d: (3 * d,))"
        ".spec(reference=lambda x: 3 * x, examples=ex)\n"
        "BOTH = [A, B]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(registry.LOADED_ENV, "")
    assert cli.main(["list", "--ops", "dup_ops_mod:A", "dup_ops_mod:B"]) == 2
    assert "op 'dup_name_test' from dup_ops_mod:B has the name of the op loaded from dup_ops_mod:A" in capsys.readouterr().err
    assert cli.main(["list", "--ops", "dup_ops_mod:BOTH"]) == 2
    assert "dup_ops_mod:BOTH holds 2 ops named 'dup_name_test'" in capsys.readouterr().err
    assert cli.main(["list", "--ops", "dup_ops_mod:A"]) == 0  # the same attribute again: fine
    registry.REGISTRY.pop("dup_name_test", None)
    registry._LOADED_FROM.pop("dup_name_test", None)


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
    with pytest.raises(TypeError, match=r"mul_count_test: backward returned a tuple of \d, expected a tuple of 2"):
        jax.grad(lambda x, w: jnp.sum(op(x, w)), (0, 1))(x, x + 1)


def _grad_of(op, **static):
    return lambda: jax.grad(lambda x: jnp.sum(op(x, **static)))(jnp.ones((4, 8)))


@pytest.mark.parametrize("make, static, error, message", [
    (lambda: jaxbwd.define_op("pair_out_test", forward=lambda x: (x, x), backward=lambda r, d: (d,)),
     {}, TypeError, r"jaxbwd\.pair_out_test: forward must return one array, got a tuple of 2"),
    (lambda: jaxbwd.define_op("no_res_test", forward=lambda x: 2 * x, fwd=lambda x: 2 * x,
                              backward=lambda r, d: (2 * d,)),
     {}, TypeError, r"jaxbwd\.no_res_test: fwd must return a pair \(out, res\)"),
    (lambda: jaxbwd.define_op("bare_ct_test", forward=lambda x: 2 * x, backward=lambda r, d: 2 * d),
     {}, TypeError, r"jaxbwd\.bare_ct_test: backward returned \w+, expected a tuple of 1 cotangent"),
    (lambda: jaxbwd.define_op("ct_shape_test", forward=lambda x: 2 * x, backward=lambda r, d: (d[:2],)),
     {}, ValueError, r"jaxbwd\.ct_shape_test: backward's cotangent for argument 0 has shape \(2, 8\), "
                     r"expected \(4, 8\)"),
    (lambda: jaxbwd.define_op("kwarg_test", forward=lambda x, *, alpha=1.0: alpha * x,
                              backward=lambda r, d, *, alpha=1.0: (alpha * d,)),
     {"beta": 2.0}, TypeError, r"jaxbwd\.kwarg_test: got an unexpected keyword argument 'beta'; "
                               r"the op's forward is kwarg_test\(x, \*, alpha=1\.0\)"),
    (lambda: softplus, {"beta": 2.0}, TypeError, r"jaxbwd\.softplus_test: got an unexpected keyword argument 'beta'"),
    (lambda: jaxbwd.define_elementwise("scaled_test", lambda x, a=1.0: a * x, lambda x, a=1.0: a + 0 * x),
     {"a": jnp.array(2.0)}, TypeError, r"jaxbwd\.scaled_test: static keyword arguments must be hashable"),
    (lambda: jaxbwd.define_elementwise("deriv_kw_test", lambda x, a=1.0: a * x, lambda x: 1.0 + 0 * x),
     {"a": 2.0}, TypeError, r"jaxbwd\.deriv_kw_test: got an unexpected keyword argument 'a'; "
                            r"the op's derivative is derivative\(x\)"),
    # fwd's out must be forward's: else the op's value would change under differentiation
    (lambda: jaxbwd.define_op("fwd_shape_test", forward=lambda x: 2 * x, fwd=lambda x: ((2 * x)[:2], (x,)),
                              backward=lambda r, d: (2 * d,)),
     {}, TypeError, r"jaxbwd\.fwd_shape_test: fwd's out is float32\[2, 8\], forward's is float32\[4, 8\]"),
    (lambda: jaxbwd.define_op("fwd_dtype_test", forward=lambda x: 2 * x,
                              fwd=lambda x: ((2 * x).astype(jnp.float16), (x,)), backward=lambda r, d: (2 * d,)),
     {}, TypeError, r"jaxbwd\.fwd_dtype_test: fwd's out is float16\[4, 8\], forward's is float32\[4, 8\]"),
    (lambda: jaxbwd.define_op("res_str_test", forward=lambda x: 2 * x, fwd=lambda x: (2 * x, ("x",)),
                              backward=lambda r, d: (2 * d,)),
     {}, TypeError, r"jaxbwd\.res_str_test: fwd's res must be a pytree of arrays, got a leaf of type str"),
    (lambda: jaxbwd.define_op("ct_nested_test", forward=lambda x: 2 * x, backward=lambda r, d: ((d, d),)),
     {}, TypeError, r"jaxbwd\.ct_nested_test: backward's cotangent for argument 0 must be an array or None, "
                    r"got a tuple of 2"),
    (lambda: jaxbwd.define_op("ct_int_test", forward=lambda x: 2 * x, backward=lambda r, d: (d.astype(jnp.int32),)),
     {}, TypeError, r"jaxbwd\.ct_int_test: backward's cotangent for argument 0 is int32, expected a floating"),
    # The other rules' signatures, checked when the op is called (they used to fail inside
    # the trace with a bare "unexpected keyword argument").
    (lambda: jaxbwd.define_op("bwd_kw_test", forward=lambda x, *, eps=1.0: eps * x, backward=lambda r, d: (d,)),
     {"eps": 2.0}, TypeError, r"jaxbwd\.bwd_kw_test: got an unexpected keyword argument 'eps'; "
                              r"the op's backward is backward\(r, d\)"),
    (lambda: jaxbwd.define_op("tangent_sig_test", forward=lambda x: 2 * x, fwd=lambda x: (2 * x, ()),
                              backward=lambda r, d: (2 * d,), tangent=lambda r, dx, dy: 2 * dx),
     {}, TypeError, r"jaxbwd\.tangent_sig_test: missing a required argument: 'dy'; the op's tangent is tangent"),
    (lambda: jaxbwd.define_op("pallas_sig_test", forward=lambda x: 2 * x, backward=lambda r, d: (2 * d,),
                              pallas_backward=lambda r, d: (2 * d,), kernels=("k",)),
     {}, TypeError, r"jaxbwd\.pallas_sig_test: got an unexpected keyword argument 'interpret'"),
    # define_elementwise's formulas: one floating array of x's shape.
    (lambda: jaxbwd.define_elementwise("ew_shape_test", lambda x: x * x, lambda x: jnp.stack([x, x])),
     {}, ValueError, r"jaxbwd\.ew_shape_test: derivative returned shape \(2, 4, 8\) for x of shape \(4, 8\)"),
    (lambda: jaxbwd.define_elementwise("ew_reduce_test", lambda x: jnp.sum(x, -1), lambda x: 1.0 + 0 * x),
     {}, ValueError, r"jaxbwd\.ew_reduce_test: forward returned shape \(4,\) for x of shape \(4, 8\)"),
    (lambda: jaxbwd.define_elementwise("ew_tuple_test", lambda x: (x, x), lambda x: 1.0 + 0 * x),
     {}, TypeError, r"jaxbwd\.ew_tuple_test: forward must return one array, got a tuple of 2"),
    (lambda: jaxbwd.define_elementwise("ew_bool_test", lambda x: x, lambda x: x > 0),
     {}, TypeError, r"jaxbwd\.ew_bool_test: derivative returned bool\[4, 8\], expected a floating array"),
], ids=["tuple-forward", "fwd-without-res", "backward-not-a-tuple", "cotangent-shape", "unknown-keyword",
        "elementwise-unknown-keyword", "elementwise-array-param", "elementwise-derivative-keyword",
        "fwd-out-shape", "fwd-out-dtype", "fwd-res-str", "cotangent-nested", "cotangent-int",
        "backward-keyword", "tangent-signature", "pallas-backward-interpret", "elementwise-derivative-shape",
        "elementwise-forward-reduces", "elementwise-forward-tuple", "elementwise-derivative-bool"])
def test_a_user_rule_of_the_wrong_form_fails_by_the_ops_name(make, static, error, message):
    """Mistakes in a user's rules surface as the op's own error, not as an assertion or a
    shape error deep inside JAX."""
    with pytest.raises(error, match=message):
        _grad_of(make(), **static)()


def test_an_op_without_a_kernel_takes_pallas_as_xla_with_symbolic_shapes():
    # As jaxbwd's own XLA-only ops: "pallas" for an op with no pallas_backward has no kernel
    # to run, so symbolic shapes (jax.export) do not refuse it.
    op = jaxbwd.define_op("no_kernel_export_test", forward=lambda x: 2 * x, backward=lambda r, d: (2 * d,))
    b, = jax.export.symbolic_shape("b")
    exp = jax.export.export(jax.jit(lambda x: op(x, implementation="pallas")))(jax.ShapeDtypeStruct((b, 5), jnp.float32))
    assert exp.call(jnp.ones((3, 5))).shape == (3, 5)
    with pytest.raises(ValueError, match=r"no_kernel_export_test: implementation must be None"):
        op(jnp.ones(3), implementation="cuda")


def test_cotangents_take_their_arguments_dtype():
    """A backward computing in another precision still gives jax.grad's dtype contract."""
    op = jaxbwd.define_op("f16_ct_test", forward=lambda x: 2 * x, backward=lambda r, d: ((2 * d).astype(jnp.float16),))
    g = _grad_of(op)()
    assert g.dtype == jnp.float32
    jaxbwd.testing.assert_close(g, jnp.full((4, 8), 2.0), 0.0)
    gv = jax.vmap(jax.grad(lambda x: jnp.sum(op(x))))(jnp.ones((3, 5)))
    assert gv.dtype == jnp.float32 and gv.shape == (3, 5)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(name="rms_norm"), ValueError, r"define_op\('rms_norm'\): 'rms_norm' is one of jaxbwd's own ops"),
    (dict(name="my op"), ValueError, r"define_op: name must be a Python identifier .* got 'my op'"),
    (dict(name="fwd_test", forward=None), TypeError,
     r"define_op\('fwd_test'\): forward must be callable, got NoneType"),
    (dict(name="tan_test", tangent="jvp"), TypeError,
     r"define_op\('tan_test'\): tangent must be callable or None, got str"),
    (dict(name="k_test", pallas_backward=lambda r, d, *, interpret: (d,), kernels="k_test_bwd"), TypeError,
     r"define_op\('k_test'\): kernels must be a sequence of pallas_call names"),
    (dict(name="k_none_test", pallas_backward=lambda r, d, *, interpret: (d,), kernels=None), TypeError,
     r"define_op\('k_none_test'\): kernels must be a sequence of pallas_call names \(str\), got None"),
    (dict(name="k_int_test", pallas_backward=lambda r, d, *, interpret: (d,), kernels=["k_bwd", 3]), TypeError,
     r"define_op\('k_int_test'\): kernels must be a sequence of pallas_call names \(str\), got \('k_bwd', 3\)"),
    (dict(name="sig_test", sharding="garbage"), ValueError,
     r"define_op\('sig_test'\): sharding must be a layout signature .* got 'garbage': expected one '->'"),
    (dict(name="sig_term_test", sharding="...D1->...D1"), ValueError,
     r"define_op\('sig_term_test'\): sharding .* term '...D1' is not"),
    (dict(name="sig_in_test", sharding="...D,D->...D"), ValueError,
     r"define_op\('sig_in_test'\): sharding '...D,D->...D' lays out 2 array argument\(s\), forward "
     r"sig_in_test\(x\) takes at most 1 positionally"),
    (dict(name="sig_out_test", sharding="...->...,..."), ValueError,
     r"define_op\('sig_out_test'\): sharding '...->...,...' has 2 outputs"),
], ids=["builtin-name", "not-an-identifier", "forward", "tangent", "kernels-a-string", "kernels-none",
        "kernels-not-str", "sharding-garbage",
        "sharding-term", "sharding-inputs", "sharding-outputs"])
def test_define_op_checks_its_arguments(kwargs, error, message):
    full = dict(forward=lambda x: x, backward=lambda r, d: (d,)) | kwargs
    with pytest.raises(error, match=message):
        jaxbwd.define_op(full.pop("name"), **full)


def test_define_op_takes_kernels_from_any_iterable_once():
    # a generator is read once: checking it must not leave op.kernels empty
    op = jaxbwd.define_op("k_gen_test", forward=lambda x: x, backward=lambda r, d: (d,),
                          pallas_backward=lambda r, d, *, interpret: (d,), kernels=(k for k in ["k_gen_bwd"]))
    assert op.kernels == ("k_gen_bwd",)


@pytest.mark.skipif(not FORWARD_MODE, reason="forward mode needs jax >= 0.12")
def test_tangent_rule_results_are_held_to_the_output():
    """A user's tangent rule returning another shape would give jax.jacfwd the wrong
    Jacobian; it fails by the op's name. Another float dtype is cast, as cotangents are."""
    x = jnp.linspace(-1.0, 1.0, 5)

    def make(name, tangent):
        return jaxbwd.define_op(name, forward=jax.nn.softplus, fwd=lambda x: (jax.nn.softplus(x), (jax.nn.sigmoid(x),)),
                                backward=lambda r, d: (d * r[0],), tangent=tangent)

    with pytest.raises(TypeError, match=r"jaxbwd\.tan_shape_test: tangent must return one array of the output's "
                                        r"shape, float32\[5\], got float32\[\]"):
        jax.jvp(make("tan_shape_test", lambda r, t: jnp.sum(t[0] * r[0])), (x,), (x,))
    with pytest.raises(TypeError, match=r"jaxbwd\.tan_tuple_test: tangent must return one array .* got a tuple of 1"):
        jax.jvp(make("tan_tuple_test", lambda r, t: (t[0] * r[0],)), (x,), (x,))
    op = make("tan_f16_test", lambda r, t: (t[0] * r[0]).astype(jnp.float16))
    _, t = jax.jvp(op, (x,), (jnp.ones_like(x),))
    assert t.dtype == jnp.float32
    jaxbwd.testing.assert_close(jax.jacfwd(op)(x), jax.jacrev(op)(x), 1e-3)


def test_sharding_signature_arity_is_checked_per_call():
    op = jaxbwd.define_op("sig_call_test", forward=lambda x, w=None: x if w is None else x * w,
                          backward=lambda r, d: (d, None if r[1] is None else d), sharding="...D,D->...D")
    with pytest.raises(TypeError, match=r"jaxbwd\.sig_call_test: its sharding signature '...D,D->...D' lays out "
                                        r"2 array argument\(s\), the call passed 1"):
        op(jnp.ones((2, 3)))
    jaxbwd.testing.assert_close(op(jnp.ones((2, 3)), jnp.full((3,), 2.0)), jnp.full((2, 3), 2.0), 0.0)


def test_rules_of_ordinary_user_ops_pass_the_form_checks():
    """What the form checks must let through: a weak-typed Python scalar argument (bf16 x
    / 2.0 stays bf16), a static parameter of the forward's positional ones given by keyword
    with a sharding signature, a repeated upper-case (gathered) letter, and a Python 0 as a
    cotangent."""
    div = jaxbwd.define_op("weak_div_test", forward=lambda x, t: x / t, fwd=lambda x, t: (x / t, (t,)),
                           backward=lambda r, d: (d / r[0], 0))
    x = jnp.ones((4,), jnp.bfloat16)
    g = jax.jit(jax.grad(lambda x, t: jnp.sum(div(x, t).astype(jnp.float32))))(x, 2.0)
    assert g.dtype == jnp.bfloat16
    jaxbwd.testing.assert_close(g, jnp.full((4,), 0.5), 0.0)
    norm = jaxbwd.define_op("eps_kw_test", forward=lambda x, w, eps: x * w / (1 + eps),
                            backward=lambda r, d, eps: (d * r[1] / (1 + eps), jnp.sum(d * r[0], 0) / (1 + eps)),
                            sharding="...D,D->...D")
    jaxbwd.testing.assert_close(norm(jnp.ones((2, 3)), jnp.ones((3,)), eps=1.0), jnp.full((2, 3), 0.5), 0.0)
    sq = jaxbwd.define_op("square_mat_test", forward=lambda a: a @ a, sharding="...NN->...NN",
                          backward=lambda r, d: (d @ r[0].mT + r[0].mT @ d,))
    a = jnp.arange(8.0).reshape(2, 2, 2)
    jaxbwd.testing.assert_close(jax.grad(lambda a: jnp.sum(sq(a)))(a), jax.grad(lambda a: jnp.sum(a @ a))(a), 1e-6)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_squared_relu_float64_is_computed_in_float64(impl):
    """The worked example's kernel computes in float64 for float64 x, as its XLA path does
    (it cast to float32 before: 2e-8 off at x = 0.1)."""
    with jax.enable_x64(True), jaxbwd.config.use(interpret=True):
        x = jnp.array([0.1, -0.3, 1e-9, 3.0], jnp.float64)
        g = jax.grad(lambda x: jnp.sum(squared_relu.squared_relu(x, implementation=impl)))(x)
    assert g.dtype == jnp.float64
    np.testing.assert_array_equal(np.asarray(g), 2.0 * np.maximum(np.asarray(x), 0.0))


def test_residual_batch_dims_match_in_either_tree_form():
    """A vmapped op's inferred residual dims come as the residuals' own pytree (jax 0.12.0)
    or as a tuple tree in which every other node is a tuple (jax >= 0.12.1); both give one
    dim per array leaf, and a dims tree that is no prefix of the residuals is refused."""
    from jaxbwd.vjp._derivatives import _leaf_dims, _StaticDims

    x = jnp.zeros(3)
    tree = (x, ((x, None, {"b": x, "a": x}), _StaticDims((0,))))
    own = (0, ((1, None, {"b": None, "a": 2}), _StaticDims((0,))))
    tuples = (0, ((1, None, {"b": None, "a": 2}), ()))
    assert _leaf_dims(tree, own) == _leaf_dims(tree, tuples) == [0, 1, 2, None]
    assert _leaf_dims(tree, (0, None)) == [0, None, None, None]
    assert _leaf_dims(tree, (0, np.int64(1))) == [0, 1, 1, 1]
    with pytest.raises(AssertionError, match="not a prefix"):
        _leaf_dims(tree, (0, (1, 2, 3)))
    with pytest.raises(AssertionError, match="not a prefix"):
        _leaf_dims((x, x), (0, ()))
