# GPU call (issue 30): the MoE e2e step first (megarl's side, warm-up + 1 timed step; the step's
# Adam moments streamed), then benchmarks/optimizer_step.py (OPT_BENCH=0 skips it) and GPU tests
# (GPU_TESTS) in what is left of the call.
#   usage: GPU_TESTS="tests/gpu/..." bash benchmarks/h200/call_moe_e2e_first.sh
source benchmarks/h200/setup.sh
E2E_ARGS="${E2E_ARGS:---steps 1}" E2E_TIMEOUT=${E2E_TIMEOUT:-330} bash benchmarks/h200/e2e_megarl.sh moe
if [ "${OPT_BENCH:-1}" = 1 ]; then  # the offloaded step: whole state back vs streamed moments
  timeout 120 python3 benchmarks/optimizer_step.py --gb ${OPT_GB:-8} --out $OUT/optimizer_step.json \
    > $OUT/optimizer_step.log 2>&1
  echo "optimizer step bench rc=$?"; tail -30 $OUT/optimizer_step.log | grep -E "seconds|gb_per|peak|over|same"
fi
if [ -n "${GPU_TESTS:-}" ]; then
  timeout ${TESTS_TIMEOUT:-170} python3 -m pytest -q -p no:cacheprovider $GPU_TESTS \
    > $OUT/gpu_tests.log 2>&1
  echo "gpu tests rc=$?"; tail -3 $OUT/gpu_tests.log; grep -E "^E |^FAILED" $OUT/gpu_tests.log | head -20
fi
# a call returns 8 files at most
cd $OUT && tar czf misc_moe_e2e.tgz --remove-files mem_moe.log estimates_test_moe.log \
  gpu_tests.log optimizer_step.log 2>/dev/null; ls $OUT
