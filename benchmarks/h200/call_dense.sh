# H200 call: the dense shape at megarl's defaults (warm-up + 2 timed steps).
E2E_TIMEOUT=${E2E_TIMEOUT:-540} bash benchmarks/h200/e2e_megarl.sh dense
