# H200 call: the CUDA-graph capture diagnosis, then `megarl demo --device cuda` (90 steps).
source benchmarks/h200/setup.sh
timeout 120 python3 benchmarks/h200/graph_capture_diag.py > $OUT/graph_diag.log 2>&1
echo "diag rc=$?"
grep -v -i "warn" $OUT/graph_diag.log | grep -A14 -E "^==|synchronising|update (passed|failed)|captured OK|Error" | head -120
timeout ${DEMO_TIMEOUT:-420} python3 -c "import sys; from megarl.cli import main; sys.exit(main())" \
  demo --device cuda > $OUT/demo.log 2>&1
echo "demo rc=$?"
cp outputs/moe-gpu/run/*.jsonl outputs/moe-gpu/run/*.png $OUT/ 2>/dev/null
ls outputs/moe-gpu/run | head
grep -v -i "warn" $OUT/demo.log | tail -25
