"""Gradient check of every registered op on this machine (``python -m jaxbwd check``).

For each op and implementation, the op's first registry example (float32) is
differentiated with a random cotangent and compared with ``jax.vjp`` of the op's
plain-jnp reference. On a machine without a GPU the Pallas kernels run in interpret
mode, so the kernel code itself is what is checked.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp

from jaxbwd import config, registry


@dataclasses.dataclass
class CheckRow:
    """One line of the report for one output or gradient.

    ``max_abs`` is ``max|a - b|``; ``max_rel`` is ``max|a - b| / max|b|``, the error relative
    to the result's scale (an elementwise relative error is meaningless where the true
    gradient is near zero; an absolute one passes any small gradient, a zero one included),
    or ``max|a - b|`` where ``b`` is all zero.
    """

    op: str
    implementation: str
    arg: str
    max_abs: float
    max_rel: float
    ok: bool
    note: str = ""  # why a row fails beyond its error, e.g. a kernel that did not run


def kernels_missing(f: Callable, diff: Sequence, ct, kernels: Sequence[str]) -> list[str]:
    """The names in ``kernels`` that no ``pallas_call`` in the backward of ``f`` at ``diff``
    (cotangent ``ct``) carries: a Pallas path that silently runs something else."""
    jaxpr = str(jax.make_jaxpr(lambda *d: jax.vjp(f, *d)[1](ct))(*diff))
    return [k for k in kernels if f"name={k}" not in jaxpr]


def _arg_names(spec: registry.OpSpec) -> list[str]:
    import inspect

    params = list(inspect.signature(spec.fn).parameters)
    return [params[i] for i in spec.diff_argnums]


def check_op(spec: registry.OpSpec, implementation: str, *, tol: float = 1e-4, seed: int = 0) -> list[CheckRow]:
    """Compares the op's output and gradients with autodiff of its reference.

    Args:
      spec: the op's registry entry.
      implementation: ``"pallas"`` or ``"xla"``; Pallas runs in interpret mode unless a GPU
        is the default backend.
      tol: pass threshold for ``max|a - b| / max|b|`` (``max|a - b|`` where b is all zero).

    Returns:
      One ``CheckRow`` for the output and one per differentiable argument. On the Pallas
      path a gradient row fails when one of ``spec.kernels`` is not in the backward.
    """
    args, kwargs = spec.examples[0].make(jax.random.PRNGKey(seed), jnp.dtype("float32"))
    args = list(args)
    diff = [args[i] for i in spec.diff_argnums]

    interpret = jax.default_backend() != "gpu"
    with config.use(interpret=interpret or config.interpret()):
        f = spec.bind(args, kwargs, implementation=implementation)
        out, vjp = jax.vjp(f, *diff)
        ct = jax.random.normal(jax.random.PRNGKey(seed + 1), out.shape, jnp.float32).astype(out.dtype)
        grads = vjp(ct)
        missing = kernels_missing(f, diff, ct, spec.kernels) if implementation == "pallas" else []
    want_out, vjp_ref = jax.vjp(spec.bind(args, kwargs, spec.reference), *diff)
    want = vjp_ref(ct)
    rows = []
    for name, a, b in [("out", out, want_out)] + list(zip(_arg_names(spec), grads, want)):
        a32, b32 = a.astype(jnp.float32), b.astype(jnp.float32)
        abs_err = float(jnp.max(jnp.abs(a32 - b32))) if a.size else 0.0
        scale = float(jnp.max(jnp.abs(b32))) if b.size else 0.0
        scale = scale if scale > 0 else 1.0
        finite = bool(jnp.all(jnp.isfinite(a32)))
        ok = finite and abs_err / scale <= tol
        note = "" if name == "out" or not missing else "no " + ", ".join(missing) + " in the backward"
        rows.append(CheckRow(spec.name, implementation, name, abs_err, abs_err / scale, ok and not note, note))
    return rows


def check(ops: Optional[Sequence[str]] = None, implementations: Sequence[str] = ("xla", "pallas"),
          progress: Optional[Callable[[int, int, str], None]] = None) -> list[CheckRow]:
    """Runs :func:`check_op` for the named ops (all when ``None``) and implementations.

    Ops whose backward is XLA by design are checked with ``"xla"`` only. An op whose check
    raises (a user op's rule returning the wrong shape, say) gets one failing row naming the
    exception, with ``arg=""``, and the other ops are still checked.

    Args:
      progress: called as ``progress(i, n, name)`` before the ``i``-th of ``n`` ops, and as
        ``progress(n, n, "")`` when all are done.

    Raises:
      KeyError: an unknown op name.
    """
    specs = registry.ops(ops)
    rows = []
    for i, spec in enumerate(specs):
        if progress is not None:
            progress(i, len(specs), spec.name)
        for impl in implementations:
            if impl == "pallas" and not spec.has_kernels:
                continue
            try:
                rows.extend(check_op(spec, impl))
            except Exception as e:  # a report per op: one op's error must not hide the others'
                first = (str(e).strip().splitlines() or [""])[0]
                rows.append(CheckRow(spec.name, impl, "", float("nan"), float("nan"), False,
                                     f"{type(e).__name__}: {first}"))
    if progress is not None:
        progress(len(specs), len(specs), "")
    return rows
