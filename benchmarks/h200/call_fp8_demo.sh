# H200 call (issue 31): the GPU demo with FP8 rollout (`megarl demo --device cuda
# rollout.quantization=fp8`, 90 steps: must learn as the bf16 demo does, reward of the last 20%
# of steps > the first 20% + 0.15), then BF16_STEPS (default 0) steps of the bf16 demo for its
# mismatch figures next to FP8's. Metrics, plots and $OUT/fp8_demo_summary.json to $OUT.
source benchmarks/h200/setup.sh
demo() {  # name, timeout, overrides...
  local name=$1 limit=$2; shift 2
  timeout -s ABRT -k 15 $limit python3 -c "import sys; from megarl.cli import main; sys.exit(main())" \
    demo --device cuda trainer.output_dir=outputs/moe-gpu-$name/run "$@" > $OUT/demo_$name.log 2>&1
  echo "demo $name rc=$?"
  mkdir -p $OUT/$name && cp outputs/moe-gpu-$name/run/*.jsonl outputs/moe-gpu-$name/run/*.png \
    $OUT/$name/ 2>/dev/null
  grep -v -i "warn" $OUT/demo_$name.log | tail -6
}
demo fp8 ${FP8_DEMO_TIMEOUT:-420} rollout.quantization=fp8 trainer.total_steps=${FP8_DEMO_STEPS:-90}
[ "${BF16_STEPS:-0}" -gt 0 ] && demo bf16 ${BF16_TIMEOUT:-120} trainer.total_steps=$BF16_STEPS
python3 benchmarks/demo_summary.py $OUT/fp8 $OUT/bf16 --out $OUT/fp8_demo_summary.json
