# GPU call (issue 30, MoE update MFU): GPU tests (GPU_TESTS: pytest paths; a failure ends the
# call), the update's forward + backward of the e2e MoE slice profiled on one 16k-token
# micro-batch (25 packed sequences; PROFILE_SIDES: actor_throughput.py's --sides), then the MoE
# e2e step (megarl's side; --recompute auto decides from the card's memory).
#   usage: bash benchmarks/h200/call_moe_update.sh   (PROFILE=0 / E2E=0 skip a part;
#   TESTS_MAY_FAIL=1: the other parts run after a failed test)
source benchmarks/h200/setup.sh
if [ -n "${GPU_TESTS:-}" ]; then
  timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider $GPU_TESTS \
    > $OUT/gpu_tests.log 2>&1
  rc=$?; echo "gpu tests rc=$rc"; tail -4 $OUT/gpu_tests.log
  [ $rc = 0 ] || { grep -E "^E |Error" $OUT/gpu_tests.log | head -30
    [ "${TESTS_MAY_FAIL:-0}" = 1 ] || exit $rc; }
fi
if [ "${PROFILE:-1}" = 1 ]; then
  timeout ${PROFILE_TIMEOUT:-200} python3 benchmarks/actor_throughput.py --shapes e2e_moe \
    --sides ${PROFILE_SIDES:-megatron_update} --seq-len 16384 --packed-seqs 25 --no-graphs \
    --warmup 2 --steps ${PROFILE_STEPS:-3} ${PROFILE_ARGS---profile $OUT/prof} \
    --out $OUT/actor_e2e_moe.json > $OUT/actor_e2e_moe.log 2>&1
  echo "actor profile rc=$?"; grep -v -i warn $OUT/actor_e2e_moe.log | tail -5 | cut -c1-300
  head -45 $OUT/prof/profile_e2e_moe_megatron_update.txt 2>/dev/null | cut -c1-60,100-175
fi
if [ "${E2E:-1}" = 1 ]; then
  E2E_ARGS="${E2E_ARGS:---steps 1}" E2E_TIMEOUT=${E2E_TIMEOUT:-420} bash benchmarks/h200/e2e_megarl.sh moe
fi
# a call returns 8 files at most: the small logs and the profile tables go back as one archive
cd $OUT && tar czf misc_moe_update.tgz --remove-files prof gpu_tests.log actor_e2e_moe.log \
  mem_moe.log estimates_test_moe.log 2>/dev/null; ls $OUT
