# H200 call: the MoE shape at megarl's defaults (warm-up + 2 timed steps; setup ~150 s and steps
# of ~135 + 2 x ~72 s need more than 420 s). REFUSAL=1 first checks that the preflight refuses the
# MoE shape with recompute off and 32-sequence micro-batches (exit 1; done on 2026-12-04);
# MOE_RUN=0 skips the run (the refusal alone, after the run in an earlier call on a warm machine).
# The refusal writes its JSON to its own --out and shares the run's random checkpoint.
source benchmarks/h200/setup.sh
if [ "${REFUSAL:-0}" = 1 ]; then
  mkdir -p /tmp/e2e/moe/model /tmp/e2e_refusal/moe
  ln -sfn /tmp/e2e/moe/model /tmp/e2e_refusal/moe/model
  timeout 200 python3 benchmarks/e2e_step.py --shape moe --trl off --out /tmp/e2e_refusal \
    --recompute none --micro-batch-tokens 0 --micro-batches 16 > $OUT/refusal_moe.log 2>&1
  echo "refusal rc=$? (1 expected)"
  grep -v -i "warn" $OUT/refusal_moe.log | tail -15
  cp /tmp/e2e_refusal/e2e_step.json $OUT/refusal_moe.json 2>/dev/null
fi
[ "${MOE_RUN:-1}" = 1 ] || exit 0
E2E_TIMEOUT=${E2E_TIMEOUT:-560} bash benchmarks/h200/e2e_megarl.sh moe
