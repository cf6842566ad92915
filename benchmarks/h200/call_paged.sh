# GPU call (issue 30): the paged KV cache. Its GPU tests (split-K attention through a page
# table; the native decoder's HF parity, graphs and FP8 decode on the paged pool), the paged
# kernel against the rectangle and FlashAttention (decode_attention.py), and the decode step
# of the dense e2e shape at 256 rows (profile_decode.py, as last session's 7.99 ms); the colocated
# sync of the e2e MoE slice with the cached bucket layouts and the engine's bucket loader.
#   bash benchmarks/h200/call_paged.sh   # PAGED_PART=tests|micro|profile|sync to run one part
source benchmarks/h200/setup.sh
part=${PAGED_PART:-all}
if [ $part = all ] || [ $part = tests ]; then
  timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -v -p no:cacheprovider -p no:xdist \
    tests/gpu/test_decode_attention_gpu.py tests/gpu/test_native_decode_gpu.py \
    tests/gpu/test_fp8_moe_gpu.py tests/gpu/test_ipc_sync_gpu.py -k "${TESTS_K:-not nothing}" > $OUT/gpu_tests.log 2>&1
  echo "gpu tests rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed|Error" $OUT/gpu_tests.log | tail -30
fi
if [ $part = all ] || [ $part = micro ]; then
  timeout 150 python3 benchmarks/decode_attention.py --rows 64 512 --contexts 1024 2048 \
    --out $OUT/decode_attention.json > $OUT/decode_attention.log 2>&1
  echo "micro rc=$?"; grep -v "^{" $OUT/decode_attention.log | tail -14
fi
if [ $part = all ] || [ $part = profile ]; then
  for shape in ${PAGED_SHAPES:-e2e_dense}; do
    timeout ${PROFILE_TIMEOUT:-120} python3 benchmarks/profile_decode.py --shape $shape \
      --rows ${PAGED_ROWS:-256} --prompt-len 512 --out $OUT > $OUT/profile_$shape.log 2>&1
    echo "profile $shape rc=$?"; grep -E '"(split_attention|graph_replay_ms|engine_step_ms|engine_tokens_per_s|eager_device_ms_per_call)"|Error' \
      $OUT/profile_$shape.log | tr -d '\n'; echo
  done
fi
if [ $part = all ] || [ $part = sync ]; then
  timeout ${SYNC_TIMEOUT:-150} python3 benchmarks/colocated_sync.py --shape e2e_moe \
    --out $OUT/colocated_sync.json > $OUT/colocated_sync.log 2>&1
  echo "colocated sync rc=$?"; grep -E '^\{"(packed|zero_copy)"|Error' $OUT/colocated_sync.log | cut -c1-600
fi
