"""The test contract of jaxbwd's ops, for any op with a registry entry (yours too).

Subclass :class:`OpContract` in a pytest file and set ``spec``::

    import jaxbwd.testing
    from mypkg.ops import SPEC            # an OpSpec, e.g. from jaxbwd.define_op(...).spec(...)

    class TestMyOp(jaxbwd.testing.OpContract):
        spec = SPEC

pytest then runs, for both implementations where the op has Pallas kernels (in interpret
mode on a machine without a GPU) and every dtype of ``spec.dtypes``:

1. the forward against ``spec.reference``;
2. the gradients against ``jax.vjp`` of the reference, with the kernels in the jaxpr;
3. float64 numerical gradients (``jax.test_util.check_grads``) of the XLA implementation;
4. ``jit``, ``vmap``, ``grad`` of ``vmap``, ``vmap`` of ``grad``, ``jax.checkpoint`` and
   ``lax.scan`` against a loop of single calls;
5. every kernel lowered for CUDA from this machine at the ``spec.lowering`` shapes;
6. every ``spec.bad_inputs`` raising its error naming the op;
7. the residual bytes within ``spec.residual_budget``;
8. ``jax.jvp``/``jax.linearize`` against the reference (jax >= 0.12), or, for an op declared
   without forward mode (``spec.forward_mode``), ``jax.jvp`` raising NotImplementedError;
9. grad of grad (reverse over reverse) against the reference;
10. on the Pallas path, with tiles small enough for several programs per grid, no program
    writing what another writes or reading what another wrote, and no output element left
    unwritten (``check_programs_independent``: a GPU runs a grid's programs in no fixed
    order, interpret mode one after another).
11. on the Pallas path, at the table's tiles and at small ones, no load or store whose mask
    lets a lane outside its operand (``check_in_bounds``: interpret mode wraps, clamps or
    drops such a lane, a GPU reads or writes another buffer).

jaxbwd's own ops also run ``tests/test_contract.py``, which adds more: determinism, strict
dtype promotion, 16-bit transforms, x64 tracing, ``jacfwd``, Hessian-vector products.

Each check is also a plain function (``check_forward(spec, impl, dtype)`` ...) for other
test runners. Needs ``chex`` and ``pytest`` (jaxbwd's ``test`` extra).

Arguments of the ``check_*`` functions (their docstrings say which each takes):

* ``spec``: the op's :class:`~jaxbwd.registry.OpSpec`;
* ``impl``: ``"xla"`` or ``"pallas"`` (the kernels run in interpret mode when the default
  backend is not a GPU);
* ``dtype``: ``"float32"``, ``"bfloat16"`` or ``"float16"``, the floating inputs' dtype
  (integer inputs keep theirs; another name is a KeyError);
* ``example``: one of ``spec.examples`` (default: each of them, or the first where the
  docstring says so).

Each returns None and raises ``AssertionError`` (chex's or pytest's) when the op fails the
check; an error the op raises itself propagates. Tolerances, relative to
``max(1, max|reference|)``: float32 1e-5, bfloat16 2e-2, float16 2e-3 (``TOL``), each
against the float32 reference. Source: the references are the registry's plain-jnp
formulas differentiated by JAX's autodiff; check 3 is ``jax.test_util.check_grads``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Optional

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from jaxbwd import config
from jaxbwd.check import kernels_missing
from jaxbwd.pallas import _common as pallas_common
from jaxbwd.registry import Example, OpSpec
from jaxbwd.vjp import _derivatives

IMPLS = ("xla", "pallas")
TOL = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 2e-3}


# ------------------------------------------------------------------------------ helpers
def _interpret():
    return config.use(interpret=jax.default_backend() != "gpu" or config.interpret())


def _setup(ex: Example, dt, seed=0):
    args, kwargs = ex.make(jax.random.PRNGKey(seed), jnp.dtype(dt))
    return list(args), kwargs


def _cotangent(out, seed=1):
    return jax.random.normal(jax.random.PRNGKey(seed), out.shape, jnp.float32).astype(out.dtype)


def assert_close(actual, expected, tol: float) -> None:
    """``chex.assert_trees_all_close`` in float32 with ``atol = tol * max(1, max|expected|)``.

    Args:
      actual, expected: pytrees of arrays of the same structure and shapes (any dtypes).
      tol: the relative tolerance (also ``rtol``).

    Raises:
      AssertionError: an element differs by more than ``atol + rtol * |expected|``.
    """
    scale = max(1.0, max(float(jnp.max(jnp.abs(e.astype(jnp.float32)))) for e in jax.tree_util.tree_leaves(expected)))
    f32 = lambda t: jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), t)  # noqa: E731
    chex.assert_trees_all_close(f32(actual), f32(expected), atol=tol * scale, rtol=tol)


def _truth(spec, args, kwargs):
    """The reference on float32 copies of the (possibly 16-bit) inputs, and its diff args."""
    args32 = [a.astype(jnp.float32) if hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating) else a
              for a in args]
    return spec.bind(args32, kwargs, spec.reference), [args32[i] for i in spec.diff_argnums]


def implementations(spec: OpSpec) -> tuple[str, ...]:
    """The implementations the contract runs for ``spec`` (an OpSpec): ``("xla", "pallas")``,
    or ``("xla",)`` for an op whose backward is XLA by design. Raises nothing."""
    return IMPLS if spec.has_kernels else ("xla",)


# ------------------------------------------------------------------------------- checks
def check_forward(spec: OpSpec, impl: str, dtype: str, example: Optional[Example] = None) -> None:
    """1: the op's output equals the reference's (dtype, shape, values).
    Raises AssertionError when the op fails it (module docstring)."""
    for ex in [example] if example else spec.examples:
        args, kwargs = _setup(ex, dtype)
        with _interpret():
            out = spec.fn(*args, **kwargs, implementation=impl)
        want = spec.reference(*args, **kwargs)
        assert out.dtype == want.dtype and out.shape == want.shape, (spec.name, ex.name, out.dtype, want.dtype)
        f32, d32 = _truth(spec, args, kwargs)
        assert_close(out, f32(*d32), TOL[dtype])


def check_grads(spec: OpSpec, impl: str, dtype: str, example: Optional[Example] = None) -> None:
    """2: gradients equal autodiff of the reference, in the inputs' dtypes; on the Pallas path
    every kernel of ``spec.kernels`` is in the backward's jaxpr (no silent fallback).
    Raises AssertionError when the op fails it (module docstring)."""
    for ex in [example] if example else spec.examples:
        args, kwargs = _setup(ex, dtype)
        diff = [args[i] for i in spec.diff_argnums]
        f = spec.bind(args, kwargs, implementation=impl)
        with _interpret():
            out, vjp = jax.vjp(f, *diff)
            ct = _cotangent(out)
            grads = vjp(ct)
            missing = kernels_missing(f, diff, ct, spec.kernels) if impl == "pallas" else []
        for g, d in zip(grads, diff):
            assert g.dtype == d.dtype and g.shape == d.shape, (spec.name, ex.name, g.dtype, d.dtype)
            assert bool(jnp.all(jnp.isfinite(g.astype(jnp.float32)))), (spec.name, ex.name)
        f32, d32 = _truth(spec, args, kwargs)
        assert_close(grads, jax.vjp(f32, *d32)[1](ct.astype(jnp.float32)), TOL[dtype])
        assert not missing, f"kernels {missing} not in the backward of {spec.name}"


def check_numerical_grads(spec: OpSpec) -> None:
    """3: ``jax.test_util.check_grads`` in float64 on the XLA implementation (first example).
    Raises AssertionError (``check_grads``'s) when the op fails it."""
    from jax.test_util import check_grads as numerical

    with jax.enable_x64(True):
        args, kwargs = _setup(spec.examples[0], "float64")
        f = spec.bind(args, kwargs, implementation="xla")
        numerical(f, [args[i] for i in spec.diff_argnums], order=spec.check_grads_order or 1,
                  modes=("rev",), atol=1e-5, rtol=1e-5)


def check_transforms(spec: OpSpec, impl: str, dtype: str, n: int = 3) -> None:
    """4: jit(vmap), vmap of grad, grad of vmap (unbatched args' grads summed), checkpoint and
    scan against a Python loop of single calls (first example, ``batch_argnums`` batched).
    Raises AssertionError when the op fails it (module docstring)."""
    ex = spec.examples[0]
    per = [_setup(ex, dtype, seed=i)[0] for i in range(n)]
    args, kwargs = list(per[0]), _setup(ex, dtype)[1]
    for i in ex.batch_argnums:
        args[i] = jnp.stack([p[i] for p in per])
    tol = TOL[dtype]
    in_axes = tuple(0 if i in ex.batch_argnums else None for i in spec.diff_argnums)
    single = spec.bind(args, kwargs, implementation=impl)
    diff = [args[i] for i in spec.diff_argnums]
    pick = lambda k: [d[k] if ax == 0 else d for d, ax in zip(diff, in_axes)]  # noqa: E731
    argnums = tuple(range(len(diff)))

    def loss(*d):
        return jnp.sum(single(*d).astype(jnp.float32) ** 2)

    with _interpret():
        loop_out = jnp.stack([single(*pick(k)) for k in range(n)])
        loop_grads = [jax.grad(loss, argnums=argnums)(*pick(k)) for k in range(n)]
        vm = jax.vmap(single, in_axes=in_axes)
        assert_close(jax.jit(vm)(*diff), loop_out, tol)
        vg = jax.vmap(jax.grad(loss, argnums=argnums), in_axes=in_axes)(*diff)
        for j in argnums:
            assert_close(vg[j], jnp.stack([g[j] for g in loop_grads]), tol)
        gv = jax.grad(lambda *d: jnp.sum(vm(*d).astype(jnp.float32) ** 2), argnums=argnums)(*diff)
        for j, ax in enumerate(in_axes):
            want = (jnp.stack([g[j] for g in loop_grads]) if ax == 0
                    else sum(g[j].astype(jnp.float32) for g in loop_grads))
            assert gv[j].dtype == diff[j].dtype
            assert_close(gv[j], want, tol * (1 if ax == 0 else n))
        assert_close(jax.grad(jax.checkpoint(loss), argnums=argnums)(*pick(0)), loop_grads[0], tol)

        def step(carry, xs):
            xs = list(xs)
            d = [xs.pop(0) if ax == 0 else c for ax, c in zip(in_axes, carry)]
            return carry, jax.grad(loss, argnums=argnums)(*d)

        _, sg = jax.lax.scan(step, [d for d in diff], [d for d, ax in zip(diff, in_axes) if ax == 0])
        for j in argnums:
            assert_close(sg[j], jnp.stack([g[j] for g in loop_grads]), tol)


def check_lowering(spec: OpSpec, example: Optional[Example] = None) -> None:
    """5: the backward lowers for CUDA from any machine at every ``spec.lowering`` shape (or at
    ``example``, one of them), with
    each of ``spec.kernels`` as a Triton kernel in the module, and so does the op alone (not
    differentiated) with each of ``spec.primal_kernels``. Raises AssertionError for a
    kernel missing from the module, or for a spec without ``lowering`` shapes (an op
    without kernels has nothing to lower: the contract does not run this check for it)."""
    assert spec.lowering, (f"{spec.name} has kernels but no lowering shapes" if spec.has_kernels
                           else f"{spec.name} has no Pallas kernels to lower (and no lowering shapes)")
    for ex in [example] if example else spec.lowering:
        args, kwargs = ex.make(None, None)

        def bwd(*all_args):
            f = spec.bind(list(all_args), kwargs, implementation="pallas")
            diff = [all_args[i] for i in spec.diff_argnums]
            out, vjp = jax.vjp(f, *diff)
            return vjp(jnp.ones_like(out))

        with config.use(interpret=False):
            names = pallas_common.triton_kernel_names(pallas_common.lower_for_gpu(bwd, *args))
        for k in spec.kernels:
            assert k in names, f"{spec.name} ({ex.name}): kernel {k} missing from the CUDA module (found {names})"
        if spec.primal_kernels:
            def primal(*all_args):
                f = spec.bind(list(all_args), kwargs, implementation="pallas")
                return f(*[all_args[i] for i in spec.diff_argnums])

            with config.use(interpret=False):
                names = pallas_common.triton_kernel_names(pallas_common.lower_for_gpu(primal, *args))
            for k in spec.primal_kernels:
                assert k in names, (f"{spec.name} ({ex.name}): kernel {k} missing from the op's CUDA module "
                                    f"when not differentiated (found {names})")


def check_bad_inputs(spec: OpSpec) -> None:
    """6: each bad input raises its error type, matching its message, naming the op.
    Raises pytest's ``Failed`` when one raises nothing, AssertionError when the message does
    not name the op; another error type propagates."""
    for bad in spec.bad_inputs:
        args, kwargs = bad.make()
        with pytest.raises(bad.error, match=bad.match) as info:
            spec.fn(*args, **kwargs)
        assert spec.name in str(info.value), (bad.name, str(info.value))


def check_residuals(spec: OpSpec, impl: str) -> None:
    """7: the arrays the forward saves for the backward fit ``spec.residual_budget`` bytes.
    Raises AssertionError over the budget; TypeError when ``spec.residual_budget`` is None
    (the contract then skips this check)."""
    args, kwargs = _setup(spec.examples[0], "float32")
    f = spec.bind(args, kwargs, implementation=impl)
    with _interpret():
        _, vjp = jax.vjp(f, *[args[i] for i in spec.diff_argnums])
    saved = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(vjp) if hasattr(x, "dtype"))
    budget = spec.residual_budget(*args, **kwargs)
    assert saved <= budget, f"{spec.name} saves {saved} bytes, budget {budget}"


