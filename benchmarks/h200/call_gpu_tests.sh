# H200 call: one of the two parts of the GPU tests (each under 8 minutes on the H200).
#   bash benchmarks/h200/call_gpu_tests.sh kernels   # pytest -m "gpu and not e2e" tests
#   bash benchmarks/h200/call_gpu_tests.sh e2e       # pytest -m "gpu and e2e" tests
source benchmarks/h200/setup.sh
case "$1" in
  kernels) marks="gpu and not e2e" ;;
  e2e) marks="gpu and e2e" ;;
  *) echo "usage: call_gpu_tests.sh kernels|e2e"; exit 2 ;;
esac
timeout 470 python3 -m pytest -v -p no:cacheprovider --timeout 300 -m "$marks" tests \
  --durations=15 > $OUT/gpu_tests_$1.log 2>&1
rc=$?
grep -E "PASSED|FAILED|ERROR|XPASS|xfail|passed|failed" $OUT/gpu_tests_$1.log | tail -45
exit $rc
