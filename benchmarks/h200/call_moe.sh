# H200 call: the preflight refuses the MoE shape with recompute off and 32-sequence micro-batches,
# then the MoE shape at megarl's defaults (warm-up + 2 timed steps).
source benchmarks/h200/setup.sh
timeout 150 python3 benchmarks/e2e_step.py --shape moe --trl off --out /tmp/e2e --recompute none \
  --micro-batch-tokens 0 --micro-batches 16 > $OUT/refusal_moe.log 2>&1
echo "refusal rc=$? (1 expected)"
grep -v -i "warn" $OUT/refusal_moe.log | tail -15
cp /tmp/e2e/e2e_step.json $OUT/refusal_moe.json 2>/dev/null; rm -f /tmp/e2e/e2e_step.json
E2E_TIMEOUT=${E2E_TIMEOUT:-420} bash benchmarks/h200/e2e_megarl.sh moe
