"""Vision ops (conv2d, upsample2d, pixel_shuffle, unpatchify) and group_norm: the cases the
registry's contract does not cover. Pallas kernels run in interpret mode (conftest)."""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxbwd import config, reference
from jaxbwd.pallas import _common as C
from jaxbwd.vjp.group_norm import group_norm
from jaxbwd.vjp.vision import conv2d, pixel_shuffle, unpatchify, upsample2d

IMPLS = ("xla", "pallas")


def _normal(seed, shape, dtype=jnp.float32, scale=1.0):
    return (scale * jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32)).astype(dtype)


def _check_vjp(f, ref, args, tol=1e-5, kernels=()):
    """Forward and vjp of ``f`` equal those of ``ref`` (autodiff) for a random cotangent.

    XLA-only sides run as one jitted program (eager op-by-op dispatch would dominate the
    time); interpreted kernels run eagerly (compiling the interpreter's loops costs more).
    """
    shape = jax.eval_shape(f, *args)
    ct = _normal(99, shape.shape, shape.dtype)

    def run(fn, jit):
        both = lambda *a: (fn(*a), jax.vjp(fn, *a)[1](ct))
        return (jax.jit(both) if jit else both)(*args)

    (out, got), (want, exp) = run(f, not kernels), run(ref, True)
    scale = max(1.0, float(jnp.max(jnp.abs(want))))
    chex.assert_trees_all_close(out, want, atol=tol * scale, rtol=tol)
    for g, e, a in zip(got, exp, args):
        assert g.dtype == a.dtype and g.shape == a.shape
        s = max(1.0, float(jnp.max(jnp.abs(e))))
        chex.assert_trees_all_close(g, e, atol=tol * s, rtol=tol)
    if kernels:
        text = str(jax.make_jaxpr(lambda *a: jax.vjp(f, *a)[1](ct))(*args))
        for k in kernels:
            assert f"name={k}" in text


# --------------------------------------------------------------------------- conv2d
CONV_CASES = [
    # (x shape, w shape, kwargs); 3x3 / stride 1 / padding 1 is the registry's contract example.
    ((2, 9, 11, 4), (1, 1, 4, 8), {}),
    ((2, 9, 11, 4), (3, 3, 4, 8), {"stride": 2, "padding": 1}),
    ((1, 10, 11, 3), (5, 5, 3, 4), {"stride": 2, "padding": "SAME"}),
    ((1, 10, 11, 3), (7, 7, 3, 4), {"stride": (2, 1), "padding": ((3, 2), (1, 3))}),
    ((1, 9, 11, 4), (3, 3, 4, 6), {"dilation": 2, "padding": (1, 2)}),
    ((1, 9, 11, 4), (3, 3, 2, 6), {"groups": 2, "stride": 2, "padding": "VALID"}),
    ((1, 9, 11, 4), (3, 3, 1, 4), {"groups": 4, "padding": 1, "stride": 2}),  # depthwise
    ((1, 10, 11, 4), (3, 3, 1, 8), {"groups": 4, "padding": 1}),  # depthwise, multiplier 2
]


def _conv_id(c):
    return f"{'x'.join(map(str, c[0]))}*{'x'.join(map(str, c[1]))}-{c[2]}"


# The XLA path is lax's own transposes; three cases cover it (the kernels get all of them).
CONV_IMPL_CASES = [pytest.param(c, "pallas", id=_conv_id(c) + "-pallas") for c in CONV_CASES] + [
    pytest.param(CONV_CASES[i], "xla", id=_conv_id(CONV_CASES[i]) + "-xla") for i in (1, 5, 6)
]


@pytest.mark.parametrize("case,impl", CONV_IMPL_CASES)
def test_conv2d_matches_autodiff_of_lax_conv(case, impl):
    xs, ws, kw = case
    x, w = _normal(0, xs), _normal(1, ws, scale=0.3)
    kernels = ("conv2d_dgrad", "conv2d_wgrad") if impl == "pallas" else ()
    _check_vjp(
        lambda x, w: conv2d(x, w, **kw, implementation=impl),
        lambda x, w: reference.conv2d(x, w, **kw), (x, w), kernels=kernels,
    )


