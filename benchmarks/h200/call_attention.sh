# GPU call (issue 30): the split-K decode attention kernel: its GPU tests and the native decoder's
# (HF parity with it in the step), the kernel against FlashAttention's varlen one on the e2e
# head layouts, and the e2e shapes' decode step at 512 rows of 1,024-token prompts with each
# attention (profile_decode.py --flash-attention, same machine).
#   bash benchmarks/h200/call_attention.sh       # ATT_PART=tests|micro|profile to run one part
source benchmarks/h200/setup.sh
part=${ATT_PART:-all}
if [ $part = all ] || [ $part = tests ]; then
  timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -v -p no:cacheprovider -p no:xdist \
    tests/gpu/test_decode_attention_gpu.py tests/gpu/test_native_decode_gpu.py \
    -k "${TESTS_K:-not nothing}" > $OUT/gpu_tests.log 2>&1
  echo "gpu tests rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/gpu_tests.log | tail -20
fi
if [ $part = all ] || [ $part = micro ]; then
  timeout 150 python3 benchmarks/decode_attention.py --out $OUT/decode_attention.json \
    > $OUT/decode_attention.log 2>&1
  echo "micro rc=$?"; grep -v "^{" $OUT/decode_attention.log | tail -30
fi
if [ $part = all ] || [ $part = profile ]; then
  for shape in ${ATT_SHAPES:-e2e_dense e2e_moe}; do
    for flag in "" --flash-attention; do
      tag=${shape}${flag:+_flash}
      timeout ${PROFILE_TIMEOUT:-120} python3 benchmarks/profile_decode.py --shape $shape \
        --rows 512 --prompt-len 1024 $flag --out $OUT > $OUT/profile_$tag.log 2>&1
      echo "profile $tag rc=$?"; grep -E '"(split_attention|graph_replay_ms|engine_step_ms|engine_tokens_per_s|eager_device_ms_per_call)"|Error' \
        $OUT/profile_$tag.log | tr -d '\n'; echo
    done
  done
fi