def check_jvp(spec: OpSpec, impl: str, dtype: str = "float32") -> None:
    """8: ``jax.jvp`` and ``jax.linearize`` equal the reference's (first example); for an op
    declared without forward mode, ``jax.jvp`` raises NotImplementedError naming it.
    Raises AssertionError (or pytest's ``Failed``) when the op fails it."""
    args, kwargs = _setup(spec.examples[0], dtype)
    diff = tuple(args[i] for i in spec.diff_argnums)
    f = spec.bind(args, kwargs, implementation=impl)
    if not spec.forward_mode:
        with _interpret(), pytest.raises(NotImplementedError, match=f"jaxbwd.{spec.name}: forward-mode"):
            jax.jvp(f, diff, diff)
        return
    f32, d32 = _truth(spec, args, kwargs)
    keys = jax.random.split(jax.random.PRNGKey(2), len(diff))
    ts = tuple(jax.random.normal(k, d.shape, jnp.float32).astype(d.dtype) for k, d in zip(keys, diff))
    with _interpret():
        out, t_out = jax.jvp(f, diff, ts)
        _, lin = jax.linearize(f, *diff)
        t_lin = lin(*ts)
    want, t_want = jax.jvp(f32, tuple(d32), tuple(t.astype(jnp.float32) for t in ts))
    assert_close(out, want, TOL[dtype])
    assert_close(t_out, t_want, TOL[dtype])
    assert_close(t_lin, t_want, TOL[dtype])