def test_conv2d_bf16_strided_depthwise_pallas():
    x, w = _normal(0, (2, 10, 11, 4), jnp.bfloat16), _normal(1, (3, 3, 1, 4), jnp.bfloat16, 0.3)
    kw = dict(stride=2, padding="SAME", groups=4)
    out, vjp = jax.vjp(lambda x, w: conv2d(x, w, **kw, implementation="pallas"), x, w)
    ct = _normal(2, out.shape, jnp.bfloat16)
    _, vjp32 = jax.vjp(lambda x, w: reference.conv2d(x, w, **kw), x.astype(jnp.float32), w.astype(jnp.float32))
    for g, e in zip(vjp(ct), vjp32(ct.astype(jnp.float32))):
        assert g.dtype == jnp.bfloat16
        s = max(1.0, float(jnp.max(jnp.abs(e))))
        chex.assert_trees_all_close(g.astype(jnp.float32), e, atol=2e-2 * s, rtol=2e-2)


@pytest.mark.parametrize("kw", [{"padding": 1}, {"stride": 2, "padding": 1, "dilation": (2, 1)}])
def test_conv2d_pallas_table_tiles_multi_block(kw):
    """The tuning table's 128 x 128 tiles with more channels than one tile: two input-channel
    blocks (the second a tail), three 64-channel K blocks per tap in dgrad's flat loop, two
    output-channel tiles in wgrad; strided + dilated taps walked per phase."""
    x, w = _normal(0, (1, 6, 7, 160), jnp.float32), _normal(1, (3, 3, 160, 144), scale=0.05)
    _check_vjp(lambda x, w: conv2d(x, w, **kw, implementation="pallas"),
               lambda x, w: reference.conv2d(x, w, **kw), (x, w), kernels=("conv2d_dgrad", "conv2d_wgrad"))


