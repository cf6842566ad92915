# GPU call (issue 30, MoE update MFU): the update's forward + backward of the e2e MoE slice
# profiled on one 16k-token micro-batch (25 packed sequences), then the MoE e2e step (megarl's
# side; --recompute auto decides from the card's memory).
#   usage: bash benchmarks/h200/call_moe_update.sh   (PROFILE=0 / E2E=0 skip a part)
source benchmarks/h200/setup.sh
if [ "${PROFILE:-1}" = 1 ]; then
  timeout ${PROFILE_TIMEOUT:-200} python3 benchmarks/actor_throughput.py --shapes e2e_moe \
    --sides ${PROFILE_SIDES:-megatron_update} --seq-len 16384 --packed-seqs 25 --no-graphs \
    --warmup 2 --steps ${PROFILE_STEPS:-3} ${PROFILE_ARGS---profile $OUT/prof} \
    --out $OUT/actor_e2e_moe.json > $OUT/actor_e2e_moe.log 2>&1
  echo "actor profile rc=$?"; grep -v -i warn $OUT/actor_e2e_moe.log | tail -4 | cut -c1-600
  head -50 $OUT/prof/profile_e2e_moe_megatron_update.txt 2>/dev/null | cut -c1-60,100-175
  sed -n '/Self CPU %/,$p' $OUT/prof/profile_e2e_moe_megatron_update.txt 2>/dev/null \
    | tail -32 | cut -c1-60,60-120
fi
if [ -n "${GPU_TESTS:-}" ]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider $GPU_TESTS > $OUT/gpu_tests.log 2>&1
  echo "gpu tests rc=$?"; tail -4 $OUT/gpu_tests.log
fi
if [ "${E2E:-1}" = 1 ]; then
  E2E_ARGS="${E2E_ARGS:---steps 1}" E2E_TIMEOUT=${E2E_TIMEOUT:-420} bash benchmarks/h200/e2e_megarl.sh moe
fi
