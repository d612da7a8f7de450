"""x2 super-resolution on the images bundled with scikit-image, with jaxbwd's vision ops.

A small residual network: conv2d stem, residual blocks of [group_norm + fused SiLU ->
conv2d] x 2, then conv2d to 3 * 2 * 2 channels and pixel_shuffle(2), added to a
bilinear upsample2d of the input. Trained on random crops of bundled images (downsampled
by 2x2 averaging), evaluated by PSNR on the top-left 256 x 256 crop of each held-out image
against bicubic upsampling.
Saves ``runs/<name>/superres.png`` (low-res | bicubic | model | high-res) and metrics.json.

With ``--r1 GAMMA`` the network also trains against a small patch discriminator (a
non-saturating GAN loss, weight ``--adv-weight``) regularised by the R1 gradient penalty
``GAMMA / 2 * E ||grad_x D(x_real)||^2`` (Mescheder et al. 2018, "Which Training Methods
for GANs do actually Converge?", eq. 9; StyleGAN2 trains with it). The penalty's
gradient with respect to the discriminator's parameters is a second derivative through
conv2d, group_norm, bias_add, upsample2d and residual_add, so it runs jaxbwd's
second-order rules. With ``--implementation pallas`` those go through the JVP of each op's
XLA backward formula (README, "Derivatives"): the penalty's gradient runs no backward kernel
but bias_add's, while the generator's and the discriminator's loss gradients run the kernels.

    python examples/train_superres.py                 # XLA backward on CPU, a few minutes
    python examples/train_superres.py --implementation pallas --steps 3 --crop 16   # kernels, interpret mode
    python examples/train_superres.py --r1 1.0        # adversarial + R1 penalty (crop a multiple of 4)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys
import time

import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

import jaxbwd
import jaxbwd.nn as jnn

# All bundled with scikit-image (no download). skimage.data.cat is chelsea: not held out.
TRAIN_IMAGES = ("astronaut", "chelsea", "immunohistochemistry", "retina", "hubble_deep_field")
HELD_OUT = ("coffee", "rocket")


def load_images(names):
    import skimage.data

    return [np.asarray(getattr(skimage.data, n)(), np.float32) / 255.0 for n in names]


def downsample(hr):
    """2x2 box average: [..., H, W, C] -> [..., H/2, W/2, C] (H, W even)."""
    *lead, H, W, C = hr.shape
    return hr.reshape(*lead, H // 2, 2, W // 2, 2, C).mean(axis=(-4, -2))


def random_crops(images, n, size, rng):
    out = []
    for _ in range(n):
        im = images[rng.integers(len(images))]
        y, x = rng.integers(0, im.shape[0] - size + 1), rng.integers(0, im.shape[1] - size + 1)
        crop = im[y : y + size, x : x + size]
        if rng.random() < 0.5:
            crop = crop[:, ::-1]
        out.append(crop)
    return np.stack(out)


class SuperRes(fnn.Module):
    channels: int = 32
    blocks: int = 3
    implementation: str | None = None

    @fnn.compact
    def __call__(self, lr):
        impl = self.implementation
        h = jnn.Conv(self.channels, (3, 3), implementation=impl, name="stem")(lr)
        for i in range(self.blocks):
            r = jnn.GroupNorm(num_groups=8, activation="silu", implementation=impl, name=f"norm{i}a")(h)
            r = jnn.Conv(self.channels, (3, 3), implementation=impl, name=f"conv{i}a")(r)
            r = jnn.GroupNorm(num_groups=8, activation="silu", implementation=impl, name=f"norm{i}b")(r)
            r = jnn.Conv(self.channels, (3, 3), implementation=impl, name=f"conv{i}b")(r)
            h = jaxbwd.residual_add(h, r, implementation=impl)
        # Zero-initialised: the network starts as plain bilinear upsampling and learns the residual.
        h = jnn.Conv(3 * 4, (3, 3), kernel_init=fnn.initializers.zeros, implementation=impl, name="to_subpixel")(h)
        base = jaxbwd.upsample2d(lr, 2, method="bilinear", implementation=impl)
        return jaxbwd.residual_add(base, jaxbwd.pixel_shuffle(h, 2, implementation=impl), implementation=impl)


class Discriminator(fnn.Module):
    """Patch discriminator: [N, H, W, 3] -> logits [N, H/2, W/2, 1] (H, W multiples of 4).

    Two stride-2 convolutions, then the coarser features upsampled back and added (a
    U-Net-style skip), so that the R1 penalty differentiates every vision op twice.
    """

    channels: int = 32
    implementation: str | None = None

    @fnn.compact
    def __call__(self, x):
        impl, c = self.implementation, self.channels
        h = jnn.Conv(c, (3, 3), strides=2, use_bias=False, implementation=impl, name="down1")(x)
        h = jaxbwd.bias_add(h, self.param("down1_bias", fnn.initializers.zeros, (c,)), implementation=impl)
        h = jnn.GroupNorm(num_groups=8, activation="silu", implementation=impl, name="norm1")(h)
        coarse = jnn.Conv(c, (3, 3), strides=2, implementation=impl, name="down2")(h)
        coarse = jnn.GroupNorm(num_groups=8, activation="silu", implementation=impl, name="norm2")(coarse)
        h = jaxbwd.residual_add(h, jaxbwd.upsample2d(coarse, 2, implementation=impl), implementation=impl)
        return jnn.Conv(1, (3, 3), implementation=impl, name="logits")(h)


def r1_penalty(disc, d_params, real, gamma):
    """``gamma / 2 * mean_n ||d D(x_n) / d x_n||^2`` at the real images (R1, eq. 9), with
    ``D(x_n)`` image n's patch logits averaged (its score)."""
    score = lambda x: jnp.sum(jnp.mean(disc.apply({"params": d_params}, x), axis=(1, 2, 3)))
    grad_x = jax.grad(score)(real)
    return 0.5 * gamma * jnp.mean(jnp.sum(jnp.square(grad_x), axis=(1, 2, 3)))


