# H200 call: the MoE shape at megarl's defaults (warm-up + 2 timed steps; setup ~150 s and steps
# of ~135 + 2 x ~72 s need more than 420 s). REFUSAL=1 first checks that the preflight refuses the
# MoE shape with recompute off and 32-sequence micro-batches (exit 1; done on 2026-12-04).
source benchmarks/h200/setup.sh
if [ "${REFUSAL:-0}" = 1 ]; then
  timeout 150 python3 benchmarks/e2e_step.py --shape moe --trl off --out /tmp/e2e --recompute none \
    --micro-batch-tokens 0 --micro-batches 16 > $OUT/refusal_moe.log 2>&1
  echo "refusal rc=$? (1 expected)"
  grep -v -i "warn" $OUT/refusal_moe.log | tail -15
  cp /tmp/e2e/e2e_step.json $OUT/refusal_moe.json 2>/dev/null; rm -f /tmp/e2e/e2e_step.json
fi
E2E_TIMEOUT=${E2E_TIMEOUT:-560} bash benchmarks/h200/e2e_megarl.sh moe
