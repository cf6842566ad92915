# GPU call (issue 30, update MFU): the update's forward + backward profiled on the e2e dense
# shape (16k tokens, 25 packed sequences: the update's micro-batch), the dense e2e step with
# --recompute auto (the optimizer state off the GPU through forwards and backwards: none fits),
# and the GPU tests of the offload.       usage: bash benchmarks/h200/call_update_mfu.sh
source benchmarks/h200/setup.sh
if [ "${PROFILE:-1}" = 1 ]; then
  timeout ${PROFILE_TIMEOUT:-200} python3 benchmarks/actor_throughput.py --shapes e2e_dense \
    --sides megatron_update,megatron_update_torch --seq-len 16384 --packed-seqs 25 --no-graphs --warmup 2 --steps 5 \
    ${PROFILE_ARGS---profile $OUT/prof} --out $OUT/actor_e2e_dense.json > $OUT/actor_e2e_dense.log 2>&1
  echo "actor profile rc=$?"; grep -v -i warn $OUT/actor_e2e_dense.log | tail -4 | cut -c1-600
  head -40 $OUT/prof/profile_e2e_dense_megatron_update.txt 2>/dev/null | cut -c1-60,100-175
fi
if [ "${TESTS:-1}" = 1 ]; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_vocab_triton_gpu.py \
    tests/gpu/test_wgrad_fusion_gpu.py tests/gpu/test_memory_handoff_gpu.py ${GPU_TESTS:-} \
    > $OUT/gpu_tests.log 2>&1
  echo "gpu tests rc=$?"; tail -4 $OUT/gpu_tests.log
fi
if [ "${E2E:-1}" = 1 ]; then
  E2E_ARGS="${E2E_ARGS:---steps 1}" E2E_TIMEOUT=${E2E_TIMEOUT:-420} bash benchmarks/h200/call_e2e_auto.sh megarl
fi
