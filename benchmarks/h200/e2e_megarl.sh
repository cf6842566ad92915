# One shape of benchmarks/e2e_step.py, megarl's side only, with the memory knobs given as
# arguments; JSON, PNG, metrics and log to $OUT.   usage: e2e_megarl.sh SHAPE [a.b=c ...]
# R3=1: with --router-replay R3 (the MoE shape; reported as moe_r3, its files named SHAPE_r3)
# E2E_ARGS: more arguments of e2e_step.py (e.g. "--steps 1")
source benchmarks/h200/setup.sh
shape=$1; shift
if [ "${R3:-0}" = 1 ]; then extra="--router-replay R3"; side=megarl_r3; name=${shape}_r3
else extra=""; side=megarl; name=$shape; fi
set -o pipefail
# host memory (used, available MiB) and device memory every 5 s: what ran out, when
( while true; do echo "$(date +%T) host_used_mib $(free -m | awk 'NR==2{print $3, $7}') gpu \
    $(nvidia-smi --query-gpu=memory.used --format=csv,noheader)"; sleep 5; done ) \
  > $OUT/mem_$name.log 2>&1 &
monitor=$!
PYTHONFAULTHANDLER=1 timeout -s ABRT -k 15 ${E2E_TIMEOUT:-480} python3 benchmarks/e2e_step.py --shape "$shape" --trl off \
  $extra ${E2E_ARGS:-} --out /tmp/e2e --set "$@" 2>&1 | tee $OUT/e2e_$name.log | grep -v -i "warn" | tail -60
rc=$?
cp /tmp/e2e/e2e_step.json $OUT/e2e_step_$name.json 2>/dev/null
cp /tmp/e2e/e2e_step.png $OUT/e2e_step_$name.png 2>/dev/null
cp /tmp/e2e/$shape/$side/metrics.jsonl $OUT/metrics_$name.jsonl 2>/dev/null
# megarl's steps, for TRL's side as a later call (call_trl.sh reads benchmarks/h200/steps_SHAPE.jsonl)
cp /tmp/e2e/$shape/$side/steps.jsonl $OUT/steps_$name.jsonl 2>/dev/null
# the workers' and engines' logs (their last 400 lines each), one file: a call returns 8 at most
mkdir -p /tmp/e2e_logs_$name
for f in /tmp/e2e/$shape/$side/logs/*.log; do
  [ -f "$f" ] && tail -400 "$f" > /tmp/e2e_logs_$name/$(basename "$f"); done
tar czf $OUT/logs_$name.tgz -C /tmp e2e_logs_$name 2>/dev/null
kill $monitor 2>/dev/null
# issue 29's GPU test of the estimates: every phase within 25% of this run's measured peak
if [ $rc = 0 ] && [ "${R3:-0}" != 1 ]; then
  MEGARL_E2E_STEP_JSON=/tmp/e2e/e2e_step.json timeout 60 python3 -m pytest -q -p no:cacheprovider \
    tests/gpu/test_e2e_estimates_gpu.py -k "$shape" > $OUT/estimates_test_$name.log 2>&1
  echo "estimates test rc=$?"; tail -5 $OUT/estimates_test_$name.log
fi
nvidia-smi --query-gpu=memory.used --format=csv
exit $rc