def check_second_order(spec: OpSpec, impl: str) -> None:
    """9: grad of grad (a gradient penalty, ``d/dx <grad(x), v>``) equals the reference's, in
    float32 (first example). Reverse over reverse: no tangent rule needed; on the Pallas path
    it differentiates the op's XLA backward formula (see ``define_op``'s ``pallas_backward``).
    Raises AssertionError when the op fails it."""
    args, kwargs = _setup(spec.examples[0], "float32")
    diff = tuple(args[i] for i in spec.diff_argnums)
    f = spec.bind(args, kwargs, implementation=impl)
    f32, d32 = _truth(spec, args, kwargs)
    w = _cotangent(jax.eval_shape(f, *diff)).astype(jnp.float32)
    keys = jax.random.split(jax.random.PRNGKey(3), len(diff))
    vs = tuple(jax.random.normal(k, d.shape, jnp.float32) for k, d in zip(keys, diff))
    argnums = tuple(range(len(diff)))

    def grad_of_grad(h, d):
        g = jax.grad(lambda *d: jnp.sum(h(*d).astype(jnp.float32) * w), argnums=argnums)
        return jax.grad(lambda *d: sum(jnp.vdot(a.astype(jnp.float32), v) for a, v in zip(g(*d), vs)),
                        argnums=argnums)(*d)

    with _interpret():
        got = grad_of_grad(f, diff)
    assert_close(got, grad_of_grad(f32, d32), 1e-4)