def test_conv2d_pallas_small_tiles_split_k():
    """16 x 16 x 16 tiles: several pixel blocks with a tail, channel tails, (tap, channel) K
    steps, groups, and wgrad's pixel reduction split over three programs per tile."""
    from jaxbwd.pallas import _tuning

    x, w = _normal(0, (2, 9, 11, 20)), _normal(1, (3, 3, 10, 24), scale=0.2)
    kw = dict(padding=(1, 2), dilation=(1, 2), groups=2)  # Ho x Wo = 9 x 11
    tiles = {"block_m": 16, "block_n": 16, "block_k": 16}
    with _tuning.use({"sm_90": {"conv2d_dgrad": tiles, "conv2d_wgrad": {**tiles, "blocks_per_sm": 1}}}), \
            pytest.MonkeyPatch.context() as mp:
        mp.setattr(_tuning.C, "num_sms", lambda: 100)
        cfg = _tuning.conv("conv2d_wgrad", jnp.float32, False)
        # 18 (tap, group) tiles, 198 output pixels in 13 blocks: the kernel's own call.
        nbytes = 4 * (x.size + 2 * 9 * 11 * 24)
        assert _tuning.split(18, 13, cfg, max_waves=4, min_steps=4, max_split=nbytes // (4 * 90 * 24)) == 3
        _check_vjp(lambda x, w: conv2d(x, w, **kw, implementation="pallas"),
                   lambda x, w: reference.conv2d(x, w, **kw), (x, w), kernels=("conv2d_dgrad", "conv2d_wgrad"))


def test_conv2d_xla_backward_in_input_dtype():
    """The XLA path's dgrad and wgrad are bf16 convolutions (f32 accumulation is the conv's
    own), not f32 convolutions of upcast operands; gradients match f32 autodiff to bf16."""
    x, w = _normal(0, (2, 10, 11, 8), jnp.bfloat16), _normal(1, (3, 3, 4, 8), jnp.bfloat16, 0.3)
    kw = dict(stride=2, padding=1, groups=2)
    ct = _normal(2, (2, 5, 6, 8), jnp.bfloat16)
    bwd = lambda x, w, ct: jax.vjp(lambda x, w: conv2d(x, w, **kw, implementation="xla"), x, w)[1](ct)  # noqa: E731
    convs = [ln for ln in jax.jit(bwd).lower(x, w, ct).as_text().splitlines() if "convolution" in ln]
    assert len(convs) == 2, convs  # dgrad and wgrad (the unused forward is dropped)
    assert all("f32" not in ln for ln in convs), convs
    _, vjp32 = jax.vjp(lambda x, w: reference.conv2d(x, w, **kw), x.astype(jnp.float32), w.astype(jnp.float32))
    for g, e in zip(bwd(x, w, ct), vjp32(ct.astype(jnp.float32))):
        assert g.dtype == jnp.bfloat16
        s = max(1.0, float(jnp.max(jnp.abs(e))))
        chex.assert_trees_all_close(g.astype(jnp.float32), e, atol=2e-2 * s, rtol=2e-2)


@pytest.mark.parametrize("w_batched", [False, True])
def test_conv2d_vmap_pallas(w_batched):
    xb = _normal(0, (2, 1, 9, 11, 4))
    wb = _normal(1, (2, 3, 3, 4, 8), scale=0.3) if w_batched else _normal(1, (3, 3, 4, 8), scale=0.3)
    kw = dict(stride=2, padding=1)
    loss = lambda x, w, impl: jnp.sum(conv2d(x, w, **kw, implementation=impl) ** 2)
    in_axes = (0, 0 if w_batched else None)
    got = jax.vmap(jax.grad(lambda x, w: loss(x, w, "pallas"), argnums=(0, 1)), in_axes=in_axes)(xb, wb)
    want = jax.vmap(jax.grad(lambda x, w: jnp.sum(reference.conv2d(x, w, **kw) ** 2), argnums=(0, 1)), in_axes=in_axes)(xb, wb)
    chex.assert_trees_all_close(got, want, atol=1e-4, rtol=1e-5)


def test_conv2d_bad_inputs():
    x, w = jnp.ones((1, 8, 8, 4)), jnp.ones((3, 3, 4, 8))
    with pytest.raises(ValueError, match=r"conv2d: w must have shape \[kh, kw, Cin/groups=2, Cout\], got \(3, 3, 4, 8\)"):
        conv2d(x, w, groups=2)
    with pytest.raises(ValueError, match=r"conv2d: groups must divide x's channel count Cin=4, got groups=3"):
        conv2d(x, jnp.ones((3, 3, 1, 6)), groups=3)
    with pytest.raises(ValueError, match=r"conv2d: stride must be an int >= 1 or a pair of them, got 0"):
        conv2d(x, w, stride=0)
    with pytest.raises(ValueError, match=r"conv2d: padding must be 'SAME', 'VALID'.*got 'FULL'"):
        conv2d(x, w, padding="FULL")
    with pytest.raises(ValueError, match=r"conv2d: x's padded size must be at least"):
        conv2d(jnp.ones((1, 2, 2, 4)), w)
    with pytest.raises(TypeError, match=r"conv2d: x, w must share one dtype"):
        conv2d(x, w.astype(jnp.bfloat16))


# ----------------------------------------------------------------------- group_norm
GN_CASES = [
    ((2, 5, 7, 24), 4, None),
    ((2, 5, 7, 24), 4, "silu"),
    ((2, 3, 4, 5, 8), 2, "silu"),  # 3-D spatial
    ((3, 11, 12), 3, None),  # 1-D spatial
    ((2, 1100, 8), 2, "silu"),  # several spatial chunks per sample, the last one partial
    ((2, 6, 5), 1, None),  # one group: LayerNorm over (spatial, C)
    # Batch 1, whole-channel [8, 512] tiles: 269 spatial chunks of two tiles each, the last
    # chunk's second tile 4 rows deep.
    ((1, 4300, 512), 32, "silu"),
]


def _gn_id(c):
    return f"{'x'.join(map(str, c[0]))}-g{c[1]}-{c[2]}"


# The XLA formula is the kernel's; two cases check it (the contract runs it on two more).
GN_IMPL_CASES = [pytest.param(c, "pallas", id=_gn_id(c) + "-pallas") for c in GN_CASES] + [
    pytest.param(GN_CASES[i], "xla", id=_gn_id(GN_CASES[i]) + "-xla") for i in (2, 4)
]


@pytest.mark.parametrize("case,impl", GN_IMPL_CASES)
def test_group_norm_matches_autodiff(case, impl):
    shape, G, act = case
    x = _normal(0, shape)
    w = 1.0 + _normal(1, shape[-1:], scale=0.1)
    b = _normal(2, shape[-1:], scale=0.1)
    _check_vjp(
        lambda x, w, b: group_norm(x, w, b, num_groups=G, activation=act, implementation=impl),
        lambda x, w, b: reference.group_norm(x, w, b, num_groups=G, activation=act), (x, w, b),
        kernels=("group_norm_bwd_sums", "group_norm_bwd") if impl == "pallas" else (),
    )


def test_group_norm_bad_inputs():
    x, w = jnp.ones((2, 4, 6)), jnp.ones((6,))
    with pytest.raises(ValueError, match=r"group_norm: num_groups must be a positive divisor of x's channel count C=6, got 4"):
        group_norm(x, w, w, num_groups=4)
    with pytest.raises(ValueError, match=r"group_norm: activation must be None or 'silu', got 'gelu'"):
        group_norm(x, w, w, num_groups=2, activation="gelu")
    with pytest.raises(TypeError, match=r"group_norm: num_groups must be a static Python int, got 2.0"):
        group_norm(x, w, w, num_groups=2.0)


# ----------------------------------------------------------------------- upsample2d
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("method", ["nearest", "bilinear"])
@pytest.mark.parametrize("scale", [2, (2, 3)], ids=str)
def test_upsample2d_odd_sizes(scale, method, impl):
    x = _normal(0, (1, 5, 7, 3))
    _check_vjp(
        lambda x: upsample2d(x, scale, method=method, implementation=impl),
        lambda x: reference.upsample2d(x, scale, method=method), (x,),
        kernels=("upsample2d_bwd",) if impl == "pallas" else (),
    )


def test_upsample2d_bilinear_matches_jax_image_resize():
    x = _normal(0, (2, 4, 6, 5))
    y = upsample2d(x, (3, 2), method="bilinear")
    want = jax.image.resize(x, (2, 12, 12, 5), "bilinear")
    chex.assert_trees_all_close(y, want, atol=2e-6)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("method", ["nearest", "bilinear"])
def test_upsample2d_zero_cotangent_gives_exact_zero(method, impl):
    # Holds by construction for both paths: sums (and weighted sums) of zeros.
    x = _normal(0, (1, 5, 7, 3))
    _, vjp = jax.vjp(lambda x: upsample2d(x, (2, 3), method=method, implementation=impl), x)
    (g,) = vjp(jnp.zeros((1, 10, 21, 3)))
    assert np.array_equal(np.asarray(g), np.zeros(x.shape, np.float32))


def test_upsample2d_bad_inputs():
    with pytest.raises(ValueError, match=r"upsample2d: scale must be an int >= 1 or a pair of them, got 0"):
        upsample2d(jnp.ones((1, 2, 2, 1)), 0)
    with pytest.raises(ValueError, match=r"upsample2d: method must be 'nearest' or 'bilinear', got 'bicubic'"):
        upsample2d(jnp.ones((1, 2, 2, 1)), 2, method="bicubic")


# -------------------------------------------------------------- pixel_shuffle, unpatchify
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("r,N,H,W,Cc", [(3, 2, 2, 3, 2), (2, 2, 3, 5, 3), (2, 1, 1, 2, 1100)],
                         ids=["r3-gather", "r2-interleave", "r2-two-channel-blocks"])
def test_pixel_shuffle_element_order(impl, r, N, H, W, Cc):
    x = _normal(0, (N, H, W, Cc * r * r))
    y = np.asarray(pixel_shuffle(x, r, implementation=impl))
    xn = np.asarray(x)
    for n, h, w, c, i, j in np.ndindex(N, H, W, Cc, r, r):
        assert y[n, h * r + i, w * r + j, c] == xn[n, h, w, c * r * r + i * r + j]
    _check_vjp(lambda x: pixel_shuffle(x, r, implementation=impl), lambda x: reference.pixel_shuffle(x, r), (x,),
               kernels=("pixel_shuffle_bwd",) if impl == "pallas" else ())


def test_pixel_shuffle_channels_not_divisible_raise():
    with pytest.raises(ValueError, match=r"pixel_shuffle: x's channel count must be divisible by upscale_factor\*\*2=4, got 6"):
        pixel_shuffle(jnp.ones((1, 2, 2, 6)), 2)


@pytest.mark.parametrize("impl", IMPLS)
def test_pixel_shuffle_zero_size_batch(impl):
    x = jnp.ones((0, 3, 5, 8))
    y, vjp = jax.vjp(lambda x: pixel_shuffle(x, 2, implementation=impl), x)
    assert y.shape == (0, 6, 10, 2)
    (g,) = vjp(jnp.ones_like(y))
    assert g.shape == x.shape and g.dtype == x.dtype


@pytest.mark.parametrize("impl", IMPLS)
def test_unpatchify_element_order(impl):
    N, gh, gw, p, Cc = 2, 2, 3, 2, 3
    t = _normal(0, (N, gh * gw, p * p * Cc))
    y = np.asarray(unpatchify(t, grid=(gh, gw), patch_size=p, channels=Cc, implementation=impl))
    tn = np.asarray(t)
    for n, gi, gj, i, j, c in np.ndindex(N, gh, gw, p, p, Cc):
        assert y[n, gi * p + i, gj * p + j, c] == tn[n, gi * gw + gj, (i * p + j) * Cc + c]
    kw = dict(grid=(gh, gw), patch_size=p, channels=Cc)
    _check_vjp(lambda t: unpatchify(t, **kw, implementation=impl), lambda t: reference.unpatchify(t, **kw), (t,),
               kernels=("unpatchify_bwd",) if impl == "pallas" else ())


def test_unpatchify_bad_inputs():
    with pytest.raises(ValueError, match=r"unpatchify: tokens.shape\[1\] must equal gh\*gw=4 for grid=\(2, 2\), got 5"):
        unpatchify(jnp.ones((1, 5, 12)), grid=2, patch_size=2, channels=3)
    with pytest.raises(ValueError, match=r"unpatchify: tokens.shape\[2\] must equal patch_size\*\*2 \* channels=12, got 8"):
        unpatchify(jnp.ones((1, 4, 8)), grid=2, patch_size=2, channels=3)


# ------------------------------------------------------------------ lowering for CUDA
def _sds(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


LOWERING = [
    ("conv3x3-unet", lambda x, w: conv2d(x, w, padding=1, implementation="pallas"),
     (_sds((8, 64, 64, 320)), _sds((3, 3, 320, 320))), ("conv2d_dgrad", "conv2d_wgrad")),
    ("conv3x3-stride2-odd", lambda x, w: conv2d(x, w, stride=2, padding=1, implementation="pallas"),
     (_sds((2, 63, 65, 320)), _sds((3, 3, 320, 640))), ("conv2d_dgrad", "conv2d_wgrad")),
    ("conv1x1-f32", lambda x, w: conv2d(x, w, implementation="pallas"),
     (_sds((8, 32, 32, 640), jnp.float32), _sds((1, 1, 640, 320), jnp.float32)), ("conv2d_dgrad", "conv2d_wgrad")),
    ("conv-depthwise", lambda x, w: conv2d(x, w, padding=3, groups=320, implementation="pallas"),
     (_sds((8, 64, 64, 320)), _sds((7, 7, 1, 320))), ("conv2d_dgrad", "conv2d_wgrad")),
    ("group_norm-silu", lambda x, w, b: group_norm(x, w, b, num_groups=32, activation="silu", implementation="pallas"),
     (_sds((8, 64, 64, 320)), _sds((320,)), _sds((320,))), ("group_norm_bwd_sums", "group_norm_bwd")),
    ("group_norm-128x128x256", lambda x, w, b: group_norm(x, w, b, num_groups=32, implementation="pallas"),
     (_sds((2, 128, 128, 256), jnp.float32), _sds((256,), jnp.float32), _sds((256,), jnp.float32)), ("group_norm_bwd_sums", "group_norm_bwd")),
    ("upsample-nearest", lambda x: upsample2d(x, 2, implementation="pallas"), (_sds((8, 32, 32, 640)),), ("upsample2d_bwd",)),
    ("upsample-bilinear", lambda x: upsample2d(x, 2, method="bilinear", implementation="pallas"),
     (_sds((8, 32, 32, 640)),), ("upsample2d_bwd",)),
    ("pixel_shuffle", lambda x: pixel_shuffle(x, 2, implementation="pallas"), (_sds((8, 64, 64, 256)),), ("pixel_shuffle_bwd",)),
    ("unpatchify", lambda t: unpatchify(t, grid=16, patch_size=2, channels=4, implementation="pallas"),
     (_sds((8, 256, 16), jnp.float32),), ("unpatchify_bwd",)),
]


@pytest.mark.parametrize("name,f,args,kernels", LOWERING, ids=[c[0] for c in LOWERING])
def test_lowers_for_cuda_at_unet_shapes(name, f, args, kernels):
    def bwd(*a):
        out, vjp = jax.vjp(f, *a)
        return vjp(jnp.ones_like(out))

    with config.use(interpret=False):
        names = C.triton_kernel_names(C.lower_for_gpu(bwd, *args))
    assert sorted(set(names)) == sorted(kernels)
