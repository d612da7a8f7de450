#!/usr/bin/env bash
# One-shot GPU check for a single-GPU machine that already has jax with CUDA installed
# and no network: installs nothing, runs the tests marked `gpu` (real compiled kernels,
# numerics vs reference at realistic shapes), then the LLM-size benchmark, and writes
# the log, JSON and chart to $OUT (or the first argument), and sweeps a few launch
# configurations of the attention and conv2d kernels (bench/tune.py), writing the fastest to
# $OUT/tuning.json for the tuning table (JAXBWD_TUNING=$OUT/tuning.json). Budget: under 16
# minutes (the per-step timeouts add up to 925 s).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-bench/results/$(date +%Y-%m-%d)}}
mkdir -p "$out"
log="$out/gpu_check.log"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
{
  echo "== $(date -u +%FT%TZ) $(hostname)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
  python -c 'import jax, sys; print("python", sys.version.split()[0], "jax", jax.__version__, jax.devices())'
  echo "== tests marked gpu: kernels vs XLA at LLM shapes, then bitwise-deterministic backward kernels"
  timeout 120 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tail -n 40
  timeout 60 python -m pytest -m gpu -q -p no:cacheprovider tests/test_contract.py -k deterministic 2>&1 | tail -n 20
  echo "== python -m jaxbwd check"
  timeout 45 python -m jaxbwd check 2>&1 | tail -n 80
  echo "== bench/attention.py (vs autodiff and cuDNN)"
  timeout 100 python bench/attention.py --json "$out/attention.json" 2>&1
  echo "== bench/tune.py (config sweeps; attention vs cuDNN and XLA, conv2d vs XLA, bf16)"
  timeout 210 python bench/tune.py --json "$out/tuning.json" --repeats 5 --ops attention conv2d 2>&1
  # linear_cross_entropy's sweep (12 configurations at T=8192, V=128256) and f32 attention's at
  # head_dim 256 (the head-dim split against mma.sync) do not fit this budget; with time to
  # spare: python bench/tune.py --json OUT.json --ops linear_cross_entropy attention_f32_h256
  echo "== python -m jaxbwd bench --size llm"
  timeout 150 python -m jaxbwd bench --size llm --repeats 20 --json "$out/bench_llm.json" --plot "$out/bench_llm.png" 2>&1
  echo "== forward mode through attention: attention_jvp kernel vs XLA formula vs jax.jvp of the reference"
  timeout 60 python bench/attention_jvp.py --implementation pallas 2>&1
  timeout 60 python bench/attention_jvp.py --implementation xla 2>&1
  # --- Mosaic GPU backend (Hopper): attention by backend, Mosaic vs Triton vs cuDNN vs XLA.
  # Adds up to 180 s to the budget above (prints "skipped" off sm_90; head dims 128 and 256). ---
  echo "== bench/mosaic_attention.py (pallas_backend mosaic vs triton vs cudnn vs xla)"
  timeout 180 python bench/mosaic_attention.py --repeats 10 --json "$out/mosaic_attention.json" 2>&1
  # --- end Mosaic GPU block ---
} 2>&1 | tee "$log"
echo "wrote $out"
