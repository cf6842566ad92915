# GPU calls (issue 30, decode): where the embedded engine's decode step spends its time, and
# the bf16 expert layer's alternatives at decode batch sizes.
#   bash benchmarks/h200/call_profile.sh                                  # micro + MoE 512 bf16
#   PROFILE_MICRO=0 PROFILES="e2e_moe:512:fp8 e2e_dense:512:bf16" bash benchmarks/h200/call_profile.sh
# Writes $OUT/fp8_gemm_micro.json, $OUT/decode_<shape>_<rows>_<quant>.json and the kernel tables.
source benchmarks/h200/setup.sh
if [ "${PROFILE_MICRO:-1}" = 1 ]; then
  timeout ${MICRO_TIMEOUT:-200} python3 benchmarks/h200/fp8_gemm_micro.py --moe-only \
    --rows ${MICRO_ROWS:-64 128 256 512} --out $OUT/fp8_gemm_micro.json > $OUT/fp8_gemm_micro.log 2>&1
  echo "moe micro rc=$?"; tail -6 $OUT/fp8_gemm_micro.log | cut -c1-900
fi
for spec in ${PROFILES-e2e_moe:512:bf16}; do
  IFS=: read shape rows quant <<< "$spec"
  q=$([ "$quant" = fp8 ] && echo "--quantization fp8")
  timeout ${PROFILE_TIMEOUT:-200} python3 benchmarks/profile_decode.py --shape $shape --rows $rows \
    $q --out $OUT > $OUT/profile_${shape}_${rows}_${quant}.log 2>&1
  echo "profile $spec rc=$?"; grep -E '"(cuda_graphs|fast_kernels|graph_replay_ms|engine_step_ms|engine_tokens_per_s|eager_device_ms_per_call|sample_ms)"|Error' \
    $OUT/profile_${shape}_${rows}_${quant}.log | tr -d '\n'; echo
  head -28 $OUT/kernels_${shape}_${rows}_${quant}_step.txt 2>/dev/null | cut -c1-60,100-190
done
