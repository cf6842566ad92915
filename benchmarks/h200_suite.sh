#!/usr/bin/env bash
# Every GPU figure of benchmarks/RESULTS.md in one call on one H200 (the device machine):
# the actor and rollout benchmarks, the decode-step profile, then the gpu tests.
# Run from the repository root with megatron-core, mbridge and transformers importable
# (on the device machine: carried as wheels, see RESULTS.md). Writes its logs to $OUT.
set -u
out=${OUT:-./h200-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
python3 benchmarks/actor_throughput.py --out "$out/actor.json" 2>&1 \
  | grep -E "ceilings|tokens/s|ratio"
python3 benchmarks/rollout_throughput.py --device cuda --no-http --out "$out/rollout.json" 2>&1 \
  | grep -E "tokens/s|floor"
python3 benchmarks/profile_decode.py --shape moe --out "$out" 2>&1 | grep -E '^ *"|^[{}]'
# the GPU tests in their two parts (benchmarks/h200/call_gpu_tests.sh runs one per call)
python3 -m pytest -q -p no:cacheprovider --timeout 300 -m "gpu and not e2e" tests 2>&1 \
  | tee "$out/gpu_tests_kernels.log" | tail -25
python3 -m pytest -q -p no:cacheprovider --timeout 300 -m "gpu and e2e" tests 2>&1 \
  | tee "$out/gpu_tests_e2e.log" | tail -25