def psnr(a, b) -> float:
    mse = float(np.mean((np.clip(a, 0, 1) - b) ** 2))
    return 10 * math.log10(1.0 / max(mse, 1e-12))


def _run_name(name: str) -> str:
    """--name: one folder name under --out (a path there could write anywhere)."""
    if name in ("", ".", "..") or "/" in name or (os.altsep and os.altsep in name) or os.sep in name:
        raise argparse.ArgumentTypeError(f"a run name is one folder name under --out, got {name!r}")
    return name


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=1000,
                   help="training steps (default 1000, about 1-2 minutes on CPU, about 4 with --r1)")
    p.add_argument("--batch", type=int, default=16, help="crops per step")
    p.add_argument("--crop", type=int, default=48, help="high-res crop size in pixels (even; the input is half of it)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate (cosine decay to 5%%)")
    p.add_argument("--implementation", choices=["xla", "pallas"], default=None,
                   help="jaxbwd implementation (default: pallas on GPU, xla elsewhere; pallas without a GPU runs "
                        "the kernels in interpret mode, slowly)")
    p.add_argument("--name", default=None, type=_run_name, help="run name under --out (default: superres-IMPLEMENTATION, -r1 added with --r1)")
    p.add_argument("--out", default="runs", help="output folder (default: runs/ in the current directory)")
    p.add_argument("--r1", type=float, default=None, metavar="GAMMA",
                   help="also train adversarially against a patch discriminator with an R1 gradient penalty of "
                        "weight GAMMA (a second derivative through the vision ops); default: off")
    p.add_argument("--adv-weight", type=float, default=None,
                   help="weight of the generator's adversarial loss next to the pixel MSE; needs --r1 (default 0.01)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    for flag, v in (("--steps", args.steps), ("--batch", args.batch)):
        if v < 1:
            p.error(f"{flag} must be >= 1, got {v}")
    given_adv_weight = args.adv_weight is not None
    args.adv_weight = args.adv_weight if given_adv_weight else 0.01
    for flag, v in (("--lr", args.lr), ("--adv-weight", args.adv_weight)):
        if not (math.isfinite(v) and v > 0):
            p.error(f"{flag} must be a positive number, got {v}")
    if given_adv_weight and args.r1 is None:
        p.error("--adv-weight weighs the adversarial loss, which only --r1 GAMMA trains")
    if args.crop < 2 or args.crop % 2:
        p.error(f"--crop must be even and >= 2, got {args.crop}")
    if args.r1 is not None and (args.crop % 4 or not args.r1 >= 0 or not math.isfinite(args.r1)):
        p.error("--r1 needs a finite GAMMA >= 0 and a --crop that is a multiple of 4 "
                f"(the discriminator downsamples twice), got GAMMA={args.r1}, --crop {args.crop}")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        p.error(f"--out {args.out}: is a file, not a folder")
    impl = args.implementation
    if impl == "pallas" and jax.default_backend() != "gpu":
        jaxbwd.config.set_default(interpret=True)
        print("note: no GPU, Pallas kernels run in interpret mode (slow): use few --steps and a small --crop")

    train, held = load_images(TRAIN_IMAGES), load_images(HELD_OUT)
    largest = min(min(im.shape[:2]) for im in train)
    if args.crop > largest:
        p.error(f"--crop must be at most {largest} (the smallest training image's side), got {args.crop}")
    # The run's folder after the checks and before training, so that a folder that cannot be
    # made stops the run before any step.
    default_name = f"superres-{impl or jaxbwd.config.default_implementation()}" + ("-r1" if args.r1 is not None else "")
    out = pathlib.Path(args.out) / (args.name or default_name)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        p.error(f"--out {args.out}: cannot create {out}: {e.strerror or e}")
    rng = np.random.default_rng(0)
    model = SuperRes(implementation=impl)
    lr0 = downsample(random_crops(train, args.batch, args.crop, rng))
    params = model.init(jax.random.PRNGKey(0), jnp.asarray(lr0))["params"]
    # Weight decay on the kernels only, not on biases and GroupNorm scales (as train_lm.py).
    matrices = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    opt = optax.adamw(optax.cosine_decay_schedule(args.lr, args.steps, 0.05), weight_decay=1e-4, mask=matrices)
    opt_state = opt.init(params)

    def loss_fn(params, lr, hr):
        return jnp.mean(jnp.square(model.apply({"params": params}, lr) - hr))

    @jax.jit
    def step(params, opt_state, lr, hr):
        loss, grads = jax.value_and_grad(loss_fn)(params, lr, hr)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    gan = None
    if args.r1 is not None:
        disc = Discriminator(implementation=impl)
        d_params = disc.init(jax.random.PRNGKey(1), jnp.zeros((1, args.crop, args.crop, 3)))["params"]
        d_opt = optax.adam(1e-4, b1=0.0, b2=0.99)  # StyleGAN2's discriminator settings
        gan = {"disc": disc, "params": d_params, "opt": d_opt, "opt_state": d_opt.init(d_params)}

        def g_loss_fn(params, d_params, lr, hr):
            fake = model.apply({"params": params}, lr)
            adv = jnp.mean(jax.nn.softplus(-disc.apply({"params": d_params}, fake)))
            return jnp.mean(jnp.square(fake - hr)) + args.adv_weight * adv

        def d_loss_fn(d_params, fake, real):
            logits_fake = disc.apply({"params": d_params}, fake)
            logits_real = disc.apply({"params": d_params}, real)
            gan_loss = jnp.mean(jax.nn.softplus(logits_fake)) + jnp.mean(jax.nn.softplus(-logits_real))
            penalty = r1_penalty(disc, d_params, real, args.r1)
            return gan_loss + penalty, penalty

        @jax.jit
        def gan_step(params, opt_state, d_params, d_opt_state, lr, hr):
            loss, grads = jax.value_and_grad(g_loss_fn)(params, d_params, lr, hr)
            updates, opt_state = opt.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            fake = jax.lax.stop_gradient(model.apply({"params": params}, lr))
            (d_loss, penalty), d_grads = jax.value_and_grad(d_loss_fn, has_aux=True)(d_params, fake, hr)
            d_updates, d_opt_state = d_opt.update(d_grads, d_opt_state, d_params)
            return params, opt_state, optax.apply_updates(d_params, d_updates), d_opt_state, loss, d_loss, penalty

    history, d_history, r1_history = [], [], []
    t0 = time.perf_counter()
    for _ in tqdm(range(args.steps), disable=args.no_progress, desc="train"):
        hr = random_crops(train, args.batch, args.crop, rng)
        lr_batch, hr_batch = jnp.asarray(downsample(hr)), jnp.asarray(hr)
        if gan is None:
            params, opt_state, loss = step(params, opt_state, lr_batch, hr_batch)
        else:
            params, opt_state, gan["params"], gan["opt_state"], loss, d_loss, penalty = gan_step(
                params, opt_state, gan["params"], gan["opt_state"], lr_batch, hr_batch)
            d_history.append(float(d_loss))
            r1_history.append(float(penalty))
        history.append(float(loss))
    train_s = time.perf_counter() - t0

    apply = jax.jit(lambda p, x: model.apply({"params": p}, x))
    results, panels = [], []
    for name, im in zip(HELD_OUT, held):
        H, W = (min(im.shape[0], 256) // 2) * 2, (min(im.shape[1], 256) // 2) * 2
        hr = im[:H, :W]
        lr = downsample(hr)
        bicubic = np.asarray(jax.image.resize(jnp.asarray(lr), hr.shape, "bicubic"))
        pred = np.asarray(apply(params, jnp.asarray(lr[None])))[0]
        results.append({"image": name, "psnr_bicubic": psnr(bicubic, hr), "psnr_model": psnr(pred, hr)})
        near = np.repeat(np.repeat(lr, 2, 0), 2, 1)
        panels.append(np.concatenate([near, np.clip(bicubic, 0, 1), np.clip(pred, 0, 1), hr], axis=1))
    _save(panels, out / "superres.png")
    mean_b = float(np.mean([r["psnr_bicubic"] for r in results]))
    mean_m = float(np.mean([r["psnr_model"] for r in results]))
    (out / "metrics.json").write_text(json.dumps({
        "steps": args.steps, "batch": args.batch, "crop": args.crop, "lr": args.lr, "train_loss": history, "held_out": results, "psnr_bicubic": mean_b, "psnr_model": mean_m,
        "train_seconds": train_s, "jax": jax.__version__, "backend": jax.default_backend(),
        "implementation": impl or jaxbwd.config.default_implementation(),
        **({"r1_gamma": args.r1, "adv_weight": args.adv_weight, "d_loss": d_history, "r1_penalty": r1_history}
           if gan is not None else {})}, indent=1))
    for r in results:
        print(f"{r['image']}: PSNR bicubic {r['psnr_bicubic']:.2f} dB, model {r['psnr_model']:.2f} dB")
    if gan is not None:
        print(f"discriminator loss {d_history[-1]:.4f}, R1 penalty {r1_history[-1]:.3g} (gamma {args.r1}) at the last step")
    print(f"held-out mean PSNR: model {mean_m:.2f} dB vs bicubic {mean_b:.2f} dB ({args.steps} steps, {train_s:.0f} s); wrote {out}/")
    return 0


def _save(panels, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 3.2 * len(panels)))
    for ax, panel in zip(np.atleast_1d(axes), panels):
        ax.imshow(panel)
        ax.set_axis_off()
        ax.set_title("low-res (nearest) | bicubic | model | high-res", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