# ------------------------------------------------------------------------- pytest base
class OpContract:
    """Subclass with ``spec = <OpSpec>`` (class name starting with ``Test``) to run the contract:
    pytest collects one test per check (module docstring), parametrised over the
    implementations, skipping only what the spec declares absent (no kernels, no residual
    budget; forward mode on jax < 0.12)."""

    spec: OpSpec = None

    @pytest.fixture(params=IMPLS)
    def impl(self, request):
        if request.param not in implementations(self.spec):
            pytest.skip(f"{self.spec.name}: the backward is XLA by design (no Pallas kernel)")
        return request.param

    def test_forward_matches_reference(self, impl):
        for dt in self.spec.dtypes:
            check_forward(self.spec, impl, dt)

    def test_grads_match_autodiff_of_reference(self, impl):
        for dt in self.spec.dtypes:
            check_grads(self.spec, impl, dt)

    def test_numerical_grads_float64_xla(self):
        check_numerical_grads(self.spec)

    def test_transforms(self, impl):
        check_transforms(self.spec, impl, "float32")

    def test_kernels_lower_for_gpu(self):
        if not self.spec.has_kernels:
            pytest.skip(f"{self.spec.name}: no Pallas kernel to lower")
        check_lowering(self.spec)

    def test_bad_inputs_raise(self):
        check_bad_inputs(self.spec)

    def test_residuals_within_budget(self, impl):
        if self.spec.residual_budget is None:
            pytest.skip(f"{self.spec.name}: no residual budget declared")
        check_residuals(self.spec, impl)

    @pytest.mark.skipif(not _derivatives.FORWARD_MODE, reason="forward mode needs jax >= 0.12")
    def test_jvp_matches_reference(self, impl):
        check_jvp(self.spec, impl)

    def test_grad_of_grad_matches_reference(self, impl):
        check_second_order(self.spec, impl)

    def test_loads_and_stores_in_bounds(self):
        if not self.spec.has_kernels:
            pytest.skip(f"{self.spec.name}: no Pallas kernel")
        if not check_in_bounds(self.spec):
            pytest.skip(f"{self.spec.name}: no kernel launched through jaxbwd's launcher "
                        "(a kernel calling pl.pallas_call itself is not seen)")

    def test_programs_independent(self):
        if not self.spec.has_kernels:
            pytest.skip(f"{self.spec.name}: no Pallas kernel")
        axes = check_programs_independent(self.spec, require_split=False)
        if not any(v and min(v) > 1 for v in axes.values()):
            pytest.skip(f"{self.spec.name}: no kernel launched through jaxbwd's launcher with several programs "
                        "per grid axis (a kernel calling pl.pallas_call itself is not seen)")


