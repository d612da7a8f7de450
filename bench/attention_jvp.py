"""Forward mode through attention: jaxbwd's jax.jvp against jax.jvp of the plain reference.

Time and compiled temp memory of each, causal, B=1, 2 heads of 32, f32, T=S=1024 and 4096;
jaxbwd's side is its XLA formula (default) or, on a GPU, the attention_jvp kernel
(--implementation pallas).

    python bench/attention_jvp.py [--implementation xla|pallas]
"""
import argparse

import jax
import jax.numpy as jnp

from jaxbwd import bench, registry

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--implementation", choices=["xla", "pallas"], default="xla", help="jaxbwd path to time (default xla)")
impl = p.parse_args().implementation
spec = registry.get("dot_product_attention")
for T in (1024, 4096):
    args = [jax.random.normal(jax.random.PRNGKey(i), (1, T, 2, 32), jnp.float32) for i in range(3)]
    kw = {"is_causal": True}
    ours = spec.bind(args, kw, implementation=impl); theirs = spec.bind(args, kw, spec.reference)
    ts = [jax.random.normal(jax.random.PRNGKey(10 + i), a.shape) for i, a in enumerate(args)]
    so, sr = jax.jit(bench.jvp_step(ours, 3)), jax.jit(bench.jvp_step(theirs, 3))
    to, tr = bench.median_time(so, *args, *ts, repeats=5), bench.median_time(sr, *args, *ts, repeats=5)
    mo, mr = bench._temp_bytes(so, *args, *ts), bench._temp_bytes(sr, *args, *ts)
    print(f"T=S={T}, B=1, 2 heads x 32, f32, causal: jaxbwd jvp ({impl}) {to*1e3:.1f} ms, temp {mo/1e6:.1f} MB; "
          f"jax.jvp of reference {tr*1e3:.1f} ms, temp {mr/1e6:.1f} MB; speedup {tr/to:.2f}x, memory {mr/mo:.1f}x less")
