# H200 call (issue 33): LoRA on a model a full fine-tune cannot fit on one H200. The MoE shape of
# e2e_step.py at LORA_LAYERS (14) of Qwen3-30B-A3B's layers: ~9.3B parameters, 18.6 GB of bf16
# weights; a full fine-tune's update needs ~162 GB (fp32 grads and Adam; 24 layers: ~267 GB),
# and the preflight refuses it (first run, exit 1 expected; LORA_REFUSAL=0 skips it). Then LoRA
# (rank 32 on the attention) with the merged sync and with the adapter sync (LORA_SYNCS):
# warm-up + LORA_STEPS timed steps of LORA_PROMPTS prompts each, JSON to $OUT.
# Responses are short (LORA_MAX_RESPONSE, median LORA_MEDIAN): an engine serving adapters decodes
# through HF's eager modules (128 experts a layer in HF's expert loop), not the native decoder,
# and 2,048-token answers would not end inside LORA_TIMEOUT; both syncs run the same lengths.
# Measured on an H100 at da533f2 (benchmarks/RESULTS.md): the refusal ~40 s; merged ~210 s
# (setup 176 s, steps 17 + 5.5 s); adapter ~260 s (setup 178 s, steps 49 + 22 s: its engine
# decodes through HF's modules). One call each: LORA_SYNCS=merged LORA_TIMEOUT=300, then
# LORA_REFUSAL=0 LORA_SYNCS=adapter LORA_TIMEOUT=540 (the model stays in /tmp/e2e_lora while the
# machine stays warm).
source benchmarks/h200/setup.sh
L=${LORA_LAYERS:-14}
common="--shape moe --moe-layers $L --trl off --out /tmp/e2e_lora --prompts ${LORA_PROMPTS:-16}
  --steps ${LORA_STEPS:-1} --warmup 1 --max-response ${LORA_MAX_RESPONSE:-256}
  --median ${LORA_MEDIAN:-64}"
( while true; do echo "$(date +%T) host_used_mib $(free -m | awk 'NR==2{print $3, $7}') gpu \
    $(nvidia-smi --query-gpu=memory.used --format=csv,noheader)"; sleep 5; done ) \
  > $OUT/mem_lora.log 2>&1 &
monitor=$!
if [ "${LORA_REFUSAL:-1}" = 1 ]; then  # also writes the random model (kept in /tmp for later calls)
  timeout 200 python3 benchmarks/e2e_step.py $common > $OUT/lora_full_refusal.log 2>&1
  echo "full fine-tune rc=$? (1 expected: refused)"
  grep -v -i "warn" $OUT/lora_full_refusal.log | grep -i -E "refus|GB|error" | tail -12
  cp /tmp/e2e_lora/e2e_step.json $OUT/lora_full_refusal.json 2>/dev/null
fi
for sync in ${LORA_SYNCS:-merged adapter}; do
  rm -f /tmp/e2e_lora/e2e_step.json
  PYTHONFAULTHANDLER=1 timeout -s ABRT -k 15 ${LORA_TIMEOUT:-200} python3 benchmarks/e2e_step.py \
    $common --set actor.lora.rank=32 actor.lora.alpha=64 actor.lora.sync=$sync \
    > $OUT/lora_$sync.log 2>&1
  echo "lora $sync rc=$?"
  grep -v -i "warn" $OUT/lora_$sync.log | tail -25
  cp /tmp/e2e_lora/e2e_step.json $OUT/lora_$sync.json 2>/dev/null
  # each step's metrics (checkpoint_engine/bytes: what the sync sent) as e2e_step logs them
  cp /tmp/e2e_lora/moe/megarl/steps.jsonl $OUT/lora_steps_$sync.jsonl 2>/dev/null
done
kill $monitor 2>/dev/null