# ------------------------------------------------------------------ program independence
@dataclasses.dataclass(frozen=True)
class ProgramWrites:
    """What the programs of one interpret-mode launch wrote to one output, each run alone.

    ``kernel``: the launch's name; ``output``: the output's index among the launch's flat
    outputs; ``grid``: the launch's grid; ``size``: the output's elements;
    ``multiply_written``: elements two or more programs write (a write-write race on a GPU,
    where programs run in no fixed order; counted even where they write equal values);
    ``unwritten``: elements of a fresh output no program writes (uninitialised memory on a
    GPU; always 0 for an output aliased to an input, which keeps what the kernel leaves);
    ``dependent``: elements a program writes with a value that depends on what other
    programs wrote (a read-after-write race on a GPU)."""

    kernel: str
    output: int
    grid: tuple[int, ...]
    size: int
    multiply_written: int
    unwritten: int
    dependent: int

    @property
    def programs(self) -> int:
        return math.prod(self.grid)

    @property
    def racy(self) -> bool:
        """Whether any element is written twice, left unwritten or written from another
        program's writes (a kernel whose result on a GPU depends on the programs' order)."""
        return bool(self.multiply_written or self.unwritten or self.dependent)


def _as_bits(x):
    x = jnp.asarray(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint8)
    return jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[x.dtype.itemsize])


def _fill(s, k: int):
    """Two fills per dtype that no write in these checks is expected to equal both of."""
    dt = jnp.dtype(s.dtype)
    if dt == jnp.bool_:
        v = (False, True)[k]
    elif jnp.issubdtype(dt, jnp.floating):
        v = (-12345.0, 7503.0)[k] if dt.itemsize > 1 else (-3.0, 5.0)[k]
    else:
        v = (7, 11)[k]
    return jnp.full(s.shape, v, dt)


def _each_program_alone(reports: list, pallas_call):
    """``pallas_call`` (interpret mode), returning the whole grid's results as it does, and
    also running every program of the grid alone, twice, to append one
    :class:`ProgramWrites` per output to ``reports`` when the launch runs.

    Run 0 starts the fresh outputs filled with one value and the in-place outputs as their
    inputs; run 1 starts the fresh outputs with another value and each in-place output as
    the whole run left it, except the elements the program wrote in run 0 (those start as
    the input again). A program that reads nothing another program writes writes the same
    bits in both runs."""
    def make(kernel, *, out_shape, grid, input_output_aliases=None, interpret=False, name=None, **kw):
        launch = pallas_call(kernel, out_shape=out_shape, grid=grid, input_output_aliases=input_output_aliases,
                             interpret=interpret, name=name, **kw)
        if interpret is not True:  # only the Triton kernels' interpret mode (Mosaic's has a race detector)
            return launch
        shapes = jax.tree_util.tree_leaves(out_shape)
        grid = tuple(int(g) for g in grid)
        strides = [math.prod(grid[d + 1:]) for d in range(len(grid))]
        aliased = {o: i for i, o in (input_output_aliases or {}).items()}  # output -> input
        fresh = [o for o in range(len(shapes)) if o not in aliased]

        def run(*args):
            whole = jax.tree_util.tree_leaves(launch(*args))
            n_in = len(args)

            def gated(target_ref, *refs):
                ins, outs = refs[:n_in], refs[n_in + len(fresh):]
                # Read outside the branch: interpret mode substitutes program_id only there.
                ids = [pl.program_id(d) for d in range(len(grid))]
                linear = sum(i * st for i, st in zip(ids, strides))

                @pl.when(linear == target_ref[0])
                def _():
                    program_id, pl.program_id = pl.program_id, lambda axis: ids[axis]
                    try:
                        kernel(*ins, *outs)
                    finally:
                        pl.program_id = program_id

            io = {1 + i: o for o, i in aliased.items()}
            io.update({1 + n_in + e: o for e, o in enumerate(fresh)})
            alone = pallas_call(gated, out_shape=out_shape, grid=grid, input_output_aliases=io, interpret=True,
                                name=name, **kw)

            def per_program(target):
                a = list(args)
                run0 = jax.tree_util.tree_leaves(alone(target[None], *a, *(_fill(shapes[o], 0) for o in fresh)))
                wrote = {o: _as_bits(run0[o]) != _as_bits(args[i]) for o, i in aliased.items()}
                for o, i in aliased.items():
                    a[i] = jnp.where(wrote[o], args[i], whole[o])
                run1 = jax.tree_util.tree_leaves(alone(target[None], *a, *(_fill(shapes[o], 1) for o in fresh)))
                res = []
                for o, s in enumerate(shapes):
                    got = [_as_bits(run0[o]), _as_bits(run1[o])]
                    if o in aliased:
                        written = wrote[o]
                    else:
                        written = (got[0] != _as_bits(_fill(s, 0))) | (got[1] != _as_bits(_fill(s, 1)))
                    res.append((written, jnp.sum(written & (got[0] != got[1]))))
                return res

            per = jax.lax.map(per_program, jnp.arange(math.prod(grid), dtype=jnp.int32))
            for o, (written, dependent) in enumerate(per):
                writers = jnp.sum(written.astype(jnp.int32), axis=0)
                jax.debug.callback(functools.partial(_report, reports, name, o, grid, o in aliased),
                                   writers, jnp.sum(dependent))
            return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), whole)

        return run

    return make


