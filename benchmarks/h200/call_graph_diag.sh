# H200 call: where the multi-sequence CUDA-graph capture breaks (benchmarks/h200/graph_capture_diag.py)
source benchmarks/h200/setup.sh
for i in 0 1 2 3 4; do
  timeout 60 python3 benchmarks/h200/graph_capture_diag.py $i > $OUT/diag_$i.log 2>&1
  echo "experiment $i rc=$?"; grep -E "^(A|B|==|   |  [0-9])" $OUT/diag_$i.log | head -40
done
timeout 120 python3 -m pytest -x -q -p no:cacheprovider --timeout 100 tests/megatron/test_update_gpu.py \
  -k "cuda_graphs-qwen3]" > $OUT/pytest_graphs.log 2>&1
echo "pytest rc=$?"; grep -v -i warn $OUT/pytest_graphs.log | grep -E "Error|error|assert|FAILED|passed|failed" | head -30
