"""Ops partition under jit on a mesh with explicit or Auto axes (jaxbwd/sharding.py).

The checks need 8 devices, so they run in a subprocess with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (this file, run as a script), and
the rest of the suite keeps one device. For each mesh shape, each op (both
implementations, Pallas in interpret mode) is run under ``jax.jit`` with sharded inputs
on a ``jax.set_mesh`` explicit mesh; its value and grads must equal the single-device
run, and the compiled HLO must hold no all-gather (activations are never gathered: the
only collective is the all-reduce of weight-gradient partials and of loss sums).

"4x2-auto" runs the same cases under plain ``jax.jit(in_shardings=...)`` on a mesh with
Auto axes, where kernel ops go through ``custom_partitioning``. On CPU, interpret-mode
kernels are ordinary HLO that XLA could partition anyway, so there the check is that
each kernel op reached the partitioner as a custom call and that values, gradients and
output shardings are right; the GPU case (an opaque kernel call) cannot run here.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

MESHES = {"8": (8,), "4x2": (4, 2), "2x4": (2, 4), "4x2-auto": (4, 2), "2x4-auto": (2, 4)}


def _cases(jnp, jax, P, ndim_mesh, auto=False):
    """(name, fn(*args) -> array, args, specs, kind): kind False (data parallel), True
    (tensor parallel) or "gather" (a layout the op cannot split: an all-gather is expected)."""
    import jaxbwd

    from examples import squared_relu as sq

    unsigned = jaxbwd.define_op("squared_relu_unsigned", forward=sq._forward, backward=sq._backward,
                                pallas_backward=sq._pallas_backward, kernels=("squared_relu_bwd",))
    k = iter(jax.random.split(jax.random.key(0), 64))
    r = lambda *s: jax.random.normal(next(k), s, jnp.float32)  # noqa: E731
    dp = ("data", "model") if ndim_mesh == 2 else "data"  # rows over the whole mesh
    labels = jax.random.randint(next(k), (8, 4), 0, 64).at[0, 1].set(-100)
    x, w, b = r(8, 4, 32), r(32), r(32)
    q, kk, v = r(8, 8, 8, 16), r(8, 8, 4, 16), r(8, 8, 4, 16)
    rows, rows4 = P(dp, None, None), P(dp, None, None, None)
    cases = [
        ("rms_norm", lambda x, w: jaxbwd.rms_norm(x, w), (x, w), (rows, P())),
        ("layer_norm", lambda x, w, b: jaxbwd.layer_norm(x, w, b), (x, w, b), (rows, P(), P())),
        ("softmax", lambda x: jaxbwd.softmax(x), (x,), (rows,)),
        ("silu", lambda x: jaxbwd.silu(x), (x,), (rows,)),
        ("gelu", lambda x: jaxbwd.gelu(x), (x,), (rows,)),
        ("swiglu", lambda g, u: jaxbwd.swiglu(g, u), (x, r(8, 4, 32)), (rows, rows)),
        ("gated_linear_unit", lambda x: jaxbwd.gated_linear_unit(x), (r(8, 4, 64),), (rows,)),
        ("bias_add", lambda x, b: jaxbwd.bias_add(x, b), (x, b), (rows, P())),
        ("cross_entropy", lambda l, y: jaxbwd.cross_entropy(l, y), (r(8, 4, 64), labels), (rows, P(dp, None))),
        ("cross_entropy_none", lambda l, y: jaxbwd.cross_entropy(l, y, reduction="none"),
         (r(8, 4, 64), labels), (rows, P(dp, None))),
        ("cross_entropy_vocab", lambda l, y: jaxbwd.cross_entropy(l, y, label_smoothing=0.1, z_loss=1e-3),
         (r(8, 4, 64), labels), (P(None, None, dp), P())),
        ("linear_cross_entropy", lambda x, w, y: jaxbwd.linear_cross_entropy(x, w, y, label_smoothing=0.1, z_loss=1e-3),
         (x, 0.3 * r(32, 64), labels), (rows, P(), P(dp, None))),
        ("linear_cross_entropy_vocab", lambda x, w, y: jaxbwd.linear_cross_entropy(
            x, w, y, label_smoothing=0.1, z_loss=1e-3, logit_softcap=2.0), (x, 0.3 * r(32, 64), labels), (P(), P(None, dp), P())),
        ("rope", lambda x: jaxbwd.rope(x), (q,), (rows4,)),
        ("attention", lambda q, k, v: jaxbwd.dot_product_attention(q, k, v, is_causal=True),
         (q, kk, v), (rows4,) * 3),
        ("attention_segments", lambda q, k, v, seg: jaxbwd.dot_product_attention(
            q, k, v, segment_ids=seg, sliding_window=4, is_causal=True),
         (q, kk, v, jnp.repeat(jnp.arange(2, dtype=jnp.int32), 4)[None].repeat(8, 0)), (rows4,) * 3 + (P(dp, None),)),
        ("embed", lambda t, ids: jaxbwd.embed(ids, t), (r(64, 16), labels.at[0, 1].set(3)), (P(), P(dp, None))),
        ("embed_vocab", lambda t, ids: jaxbwd.embed(ids, t, padding_idx=5),
         (r(64, 16), labels.at[0, 1].set(5).at[2, 2].set(70)), (P(dp, None), P())),
        ("matmul", lambda x, w: jaxbwd.matmul(x, w), (x, r(32, 16)), (rows, P())),
        ("group_norm_silu", lambda x, w, b: jaxbwd.group_norm(x, w, b, num_groups=4, activation="silu"),
         (r(8, 3, 5, 8), r(8), r(8)), (rows4, P(), P())),
        ("conv2d", lambda x, w: jaxbwd.conv2d(x, w, padding=1), (r(8, 5, 5, 4), r(3, 3, 4, 8)), (rows4, P())),
        ("max_pool2d", lambda x: jaxbwd.max_pool2d(x, 2, strides=2, padding="SAME"), (r(8, 5, 5, 4),), (rows4,)),
        # statistics over the sharded batch: per shard, averaged over the batch's mesh axes
        ("batch_norm", lambda x, w, b: jaxbwd.batch_norm(x, w, b), (r(8, 3, 5, 8), r(8), r(8)), (rows4, P(), P())),
        ("upsample2d", lambda x: jaxbwd.upsample2d(x, 2, method="bilinear"), (r(8, 3, 5, 2),), (rows4,)),
        ("pixel_shuffle", lambda x: jaxbwd.pixel_shuffle(x, 2), (r(8, 3, 3, 8),), (rows4,)),
        ("unpatchify", lambda t: jaxbwd.unpatchify(t, grid=(2, 2), patch_size=2, channels=3), (r(8, 4, 12),), (rows,)),
        ("rope_positions", lambda x, pos: jaxbwd.rope(x, positions=pos), (q, jnp.arange(64, dtype=jnp.int32).reshape(8, 8)),
         (rows4, P(dp, None))),
    ]
    cases = [c + (False,) for c in cases]
    if ndim_mesh == 2:  # tensor parallel: batch over "data", heads / hidden over "model"
        hid, heads = P("data", None, "model"), P("data", None, "model", None)
        cases += [
            ("swiglu_tp", lambda g, u: jaxbwd.swiglu(g, u), (x, r(8, 4, 32)), (hid, hid), True),
            ("silu_tp", lambda x: jaxbwd.silu(x), (x,), (hid,), True),
            ("cross_entropy_vocab_tp", lambda l, y: jaxbwd.cross_entropy(l, y, reduction="none", z_loss=1e-3),
             # -inf logit; label 70 out of range (ignored)
             (r(8, 4, 64).at[1, 2, 5].set(-jnp.inf), labels.at[3, 3].set(70)), (P("data", None, "model"), P("data", None)), True),
            ("cross_entropy_vocab_rows", lambda l, y: jaxbwd.cross_entropy(l, y, label_smoothing=0.2),
             (r(8, 4, 64), labels), (P("model", None, "data"), P("model", None)), True),
            # a tied head: table [V, D] over "model" (vocab-parallel), tokens over "data"
            ("linear_cross_entropy_vocab_tp", lambda x, t, y: jaxbwd.linear_cross_entropy(
                x, t, y, transpose_w=True, reduction="none", z_loss=1e-3), (x, 0.3 * r(64, 32), labels.at[3, 3].set(70)),
             (P("data", None, None), P("model", None), P("data", None)), True),
            ("embed_vocab_tp", lambda t, ids: jaxbwd.embed(ids, t), (r(64, 16), labels.at[0, 1].set(3)),
             (P("model", None), P("data", None)), True),
            ("matmul_column_parallel", lambda x, w: jaxbwd.matmul(x, w), (x, r(32, 16)), (P("data", None, None), P(None, "model")), True),
            ("matmul_row_parallel", lambda x, w: jaxbwd.matmul(x, w), (x, r(32, 16)), (hid, P("model", None)), True),
            # sequence parallel: batch over "data", sequence over "model"
            ("rms_norm_seq", lambda x, w: jaxbwd.rms_norm(x, w), (x, w), (P("data", "model", None), P()), True),
            ("gelu_seq", lambda x: jaxbwd.gelu(x), (x,), (P("data", "model", None),), True),
            ("bias_add_tp", lambda x, b: jaxbwd.bias_add(x, b), (x, b), (hid, P("model")), True),
            ("rope_tp", lambda x: jaxbwd.rope(x), (q,), (heads,), True),
            ("attention_tp", lambda q, k, v: jaxbwd.dot_product_attention(q, k, v, is_causal=True),
             (q, kk, v), (heads,) * 3, True),
            # a dense mask with a keyless row and a zero key length: those rows take mean(v) over
            # the sharded kv heads, broadcast to the q heads of each group
            ("attention_tp_mask_lengths", lambda q, k, v: jaxbwd.dot_product_attention(
                q, k, v, mask=jnp.tril(jnp.ones((8, 8), bool), -1)[None, None],
                key_value_seq_lengths=jnp.array([8, 0, 5, 8, 8, 8, 8, 8])), (q, kk, v), (heads,) * 3, True),
            # vmap over an extra leading axis of an op under the mesh
            ("vmap_rms_norm", jax.vmap(lambda x, w: jaxbwd.rms_norm(x, w), in_axes=(0, None)),
             (r(2, 8, 4, 32), w), (P(None, "data", None, None), P()), True),
        ]
        # layouts an op cannot split: that dimension is gathered, the rest stays sharded
        cases += [
            ("rms_norm_hidden_sharded", lambda x, w: jaxbwd.rms_norm(x, w), (x, w),
             (P("data", None, "model"), P("model")), "gather"),
            ("softmax_axis_sharded", lambda x: jaxbwd.softmax(x, axis=1), (x,), (P("data", "model", None),), "gather"),
            ("attention_seq_sharded", lambda q, k, v: jaxbwd.dot_product_attention(q, k, v, is_causal=True),
             (q, kk, v), (P("data", "model", None, None),) * 3, "gather"),
            # nothing sharded: the op runs whole on every device
            ("cross_entropy_replicated", lambda l, y: jaxbwd.cross_entropy(l, y), (r(8, 4, 64), labels), (P(), P()), "gather"),
            ("conv2d_replicated", lambda x, w: jaxbwd.conv2d(x, w, padding=1), (r(8, 5, 5, 4), r(3, 3, 4, 8)),
             (P(), P()), "gather"),
            *([("gqa_flat_projections_uneven_heads",  # 2 kv heads over model=2 or 4: XLA may split
                 lambda q, k: jaxbwd.dot_product_attention(q.reshape(8, 8, 4, 8), k.reshape(8, 8, 2, 8),
                                                           k.reshape(8, 8, 2, 8), is_causal=True),
                 (r(8, 8, 32), r(8, 8, 16)), (P("data", None, "model"),) * 2, "gather")] if auto else []),
            # masks on global element positions: the kernels run whole (explicit axes; under
            # Auto axes XLA gathers around them itself)
            *([("dropout", lambda x: jaxbwd.dropout(x, 0.3, rng=jax.random.key(3)), (x,), (rows,), "gather"),
               # a user op with a kernel and no sharding signature: gathered, run whole
               ("user_op_no_signature", lambda x: unsigned(x), (x,), (rows,), "gather"),
               ("bias_dropout_add", lambda x, b, h: jaxbwd.bias_dropout_add(x, b, h, 0.3, rng=jax.random.key(4)),
                (x, b, r(8, 4, 32)), (rows, P(), rows), "gather")] if not auto else []),
            ("mqa_heads_sharded", lambda q, k, v: jaxbwd.dot_product_attention(q, k, v),
             (q, r(8, 8, 1, 16), r(8, 8, 1, 16)), (heads, P("data"), P("data")), "gather"),
            # operands sharded differently (a residual stream beside a column-parallel
            # branch): each gradient comes back in its own operand's sharding, which for x
            # (replicated over "model") takes a gather, as jnp's add does
            *([("residual_add_mixed_shardings", lambda x, a: jaxbwd.residual_add(x, a), (x, r(8, 4, 32)),
                (P("data", None, None), hid), "gather")] if not auto else []),
        ]
    return cases


def _worker(mesh_name):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    import jaxbwd

    shape, auto = MESHES[mesh_name], mesh_name.endswith("-auto")
    names = ("data", "model")[: len(shape)]
    mesh = jax.make_mesh(shape, names, axis_types=((AxisType.Auto if auto else AxisType.Explicit),) * len(shape))
    results = []
    for implementation in ("xla", "pallas"):
        with jaxbwd.config.use(implementation=implementation, interpret=True):
            for name, fn, args, specs, _tp in _cases(jnp, jax, P, len(shape), auto):
                diff = [i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.floating)]

                def loss(*a, fn=fn, diff=diff):
                    y = fn(*a)
                    return jnp.sum(jnp.sin(y.astype(jnp.float32))), y

                f = jax.jit(jax.value_and_grad(loss, argnums=diff, has_aux=True))
                (want_l, want_y), want_g = f(*args)
                with jax.set_mesh(mesh):
                    shardings = tuple(NamedSharding(mesh, s) for s in specs)
                    if auto:  # plain jit(in_shardings=...): shardings unknown while tracing
                        f = jax.jit(jax.value_and_grad(loss, argnums=diff, has_aux=True), in_shardings=shardings)
                    sharded = [jax.device_put(a, s) for a, s in zip(args, shardings)]
                    (got_l, got_y), got_g = f(*sharded)
                    lowered = f.lower(*sharded)
                    hlo = lowered.compile().as_text()
                err = max(
                    float(np.max(np.abs(np.asarray(g) - np.asarray(w)) / (1.0 + np.abs(np.asarray(w)))))
                    for g, w in zip((got_l, got_y) + tuple(got_g), (want_l, want_y) + tuple(want_g))
                )
                results.append({
                    "impl": implementation, "op": name, "err": err, "gather_ok": _tp == "gather",
                    "all_gather": "all-gather" in hlo, "y_spec": str(got_y.sharding.spec),
                    "custom_partitioned": lowered.as_text().count("CustomSPMDPartitioning"),
                })
    if len(shape) == 2 and not auto:
        results += _explicit_extras(jax, jnp, np, P, mesh)
    if auto and len(shape) == 2:
        results += _auto_derivatives(jax, jnp, np, P, mesh) + _auto_export_and_remat(jax, jnp, np, P, mesh)
    print("RESULTS " + json.dumps(results))


def _auto_derivatives(jax, jnp, np, P, mesh):
    """Forward mode and second order under Auto axes: values equal the single-device ones.
    custom_partitioning has no AD rule, so what these differentiate (the op's tangent rule,
    the derivative of its forward and backward) runs as plain code that XLA partitions."""
    import jaxbwd
    from jaxbwd.vjp._derivatives import FORWARD_MODE
    from jax.sharding import NamedSharding

    k = jax.random.split(jax.random.key(3), 4)
    x, w = jax.random.normal(k[0], (8, 4, 32)), 1.0 + 0.1 * jax.random.normal(k[1], (32,))
    logits, labels = jax.random.normal(k[2], (8, 4, 64)), jax.random.randint(k[3], (8, 4), 0, 64)
    tx, tw = jnp.cos(x), jnp.sin(w)
    norm_loss = lambda x, w: jnp.sum(jnp.sin(jaxbwd.rms_norm(x, w)))  # noqa: E731
    ce_loss = lambda l, y: jaxbwd.cross_entropy(l, y, label_smoothing=0.1)  # noqa: E731
    cases = [  # (name, fn, args, specs); fn returns one array
        ("auto_grad_grad_rms_norm", lambda x, w: jax.grad(lambda x, w: jnp.sum(jax.grad(norm_loss, argnums=(0, 1))(x, w)[1] ** 2))(x, w),
         (x, w), (P("data", "model"), P())),
        ("auto_grad_grad_cross_entropy_vocab", jax.grad(lambda l, y: jnp.sum(jnp.sin(jax.grad(ce_loss)(l, y)))),
         (logits, labels), (P("data", None, "model"), P("data"))),
    ]
    if FORWARD_MODE:
        cases += [
            ("auto_jvp_rms_norm", lambda x, w: jax.jvp(lambda x, w: jaxbwd.rms_norm(x, w), (x, w), (tx, tw))[1],
             (x, w), (P("data", "model"), P())),
            ("auto_hvp_rms_norm", lambda x, w: jax.jvp(lambda x: jax.grad(norm_loss)(x, w), (x,), (tx,))[1],
             (x, w), (P("data", "model"), P())),
        ]
    out = []
    for implementation in ("xla", "pallas"):
        with jaxbwd.config.use(implementation=implementation, interpret=True):
            for name, fn, args, specs in cases:
                want = jax.jit(fn)(*args)
                with jax.set_mesh(mesh):
                    shardings = tuple(NamedSharding(mesh, s) for s in specs)
                    f = jax.jit(fn, in_shardings=shardings)
                    sharded = [jax.device_put(a, s) for a, s in zip(args, shardings)]
                    got = f(*sharded)
                    lowered = f.lower(*sharded)
                err = float(np.max(np.abs(np.asarray(got) - np.asarray(want)) / (1.0 + np.abs(np.asarray(want)))))
                out.append({"impl": implementation, "op": name, "err": err, "gather_ok": True, "all_gather": False,
                            "y_spec": str(got.sharding.spec), "replicated_ok": True,
                            "custom_partitioned": lowered.as_text().count("CustomSPMDPartitioning")})
    return out


def _auto_export_and_remat(jax, jnp, np, P, mesh):
    """Under Auto axes: jax.export (symbolic batch with the default settings; static shapes,
    serialized and called back, with custom_partitioning off), and save_ops seeing the
    custom-partitioned op by its name."""
    import jaxbwd
    from jax import export
    from jax.sharding import NamedSharding
    from test_checkpoint_policies import saved_residuals  # this file runs as a script from tests/

    from jaxbwd.checkpoint_policies import save_ops
    from jaxbwd.vjp._derivatives import FORWARD_MODE

    k = jax.random.split(jax.random.key(4), 2)
    x, w = jax.random.normal(k[0], (8, 4, 32)), 1.0 + 0.1 * jax.random.normal(k[1], (32,))
    shardings = (NamedSharding(mesh, P("data")), NamedSharding(mesh, P()))
    grad = jax.grad(lambda x, w: jnp.sum(jnp.sin(jaxbwd.rms_norm(x, w))), argnums=(0, 1))
    row = lambda op, err, **kw: dict({"op": op, "err": err, "gather_ok": True, "all_gather": False,  # noqa: E731
                                      "y_spec": "P()", "replicated_ok": True, "custom_partitioned": 0}, **kw)
    out = []
    for implementation in ("xla", "pallas"):
        with jaxbwd.config.use(implementation=implementation, interpret=True):
            want = jax.jit(grad)(x, w)
            with jax.set_mesh(mesh):
                sharded = [jax.device_put(a, s) for a, s in zip((x, w), shardings)]
                with jaxbwd.config.use(custom_partitioning=False):
                    exp = export.export(jax.jit(grad, in_shardings=shardings))(*sharded)
                got = export.deserialize(exp.serialize()).call(*sharded)
                out.append(row("auto_export_serialized", _max_rel(np, got, want), impl=implementation))
                if implementation == "xla":  # symbolic shapes take the XLA formulas
                    b, = export.symbolic_shape("8*b")  # divisible by any mesh axis here
                    spec = [jax.ShapeDtypeStruct((b, 4, 32), x.dtype, sharding=shardings[0]),
                            jax.ShapeDtypeStruct((32,), w.dtype, sharding=shardings[1])]
                    got = export.export(jax.jit(grad))(*spec).call(*sharded)
                    out.append(row("auto_export_symbolic", _max_rel(np, got, want), impl=implementation))
                if FORWARD_MODE:
                    block = lambda x, w, policy: jnp.sum(jax.checkpoint(  # noqa: E731
                        lambda x: jnp.sin(jaxbwd.rms_norm(jnp.sin(x), w)), policy=policy)(x))
                    saved = len(saved_residuals(lambda x, w: block(x, w, save_ops("rms_norm")), *sharded))
                    baseline = len(saved_residuals(
                        lambda x, w: block(x, w, jax.checkpoint_policies.nothing_saveable), *sharded))
                    out.append(row("auto_save_ops", 0.0, impl=implementation, saved_more=saved > baseline))
    return out


def _max_rel(np, got, want):
    return max(float(np.max(np.abs(np.asarray(g) - np.asarray(v)) / (1.0 + np.abs(np.asarray(v)))))
               for g, v in zip(got, want))


def _explicit_extras(jax, jnp, np, P, mesh):
    """Second derivatives through a vocab-parallel loss, and ops inside a user's shard_map
    that is manual over "data" only (they partition over the still-explicit "model")."""
    import jaxbwd

    k = jax.random.split(jax.random.key(2), 3)
    logits, w = jax.random.normal(k[0], (8, 4, 64)), jax.random.normal(k[1], (32,))
    labels = jax.random.randint(k[2], (8, 4), 0, 64)
    x = logits[..., :32]
    ce = lambda l, y: jaxbwd.cross_entropy(l, y, label_smoothing=0.1)  # noqa: E731
    gg = jax.grad(lambda l, y: jnp.sum(jnp.sin(jax.grad(ce)(l, y))))
    body = lambda l, y, x, w: jaxbwd.cross_entropy(l, y, reduction="none") + jnp.sum(jaxbwd.rms_norm(x, w), -1)  # noqa: E731
    # a user's vma-checked shard_map: w is invariant, its gradient the psum over "data"
    vma_loss = lambda sm: (lambda x, w: jnp.sum(jnp.sin(sm(x, w))))  # noqa: E731
    user_sm = jax.shard_map(lambda x, w: jaxbwd.rms_norm(x, w), in_specs=(P("data"), P()), out_specs=P("data"),
                            check_vma=True)
    vm = jax.vmap(jax.grad(lambda x, w: jnp.sum(jnp.sin(jaxbwd.rms_norm(x, w))), argnums=(0, 1)), in_axes=(0, None))
    # manual over "data", x not sharded over the still-explicit "model": the op runs replicated there
    partial_sm = lambda vma: jax.grad(vma_loss(jax.shard_map(  # noqa: E731
        lambda x, w: jaxbwd.rms_norm(x, w), in_specs=(P("data"), P()), out_specs=P("data"), axis_names={"data"},
        check_vma=vma)))
    cases = [  # (name, fn under the mesh, the same on one device, args, specs)
        # vmap over a dimension sharded on "data" around an op sharding its rows on "model"
        ("vmap_sharded_axis_rms_norm", lambda x, w: vm(x, w)[0], lambda x, w: vm(x, w)[0],
         (logits.reshape(4, 8, 64), jnp.concatenate([w, w])), (P("data", "model"), P())),
        ("user_shard_map_vma_weight_grad", jax.grad(vma_loss(user_sm), argnums=1),
         jax.grad(vma_loss(lambda x, w: jaxbwd.rms_norm(x, w)), argnums=1), (x, w), (P("data"), P())),
        ("cross_entropy_vocab_grad_grad", gg, gg, (logits, labels), (P("data", None, "model"), P("data"))),
        ("partial_shard_map_ops",
         jax.shard_map(body, in_specs=(P("data"), P("data"), P("data"), P()), out_specs=P("data"), axis_names={"data"}),
         body, (logits, labels, x, w), (P("data", None, "model"), P("data"), P("data", "model"), P())),
        ("partial_shard_map_replicated_grad", partial_sm(False), jax.grad(vma_loss(jaxbwd.rms_norm)), (x, w),
         (P("data"), P())),
        ("partial_shard_map_replicated_vma_grad", partial_sm(True), jax.grad(vma_loss(jaxbwd.rms_norm)), (x, w),
         (P("data"), P())),
    ]
    out = []
    for implementation in ("xla", "pallas"):
        with jaxbwd.config.use(implementation=implementation, interpret=True):
            for name, fn, ref, args, specs in cases:
                if implementation == "pallas" and name.endswith(("grad_grad", "vma_weight_grad", "vma_grad",
                                                                 "sharded_axis_rms_norm")):
                    continue  # a kernel backward has no derivative; interpret mode cannot run vma-checked
                    # or a vmap over a sharded axis (JAX's interpreter; GPU untested)
                want = jax.jit(ref)(*args)
                with jax.set_mesh(mesh):
                    sharded = [jax.device_put(a, s) for a, s in zip(args, specs)]
                    got = jax.jit(fn)(*sharded)
                    hlo = jax.jit(fn).lower(*sharded).compile().as_text()
                err = float(np.max(np.abs(np.asarray(got) - np.asarray(want)) / (1.0 + np.abs(np.asarray(want)))))
                out.append({"impl": implementation, "op": name, "err": err, "gather_ok": False,
                            "all_gather": "all-gather" in hlo, "y_spec": str(got.sharding.spec), "custom_partitioned": 0,
                            "replicated_ok": name.endswith("weight_grad")})
    return out


def _run(mesh_name):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), mesh_name], env=env, capture_output=True, text=True, timeout=1200
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULTS ")][-1]
    return json.loads(line[len("RESULTS "):])


def _requirements():
    import jax

    missing = [n for n in ("set_mesh", "shard_map", "typeof") if not hasattr(jax, n)]
    if not hasattr(jax.sharding, "AxisType") or not hasattr(jax.sharding, "reshard"):
        missing.append("sharding.AxisType/reshard")
    return missing


# 4x2 and 2x4-auto run the same code as 2x4 and 4x2-auto with the axes' sizes swapped
# (each is ~3 minutes on 2 CPU cores): JAXBWD_TEST_ALL_MESHES=1 runs them too.
CI_MESHES = tuple(MESHES) if os.environ.get("JAXBWD_TEST_ALL_MESHES") == "1" else ("8", "2x4", "4x2-auto")


@pytest.mark.parametrize("mesh_name", CI_MESHES)
def test_ops_partition_without_gathering(mesh_name):
    missing = _requirements()
    if missing:
        pytest.skip(f"explicit sharding needs jax.{', jax.'.join(missing)}, absent in jax here")
    results = _run(mesh_name)
    assert len(results) >= 24
    bad = [r for r in results if not r["err"] <= 1e-5]  # NaN fails too  # |got - want| <= 1e-5 * (1 + |want|)
    assert not bad, f"sharded run differs from the single-device run: {bad}"
    # jax 0.10's partitioner all-gathers around these (vmap over a sharded axis, partially
    # manual shard_maps; values still checked above); from jax 0.11 on nothing may gather.
    # The README's "Multiple devices" says so.
    import jax

    old_jax = tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 11)
    gathers_on_old_jax = ({"vmap_sharded_axis_rms_norm", "partial_shard_map_ops", "partial_shard_map_replicated_grad"}
                          if old_jax else set())
    gathered = [r for r in results if r["all_gather"] and not r["gather_ok"] and r["op"] not in gathers_on_old_jax]
    assert not gathered, f"compiled HLO gathers activations: {gathered}"
    # a reduced loss is a replicated scalar; embed_vocab's ids are replicated, so are its rows
    unsharded = [r for r in results if r["y_spec"] != "P()" and r["op"] != "embed_vocab"
                 and not r["op"].endswith("_replicated") and not r.get("replicated_ok") and "data" not in r["y_spec"]]
    if "x" in mesh_name and not mesh_name.endswith("-auto"):
        extras = {(r["impl"], r["op"]) for r in results}
        assert {("xla", "cross_entropy_vocab_grad_grad"), ("pallas", "partial_shard_map_ops"),
                ("pallas", "partial_shard_map_replicated_grad"), ("xla", "partial_shard_map_replicated_vma_grad"),
                ("xla", "user_shard_map_vma_weight_grad"), ("xla", "vmap_sharded_axis_rms_norm")} <= extras
    assert not unsharded, f"outputs lost their sharding: {unsharded}"
    if mesh_name.endswith("-auto") and "x" in mesh_name:
        from jaxbwd.vjp._derivatives import FORWARD_MODE

        derivs = {r["op"] for r in results if r["op"].startswith("auto_")}
        want = {"auto_grad_grad_rms_norm", "auto_grad_grad_cross_entropy_vocab", "auto_export_serialized",
                "auto_export_symbolic"}
        forward = {"auto_jvp_rms_norm", "auto_hvp_rms_norm", "auto_save_ops"} if FORWARD_MODE else set()
        assert want | forward == derivs, derivs
        not_saved = [r["impl"] for r in results if r["op"] == "auto_save_ops" and not r["saved_more"]]
        assert not not_saved, f"save_ops saved nothing more than nothing_saveable under Auto axes: {not_saved}"
    if mesh_name.endswith("-auto"):
        # Auto axes: every op reaches XLA's partitioner as a custom_partitioning call,
        # forward and backward (matmul and dense-mask attention are XLA's own code; vmap runs
        # unpartitioned)
        ops = [r for r in results if not r["op"].startswith(("matmul", "vmap", "auto_", "attention_tp_mask"))]
        missed = [(r["impl"], r["op"]) for r in ops if r["custom_partitioned"] < 2]
        assert ops and not missed, f"ops not custom-partitioned under Auto axes: {missed}"


def test_mixed_meshes_refused_and_operand_meshes_used():
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, PartitionSpec as P

    import jaxbwd

    if not hasattr(jax, "set_mesh"):
        pytest.skip("jax.set_mesh absent in this jax")
    mesh = jax.make_mesh((1, 1), ("a", "b"), axis_types=(AxisType.Explicit, AxisType.Auto), devices=jax.devices()[:1])
    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.ones((4, 8)), P("a"))
        with pytest.raises(ValueError, match=r"jaxbwd\.rms_norm: .*mixes axis types"):
            jaxbwd.rms_norm(x, jnp.ones((8,)))
        jaxbwd.rms_norm(jnp.ones((4, 8)), jnp.ones((8,)))  # nothing sharded: runs
    explicit = jax.make_mesh((1,), ("a",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:1])
    x = jax.device_put(jnp.ones((4, 8)), jax.sharding.NamedSharding(explicit, P("a")))
    # explicitly sharded operands and no mesh set: the op takes the operands' mesh
    y = jax.jit(lambda x: jaxbwd.rms_norm(x, jnp.ones((8,))))(x)
    assert y.sharding.spec[0] == "a"
    # matmul's wgrad contracts over the sharded rows: it needs that mesh too
    dw = jax.jit(jax.grad(lambda x, w: jnp.sum(jaxbwd.matmul(x, w)), argnums=1))(x, jnp.ones((8, 3)))
    np.testing.assert_allclose(np.asarray(dw), 4.0)
    # a reduced loss over sharded rows: per-row losses per shard, then the mean, on that mesh too
    logits = jnp.arange(32.0).reshape(4, 8) / 7
    labels = jnp.array([0, 3, -100, 7])
    for reduction in ("mean", "sum"):
        want = jax.value_and_grad(lambda l: jaxbwd.cross_entropy(l, labels, reduction=reduction))(logits)
        got = jax.jit(jax.value_and_grad(lambda l: jaxbwd.cross_entropy(l, labels, reduction=reduction)))(
            jax.device_put(logits, jax.sharding.NamedSharding(explicit, P("a"))))
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-7, err_msg=reduction)


def test_symbolic_shapes_sharded_on_an_explicit_mesh_are_refused_by_name():
    """JAX exports such a module but cannot call it (plain jnp: "Error refining shapes"; an
    op's shard_map crashed the process): refused while exporting, naming the op. Replicated
    operands still export."""
    import jax
    import jax.numpy as jnp
    from jax import export
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    import jaxbwd

    if not hasattr(jax, "set_mesh"):
        pytest.skip("jax.set_mesh absent in this jax")
    mesh = jax.make_mesh((1,), ("a",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:1])
    b, = export.symbolic_shape("b")
    with jax.set_mesh(mesh):
        w = jax.ShapeDtypeStruct((16,), jnp.float32, sharding=NamedSharding(mesh, P()))
        for spec, fn in ((P("a"), jaxbwd.rms_norm), (P("a"), lambda x, w: jaxbwd.softmax(x) * w)):
            x = jax.ShapeDtypeStruct((b, 16), jnp.float32, sharding=NamedSharding(mesh, spec))
            with pytest.raises(ValueError, match=r"jaxbwd\.(rms_norm|softmax): got an operand sharded on an "
                                                 r"explicit mesh with symbolic shapes"):
                export.export(jax.jit(fn))(x, w)
        x = jax.ShapeDtypeStruct((b, 16), jnp.float32, sharding=NamedSharding(mesh, P()))
        export.export(jax.jit(jaxbwd.rms_norm))(x, w)


# ------------------------------------------------ inside a user's vma-checked shard_map
def _user_shard_map_cases(jnp, jax):
    """(name, fn(x, *weights), x [2, ...] (split over the manual axis), weights (replicated))."""
    import jaxbwd

    k = iter(jax.random.split(jax.random.key(1), 32))
    r = lambda *s: jax.random.normal(next(k), s, jnp.float32)  # noqa: E731
    return [
        ("rms_norm", lambda x, w: jaxbwd.rms_norm(x, w), r(2, 4, 32), (r(32),)),
        ("layer_norm", lambda x, w, b: jaxbwd.layer_norm(x, w, b), r(2, 4, 32), (r(32), r(32))),
        ("bias_add", lambda x, b: jaxbwd.bias_add(x, b), r(2, 4, 32), (r(32),)),
        ("group_norm", lambda x, w, b: jaxbwd.group_norm(x, w, b, num_groups=2), r(2, 3, 3, 8), (r(8), r(8))),
        ("conv2d", lambda x, w: jaxbwd.conv2d(x, w, padding=1), r(2, 4, 4, 3), (r(3, 3, 3, 4),)),
        ("embed", lambda x, t: jaxbwd.embed((jnp.abs(x[..., 0]) * 10).astype(jnp.int32), t) * x[..., :1],
         r(2, 4, 8), (r(16, 8),)),
        ("attention", lambda q, k: jaxbwd.dot_product_attention(q, k, k, is_causal=True), r(2, 8, 2, 16),
         (r(2, 8, 2, 16),)),
        ("cross_entropy", lambda x, w: jaxbwd.cross_entropy(x * w, jnp.zeros(x.shape[:-1], jnp.int32), reduction="none"),
         r(2, 4, 32), (r(32),)),
        # XLA-only ops, and the XLA path's vocabulary scans (their carries must vary as x does)
        ("matmul", lambda x, w: jaxbwd.matmul(x, w), r(2, 4, 32), (r(32, 8),)),
        ("residual_add", lambda x, b: jaxbwd.residual_add(x, b), r(2, 4, 32), (r(32),)),
        ("linear_cross_entropy", lambda x, w: jaxbwd.linear_cross_entropy(
            x, w, (jnp.abs(x[..., 0]) * 10).astype(jnp.int32) % 16, reduction="none", label_smoothing=0.1),
         r(2, 4, 32), (r(32, 16),)),
    ]


def test_ops_inside_vma_checked_shard_map():
    """Inside ``jax.shard_map(..., check_vma=True)`` an op mixes a varying activation with
    an invariant weight: the weight's gradient must be the psum of the per-device ones.
    The out_specs declare the weights' gradients invariant, which shard_map accepts only if
    that psum is there; on a manual axis of size 1 the values (XLA path, run on one CPU
    device, against the plain run) cannot tell a psum from none, so this checks typing and
    values, not the size of the sum (the 8-device worker checks the sum, ``user_shard_map_vma_weight_grad``). Pallas path:
    lowered for CUDA (interpret mode cannot run under vma checking), kernels present."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    import jaxbwd
    from jaxbwd.pallas import _common as C

    if not hasattr(jax.lax, "pcast"):
        pytest.skip("jax.lax.pcast absent in this jax")
    cpu = jax.make_mesh((1,), ("i",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])
    for name, fn, x, ws in _user_shard_map_cases(jnp, jax):
        def loss(x, *ws, fn=fn):
            return jnp.sum(jnp.sin(fn(x, *ws)))

        def sharded(mesh, axis, loss=loss, n=len(ws)):
            # x varies over the manual axis, the weights do not: the loss is a psum, and the
            # weights' grads must come back invariant (summed over the axis)
            def body(x, *ws):
                x = jax.lax.pcast(x, axis, to="varying") if not jax.typeof(x).manual_axis_type.varying else x
                total = lambda x, *ws: jax.lax.psum(loss(x, *ws), axis)  # noqa: E731
                return (total(x, *ws),) + tuple(jax.grad(total, argnums=tuple(range(n + 1)))(x, *ws))
            x_spec = P(axis) if axis == "i" else P()  # the abstract CUDA mesh is explicit: replicated in, varied inside
            return jax.shard_map(body, mesh=mesh, in_specs=(x_spec,) + (P(),) * n,
                                 out_specs=(P(),) + (P(axis),) + (P(),) * n, check_vma=True)

        with jaxbwd.config.use(implementation="xla"):
            want = (loss(x, *ws),) + tuple(jax.grad(loss, argnums=tuple(range(len(ws) + 1)))(x, *ws))
            got = jax.jit(sharded(cpu, "i"))(x, *ws)
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5, err_msg=name)
        with jaxbwd.config.use(implementation="pallas", interpret=False), C.abstract_gpu() as gpu:
            names = C.triton_kernel_names(C.lower_for_gpu(sharded(gpu, gpu.axis_names[0]), x, *ws))
        assert bool(names) == (name not in ("matmul", "residual_add")), \
            f"{name}: Pallas kernels lowered inside the vma-checked shard_map: {names}"  # those two have none



