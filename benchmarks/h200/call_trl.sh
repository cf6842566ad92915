# H200 call: TRL's side of one e2e shape, merged with megarl's steps of an earlier call.
#   usage: call_trl.sh SHAPE [e2e_step.py args, e.g. --steps 1 --trl-prompts 32]
#   (a fresh machine: put that call's $OUT/steps_SHAPE.jsonl at benchmarks/h200/ first)
source benchmarks/h200/setup.sh
shape=$1; shift
mkdir -p /tmp/e2e/$shape/megarl
[ -f /tmp/e2e/$shape/megarl/steps.jsonl ] || cp benchmarks/h200/steps_$shape.jsonl \
  /tmp/e2e/$shape/megarl/steps.jsonl || { echo "no megarl steps for $shape"; exit 2; }
set -o pipefail
PYTHONFAULTHANDLER=1 timeout -s ABRT -k 15 ${E2E_TIMEOUT:-470} python3 benchmarks/e2e_step.py \
  --shape "$shape" --megarl off --out /tmp/e2e "$@" 2>&1 | tee $OUT/trl_$shape.log \
  | grep -v -i "warn" | tail -40
rc=$?
cp /tmp/e2e/e2e_step.json $OUT/e2e_step_trl_$shape.json 2>/dev/null
cp /tmp/e2e/e2e_step.png $OUT/e2e_step_trl_$shape.png 2>/dev/null
cp /tmp/e2e/$shape/trl/trl.log $OUT/trl_worker_$shape.log 2>/dev/null
exit $rc
