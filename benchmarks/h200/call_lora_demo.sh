# H200 call (issue 33): `megarl demo --device cuda --lora`, the LoRA demo as a user runs it: a
# random 10.0B Qwen3-MoE (Qwen3-30B-A3B's layers, 16 of 48) whose full fine-tune does not fit
# one H200, rank-32 adapters on the attention, colocated. LORA_DEMO_SYNC: merged (default) or
# adapter; LORA_DEMO_STEPS steps; LORA_DEMO_SET: more overrides (e.g. rollout.load_format=dummy).
# The model stays under outputs/moe-lora-gpu/ while the machine stays warm (the first call draws
# it). Metrics, plot and the memory log go to $OUT, suffixed with the sync.
source benchmarks/h200/setup.sh
sync=${LORA_DEMO_SYNC:-merged}
tag=${LORA_DEMO_TAG:-$sync}
( while true; do echo "$(date +%T) host_used_mib $(free -m | awk 'NR==2{print $3, $7}') gpu \
    $(nvidia-smi --query-gpu=memory.used --format=csv,noheader)"; sleep 5; done ) \
  > $OUT/mem_lora_demo_$tag.log 2>&1 &
monitor=$!
rm -rf outputs/moe-lora-gpu/run
start=$(date +%s)
PYTHONFAULTHANDLER=1 timeout -s ABRT -k 15 ${LORA_DEMO_TIMEOUT:-420} python3 -c \
  "import sys; from megarl.cli import main; sys.exit(main())" demo --device cuda --lora \
  actor.lora.sync=$sync trainer.total_steps=${LORA_DEMO_STEPS:-20} ${LORA_DEMO_SET:-} \
  > $OUT/lora_demo_$tag.log 2>&1
echo "lora demo $tag rc=$? in $(( $(date +%s) - start )) s"
kill $monitor 2>/dev/null
for f in outputs/moe-lora-gpu/run/*.jsonl outputs/moe-lora-gpu/run/*.png; do
  [ -f "$f" ] && cp "$f" "$OUT/lora_demo_${tag}_$(basename $f)"
done
grep -v -i "warn" $OUT/lora_demo_$tag.log | grep -E "megarl|step|setup|GB|rror|refus" | tail -40
