# One shape of benchmarks/e2e_step.py, megarl's side only, with the memory knobs given as
# arguments; JSON, PNG, metrics and log to $OUT.   usage: e2e_megarl.sh SHAPE [a.b=c ...]
source benchmarks/h200/setup.sh
shape=$1; shift
set -o pipefail
# host memory (used, available MiB) and device memory every 5 s: what ran out, when
( while true; do echo "$(date +%T) host_used_mib $(free -m | awk 'NR==2{print $3, $7}') gpu \
    $(nvidia-smi --query-gpu=memory.used --format=csv,noheader)"; sleep 5; done ) \
  > $OUT/mem_$shape.log 2>&1 &
monitor=$!
PYTHONFAULTHANDLER=1 timeout -s ABRT -k 15 ${E2E_TIMEOUT:-480} python3 benchmarks/e2e_step.py --shape "$shape" --trl off \
  --out /tmp/e2e --set "$@" 2>&1 | tee $OUT/e2e_$shape.log | grep -v -i "warn" | tail -60
rc=$?
cp /tmp/e2e/e2e_step.json $OUT/e2e_step_$shape.json 2>/dev/null
cp /tmp/e2e/e2e_step.png $OUT/e2e_step_$shape.png 2>/dev/null
cp /tmp/e2e/$shape/megarl/metrics.jsonl $OUT/metrics_$shape.jsonl 2>/dev/null
# megarl's steps, for TRL's side as a later call (call_trl.sh reads benchmarks/h200/steps_SHAPE.jsonl)
cp /tmp/e2e/$shape/megarl/steps.jsonl $OUT/steps_$shape.jsonl 2>/dev/null
# the workers' and engines' logs (their last 400 lines each), one file: a call returns 8 at most
mkdir -p /tmp/e2e_logs_$shape
for f in /tmp/e2e/$shape/megarl/logs/*.log; do
  [ -f "$f" ] && tail -400 "$f" > /tmp/e2e_logs_$shape/$(basename "$f"); done
tar czf $OUT/logs_$shape.tgz -C /tmp e2e_logs_$shape 2>/dev/null
kill $monitor 2>/dev/null
nvidia-smi --query-gpu=memory.used --format=csv
exit $rc
