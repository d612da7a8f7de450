"""``jax.checkpoint`` policies that see jaxbwd's ops.

On jax >= 0.12 each op application is one primitive in the jaxpr (``jaxbwd/vjp/_derivatives.py``).
JAX's policies recognise values by the primitive that makes them (``dot_general``,
``conv_general_dilated``, ``name``), so they never save an op's values: under
``jax.checkpoint_policies.dots_saveable`` a model built from :func:`jaxbwd.matmul` (or
``jaxbwd.nn.Dense``) saves nothing and recomputes every product in the backward, as under
``nothing_saveable``. The policies here are JAX's, plus one rule for the ops: an op's output
and the residuals its fwd rule declares are saved where JAX's policy would save a dot inside
the op's formula. Use them in place of JAX's of the same name::

    jax.checkpoint(block, policy=jaxbwd.checkpoint_policies.dots_with_no_batch_dims_saveable)

What each saves besides JAX's choices (an op's residuals are listed in its docstring; the
ones saved are those the op computes, such as statistics and logsumexp: a residual that is
one of the op's inputs is saved where its producer is, as JAX's policies treat the inputs of
any equation, never as a copy, which in a scan over layers would stack every layer's
weights a second time):

* :data:`dots_saveable`: ``matmul``, ``conv2d``, ``linear_cross_entropy`` and
  ``dot_product_attention`` (attention's output and [B, N, T] logsumexp, not the T x S
  probabilities that JAX's policy saves from a plain-jnp attention; its q, k, v are saved
  as the outputs of the projections that make them).
* :data:`dots_with_no_batch_dims_saveable` and :func:`offload_dot_with_no_batch_dims`:
  ``matmul`` and ``linear_cross_entropy`` (products with no batch dimensions; attention's
  are batched over heads, and JAX's rule leaves convolutions out).

:func:`save_ops` saves named ops (jax >= 0.12). On jax < 0.12 the ops are
``jax.custom_vjp`` functions whose forward rules remat traces into their own equations, so
JAX's policies see the dots inside them, the dot policies here equal JAX's, and
:func:`save_ops` raises (no equation is an op there).

Source: JAX's remat policies (``jax.checkpoint_policies``, "Gradient checkpointing with
jax.checkpoint" in JAX's docs); the per-op rule is this module's.
"""
from __future__ import annotations

from typing import Callable

import jax
from jax import lax

from jaxbwd.vjp._derivatives import FORWARD_MODE, OP_NAMES, op_of_equation

__all__ = ["dots_saveable", "dots_with_no_batch_dims_saveable", "offload_dot_with_no_batch_dims", "save_ops"]

_DOT_OPS = ("matmul", "conv2d", "linear_cross_entropy", "dot_product_attention")
_NO_BATCH_DOT_OPS = ("matmul", "linear_cross_entropy")