def _report(reports, name, output, grid, aliased, writers, dependent):
    writers = np.asarray(writers)
    reports.append(ProgramWrites(name, output, grid, int(writers.size), int((writers > 1).sum()),
                                 0 if aliased else int((writers == 0).sum()), int(dependent)))


@contextlib.contextmanager
def record_program_writes():
    """Within the block, every Pallas (Triton) kernel that jaxbwd's launcher sets up in
    interpret mode (eagerly, or while a function is traced) also runs each program of its
    grid alone and records, per output, a :class:`ProgramWrites` in the yielded list when
    the launch runs.

    On a GPU a grid's programs run concurrently in no fixed order; interpret mode runs them
    one after another, so a kernel whose programs write the same element, read what another
    program wrote, or leave part of a fresh output unwritten still gives right answers there.
    Each program run alone, with its outputs prepared two ways (``_each_program_alone``),
    shows which elements it writes and whether what it writes depends on other programs.
    Costs two runs of the whole grid per program: for small shapes.

    Limits: a function traced before the block (a ``jax.jit`` cache hit) is not instrumented,
    and one traced inside stays instrumented; atomic accumulation counts as a race; an
    in-place output element that a program overwrites with the value it already held is
    not seen as written.

    Yields:
      a list of :class:`ProgramWrites`, appended to as instrumented launches run.
    """
    reports: list[ProgramWrites] = []
    token = pallas_common.LAUNCH_WRAPPER.set(functools.partial(_each_program_alone, reports))
    try:
        yield reports
    finally:
        pallas_common.LAUNCH_WRAPPER.reset(token)


# --------------------------------------------------------------------- bounds of memory
@dataclasses.dataclass(frozen=True)
class OutOfBounds:
    """Lanes of one load or store, in one program of an interpret-mode launch, that the mask
    lets through at an index outside the ref. ``kernel``: the launch's name; ``kind``:
    ``"load"`` or ``"store"``; ``shape``: the ref's shape; ``program``: the program's grid
    indices; ``lanes``: how many elements."""

    kernel: str
    kind: str
    shape: tuple[int, ...]
    program: tuple[int, ...]
    lanes: int


def _bounds_checked(reports: list, kernels: set, pallas_call):
    """``pallas_call`` whose kernel, in interpret mode, reports out-of-bounds lanes of every
    ``_common.load``/``store`` it traces (``_common.BOUNDS_REPORT``) to ``reports``, and
    adds its name to ``kernels``."""
    def make(kernel, *, grid, interpret=False, name=None, **kw):
        if interpret is not True:  # the Triton kernels' interpret mode only; a GPU lowering stays as it is
            return pallas_call(kernel, grid=grid, interpret=interpret, name=name, **kw)
        rank = len(tuple(grid))
        kernels.add(name)

        def checked(*refs):
            # Read at the kernel's top level: interpret mode substitutes program_id only there,
            # not inside the loops and branches where the loads are.
            ids = [pl.program_id(d) for d in range(rank)]

            def report(kind, shape, lanes):
                jax.debug.callback(functools.partial(_record_bounds, reports, name, kind, shape), lanes, *ids)

            token = pallas_common.BOUNDS_REPORT.set(report)
            try:
                return kernel(*refs)
            finally:
                pallas_common.BOUNDS_REPORT.reset(token)

        return pallas_call(checked, grid=grid, interpret=interpret, name=name, **kw)

    return make


def _record_bounds(reports, name, kind, shape, lanes, *ids):
    lanes = np.asarray(lanes)
    if lanes.sum():
        reports.append(OutOfBounds(name, kind, shape, tuple(int(np.max(i)) for i in ids), int(lanes.sum())))