def test_interpreted_kernels_under_vma_checking_fail_by_the_ops_name():
    """JAX's Pallas interpreter cannot run inside a vma-checked shard_map; a kernel backward
    there says so by the op's name (the GPU lowering is checked above), while an op whose
    backward has no kernel (avg_pool2d, XLA by design) still runs."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import jaxbwd

    if not hasattr(jax.lax, "pcast"):
        pytest.skip("jax.lax.pcast absent in this jax")
    cpu = jax.make_mesh((1,), ("i",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 4, 4, 8))

    def grad_in_shard_map(op):
        body = jax.grad(lambda x: jax.lax.psum(jnp.sum(op(x)), "i"))
        return jax.jit(jax.shard_map(body, mesh=cpu, in_specs=P("i"), out_specs=P("i"), check_vma=True))(x)

    with jaxbwd.config.use(implementation="pallas", interpret=True):
        with pytest.raises(NotImplementedError, match=r"jaxbwd\.rms_norm: the Pallas backward cannot run in "
                                                      r"interpret mode inside a jax\.shard_map with check_vma=True"):
            grad_in_shard_map(lambda x: jaxbwd.rms_norm(x, jnp.ones(8)))
        # Forward kernels too (cross_entropy's and attention's): they failed inside JAX's
        # Pallas interpreter with "Primitive gather requires varying manual axes to match".
        labels = jnp.zeros((2, 4, 4), jnp.int32)
        fwd = lambda f: jax.jit(jax.shard_map(f, mesh=cpu, in_specs=P("i"), out_specs=P("i"),  # noqa: E731
                                              check_vma=True))(x)
        for name, f in [("cross_entropy", lambda x: jaxbwd.cross_entropy(x, labels, reduction="none")),
                        ("dot_product_attention", lambda x: jaxbwd.dot_product_attention(x, x, x)),
                        ("dot_product_attention", lambda x: jax.jvp(jaxbwd.dot_product_attention, (x, x, x),
                                                                    (x, x, x))[1])]:
            with pytest.raises(NotImplementedError, match=rf"jaxbwd\.{name}: the Pallas forward cannot run in "
                                                          r"interpret mode inside a jax\.shard_map"):
                fwd(f)
        got = grad_in_shard_map(lambda x: jaxbwd.avg_pool2d(x, 2))
    assert jnp.allclose(got, jax.grad(lambda x: jnp.sum(jaxbwd.avg_pool2d(x, 2)))(x))


if __name__ == "__main__":
    _worker(sys.argv[1])