def save_ops(*names: str) -> Callable[..., bool]:
    """A policy saving the output and computed residuals of every application of the named
    ops (the residuals that are the op's own inputs are saved where their producers are: name
    those ops too, ``save_ops("matmul", "swiglu")``, or combine with a dot policy).

    Args:
      names: one or more op names as ``python -m jaxbwd list`` shows them (``"matmul"``,
        ``"dot_product_attention"``, ...), or names of ops made by :func:`jaxbwd.define_op`
        / :func:`jaxbwd.define_elementwise` earlier in the process. Ops that are plain XLA
        code with no primitive of their own (``adaptive_avg_pool2d``) are not names here:
        JAX's policies see their equations.

    Returns:
      A ``jax.checkpoint`` policy, ``policy(prim, *avals, **params) -> bool``; combine it
      with JAX's through ``jax.checkpoint_policies.save_from_both_policies``.

    Raises:
      TypeError: a name that is not a string.
      ValueError: no names, or a name that is no op's primitive (a typo would save
        nothing, silently).
      NotImplementedError: jax < 0.12, where the ops are ``jax.custom_vjp`` functions and no
        equation is an op (name an op's output with ``jax.ad_checkpoint.checkpoint_name``
        and save it with ``save_only_these_names`` there).

    Source: JAX's ``jax.checkpoint_policies.save_only_these_names``, keyed by op instead of
    by ``checkpoint_name``.
    """
    where = "jaxbwd.checkpoint_policies.save_ops"
    if not names:
        raise ValueError(f"{where}: give at least one op name")
    for n in names:
        if not isinstance(n, str):
            raise TypeError(f"{where}: op names must be strings, got {n!r}")
    known = OP_NAMES  # ops that are one primitive (adaptive_avg_pool2d, say, is plain XLA code)
    unknown = sorted(set(names) - known)
    if unknown:
        raise ValueError(f"{where}: no op is named {', '.join(map(repr, unknown))}; ops: {', '.join(sorted(known))}")
    if not FORWARD_MODE:
        raise NotImplementedError(
            f"{where}: needs jax >= 0.12 (before it the ops are jax.custom_vjp functions, and no "
            f"equation a policy sees is an op), got jax {jax.__version__}; name an op's output with "
            "jax.ad_checkpoint.checkpoint_name and save it with save_only_these_names"
        )
    wanted = frozenset(names)

    def policy(prim, *args, **params) -> bool:
        return op_of_equation(params) in wanted

    policy.__name__ = f"save_ops{tuple(sorted(wanted))}"
    return policy


def _with_ops(name: str, jax_policy: Callable[..., object], ops: tuple[str, ...], value) -> Callable[..., object]:
    def policy(prim, *args, **params):
        if op_of_equation(params) in ops:
            return value
        return jax_policy(prim, *args, **params)

    policy.__name__ = name
    policy.__doc__ = (
        f"``jax.checkpoint_policies.{name}``, which also saves the output and computed residuals of "
        f"jaxbwd's {', '.join(ops)} (residuals that are their inputs are saved with their producers).\n\n"
        "Called by ``jax.checkpoint`` as ``policy(prim, *avals, **params)`` for each equation; "
        "returns what JAX's policy returns, or its saving decision for an application of one of "
        "those ops. Pass it as ``jax.checkpoint(f, policy=...)``. Raises nothing.\n\n"
        "Source: JAX's remat policies (jax.checkpoint_policies); the per-op rule is this module's."
    )
    return policy


dots_saveable = _with_ops("dots_saveable", jax.checkpoint_policies.dots_saveable, _DOT_OPS, True)
dots_with_no_batch_dims_saveable = _with_ops("dots_with_no_batch_dims_saveable",
                                             jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                                             _NO_BATCH_DOT_OPS, True)


def offload_dot_with_no_batch_dims(offload_src: str, offload_dst: str) -> Callable[..., object]:
    """``jax.checkpoint_policies.offload_dot_with_no_batch_dims(offload_src, offload_dst)``,
    which also offloads the output and residuals of jaxbwd's matmul and linear_cross_entropy.

    Args:
      offload_src, offload_dst: memory kinds, as JAX's (``"device"``, ``"pinned_host"``).

    Returns:
      A ``jax.checkpoint`` policy. Every output of such an op's forward-rule equation is
      offloaded: the op's output and the residuals it computes (linear_cross_entropy's
      per-token statistics); its inputs x, w and labels are not outputs of that equation.

    Raises:
      Whatever JAX's ``offload_dot_with_no_batch_dims`` raises for the memory kinds.

    Source: JAX's ``jax.checkpoint_policies.offload_dot_with_no_batch_dims``.
    """
    jax_policy = jax.checkpoint_policies.offload_dot_with_no_batch_dims(offload_src, offload_dst)
    # JAX's decision for a product with no batch dimensions: the same offload, its own type.
    offload = jax_policy(lax.dot_general_p, dimension_numbers=(((1,), (0,)), ((), ())))
    return _with_ops("offload_dot_with_no_batch_dims", jax_policy, _NO_BATCH_DOT_OPS, offload)