def _launch_every_kernel(f, diff, forward_mode: bool):
    """Runs what launches an op's kernels: ``f`` not differentiated (its own kernels, e.g.
    cross_entropy's statistics), its forward and backward and, with ``forward_mode``,
    ``jax.jvp``. Returns (the cotangent, the gradients)."""
    jax.block_until_ready(f(*diff))
    out, vjp = jax.vjp(f, *diff)
    ct = _cotangent(out)
    grads = jax.block_until_ready(vjp(ct))
    if forward_mode:
        jax.block_until_ready(jax.jvp(f, tuple(diff), tuple(diff)))
    return ct, grads


@contextlib.contextmanager
def record_out_of_bounds(kernels: Optional[set] = None):
    """Within the block, every Pallas (Triton) kernel that jaxbwd's launcher sets up in
    interpret mode checks each masked load and store it makes through
    ``jaxbwd.pallas._common.load``/``store``: a lane the mask lets through must index inside
    the ref. Each offending access of each program appends an :class:`OutOfBounds` to the
    yielded list when the launch runs.

    Interpret mode indexes as NumPy does (negative indices wrap; gathers past the end clamp
    or pad, scatters there are dropped), so such a lane can still give a plausible answer
    there; compiled for a GPU it reads another buffer's memory (a wrong answer that a
    tolerance may hide) or writes over it, or faults.

    The check adds a host callback to each interpreted kernel, which can change how XLA
    compiles it for the CPU: results may differ from an unchecked run in the last bit.

    Limits: a function traced before the block (a ``jax.jit`` cache hit) is not checked;
    nor is a load written as ``ref[i]`` instead of through ``_common`` (attention's segment
    block bounds, dropout's key), nor a kernel that calls ``pl.pallas_call`` itself. Indices
    are checked against the ref as passed: a view (``ref.at[pl.ds(...)]``) that runs past
    its operand is not seen, slice indices (``pl.ds``) count as inside and an index with an
    Ellipsis is not checked (jaxbwd's kernels index whole refs with integer arrays). A launch
    in interpret mode cannot be lowered for a GPU inside the block (the host callback).

    Args:
      kernels: a set to which the names of the launches checked are added, if given.
    Yields:
      a list of :class:`OutOfBounds`, appended to as checked launches run.
    """
    reports: list[OutOfBounds] = []
    kernels = set() if kernels is None else kernels
    token = pallas_common.LAUNCH_WRAPPER.set(functools.partial(_bounds_checked, reports, kernels))
    try:
        yield reports
    finally:
        pallas_common.LAUNCH_WRAPPER.reset(token)


def check_in_bounds(spec: OpSpec) -> set:
    """11: on the Pallas path, for every example, at the tuning table's tiles in each dtype of
    ``spec.dtypes`` and under :func:`small_tiles` in float32: every load and store of the
    kernels that the op (not differentiated), its forward and backward and (with forward
    mode) ``jax.jvp`` launch touches only elements inside its operand where its mask is true
    (:func:`record_out_of_bounds`): the tails of rows, columns and blocks are masked.

    Returns: the names of the kernels checked (none: no launch went through jaxbwd's launcher).
    Raises: AssertionError listing the first offending accesses."""
    forward_mode = bool(spec.forward_mode and _derivatives.FORWARD_MODE and spec.jvp_kernels)
    runs = [(dt, contextlib.nullcontext) for dt in spec.dtypes] + [("float32", small_tiles)]
    launched: set = set()
    for ex in spec.examples:
        for dt, tiles in runs:
            args, kwargs = _setup(ex, dt)
            diff = [args[i] for i in spec.diff_argnums]
            f = spec.bind(args, kwargs, implementation="pallas")
            with _interpret(), tiles(), record_out_of_bounds(launched) as reports:
                _launch_every_kernel(f, diff, forward_mode)
            where = f"{spec.name}/{ex.name} ({dt}{', small tiles' if tiles is small_tiles else ''})"
            assert not reports, f"{where}: masked-in lanes outside their operand: {reports[:8]}"
    return launched


@contextlib.contextmanager
def small_tiles(block: int = 8, tile: int = 32, sms: int = 16):
    """Within the block, jaxbwd's Pallas kernels take tiny tiles and see ``sms`` SMs, so that
    the contract's small examples run grids of several programs, persistent programs with
    several steps, rows in several chunks and the embedding's hot-id path: the tuning
    table's block sizes become ``block`` (its column chunks ``tile``), row tilings hold at
    most ``tile`` elements in at most 2 rows (the norms' too), as do the elementwise,
    permutation, pooling and embedding kernels' own tiles; column sums take 2 rows per step.
    Eager launchers cached before the block are forgotten on entry, and those built inside
    on exit. For tests only: tiles this small would be slow on a GPU."""
    from unittest import mock

    from jaxbwd.pallas import _tuning, elementwise, embedding, pooling, vision

    overrides = {}
    for key in _tuning.requests():
        kernel = key.split("/")[0]
        if kernel == "norm_bwd":  # the chunk width sits on the bare key; each width's launch under it
            overrides["norm_bwd"] = {"block_n": tile}
            continue
        sums = kernel in _tuning._COLUMN_SUM_KERNELS  # rows per step: two, so that few rows make several steps
        want = {"block_m": 2 if sums else block, "block_n": tile if sums or kernel == "group_norm_bwd" else block,
                "block_k": block, "blocks_per_sm": 1}
        overrides[key] = {f: v for f, v in want.items() if f in _tuning.fields(key)}
    row_tiling, norm_tiling = pallas_common.row_tiling, _tuning.norm_bwd

    def small_row_tiling(n_rows, n_cols, *, max_tile=tile, max_block_rows=2, **kw):
        return row_tiling(n_rows, n_cols, max_tile=min(max_tile, tile), max_block_rows=min(max_block_rows, 2), **kw)

    def small_norm_tiling(n_rows, n_cols, centered=True):
        t, cfg = norm_tiling(n_rows, n_cols, centered)
        return dataclasses.replace(t, block_rows=min(t.block_rows, 2)), cfg

    with contextlib.ExitStack() as stack:
        for module, name, value in [(pallas_common, "row_tiling", small_row_tiling),
                                    (_tuning, "norm_bwd", small_norm_tiling),
                                    (pallas_common, "num_sms", lambda: sms),
                                    (elementwise, "ELEMENTWISE_BLOCK", 2 * tile), (elementwise, "MAX_BLOCK_COLS", tile),
                                    (vision, "PERMUTE_TILE", tile), (pooling, "MAX_BLOCK_COLS", tile),
                                    (embedding, "CHUNK", 4), (embedding, "BLOCK_TOKENS", 2),
                                    (embedding, "MAX_BLOCK_COLS", tile)]:
            stack.enter_context(mock.patch.object(module, name, value))  # AttributeError if a knob is renamed
        stack.enter_context(_tuning.use({arch: overrides for arch in ("sm_80", "sm_90", "sm_100")}))
        # Kernel bodies read some of these constants as globals, which the eager launch
        # cache's keys do not see: no launcher crosses the block's edges.
        stack.callback(pallas_common.clear_launch_cache)
        pallas_common.clear_launch_cache()
        yield


def check_programs_independent(spec: OpSpec, require_split: bool = True) -> dict:
    """10: on the Pallas path under :func:`small_tiles`, in float32, for every example: each
    kernel that the op (not differentiated), its forward and backward and (with forward
    mode) ``jax.jvp`` launch writes every element of a fresh output from exactly one program,
    and nothing a program writes depends on another's writes (:func:`record_program_writes`);
    the gradients still equal the reference's; and for each kernel of ``spec.kernels`` and
    ``spec.jvp_kernels``, every axis of its grid takes two or more programs in some launch
    (else a race between programs along that axis could not show; with ``require_split``
    False this last part is not asserted). A GPU runs a grid's programs in no fixed order,
    which interpret mode cannot show.

    Only launches through jaxbwd's launcher (``jaxbwd.pallas._common.call``) are seen:
    ``small_tiles`` does not reach a kernel that calls ``pl.pallas_call`` itself.

    Returns: ``{(kernel, grid rank): [largest size of each grid axis]}`` over the launches seen.
    Raises: AssertionError for a race, an unwritten element, gradients off the reference's,
    or (``require_split``) a grid axis that never took two programs."""
    forward_mode = bool(spec.forward_mode and _derivatives.FORWARD_MODE and spec.jvp_kernels)
    axes: dict[tuple[str, int], list[int]] = {}  # per kernel and grid rank, each axis's largest size
    for ex in spec.examples:
        args, kwargs = _setup(ex, "float32")
        diff = [args[i] for i in spec.diff_argnums]
        f = spec.bind(args, kwargs, implementation="pallas")
        with _interpret(), small_tiles(), record_program_writes() as reports:
            ct, grads = _launch_every_kernel(f, diff, forward_mode)
        races = [r for r in reports if r.racy]
        assert not races, f"{spec.name}/{ex.name}: programs of a grid depend on each other: {races}"
        for r in reports:
            k = (r.kernel, len(r.grid))
            axes[k] = [max(a, b) for a, b in zip(axes.get(k, r.grid), r.grid)]
        f32, d32 = _truth(spec, args, kwargs)
        assert_close(grads, jax.vjp(f32, *d32)[1](ct.astype(jnp.float32)), TOL["float32"])
    want = set(spec.kernels) | (set(spec.jvp_kernels) if forward_mode else set())
    seen = {name for name, _ in axes}
    single = {k: v for k, v in axes.items() if k[0] in want and v and min(v) < 2}
    single.update({(name, None): None for name in sorted(want - seen)})
    assert not (require_split and single), (
        f"{spec.name}: no example gives these kernels' grid axes more than one program: {single}")
    return axes
