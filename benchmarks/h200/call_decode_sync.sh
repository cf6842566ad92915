# GPU calls (issue 30): the decode step with packed GQA attention and grouped experts against
# the decoder without them (profile_decode.py --baseline, same machine), the colocated sync's
# zero-copy views against packed buckets, the export's cached views, and their GPU tests.
#   DS_PART=a bash benchmarks/h200/call_decode_sync.sh   # GPU tests + MoE 512 bf16 profiles
#   DS_PART=b bash benchmarks/h200/call_decode_sync.sh   # MoE 512 fp8, MoE 64, sync, export
#   DS_PART=ab ...  # one call: the GPU tests but FP8's, MoE 512 bf16 profiles, sync, export
#   DS_PART=c ...   # then: MoE 512 fp8 and MoE 64 bf16, each against its baseline
#   DS_PART=s ...   # the sync and the export only
source benchmarks/h200/setup.sh
profile() {  # shape rows quant [--baseline]
  local tag=$1_$2_$3${4:+_baseline} q=$([ "$3" = fp8 ] && echo "--quantization fp8")
  timeout ${PROFILE_TIMEOUT:-150} python3 benchmarks/profile_decode.py --shape $1 --rows $2 $q $4 \
    --out $OUT > $OUT/profile_$tag.log 2>&1
  echo "profile $tag rc=$?"; grep -E '"(grouped_experts|graph_replay_ms|engine_step_ms|engine_tokens_per_s|eager_device_ms_per_call)"|Error' \
    $OUT/profile_$tag.log | tr -d '\n'; echo
}
sync_export() {
  timeout 200 python3 benchmarks/colocated_sync.py --shape e2e_moe --out $OUT/colocated_sync.json \
    > $OUT/colocated_sync.log 2>&1
  echo "colocated sync rc=$?"; grep -E '^\{"(packed|zero_copy)"|Error' $OUT/colocated_sync.log | cut -c1-600
  [ "${EXPORT:-1}" = 1 ] || return 0
  timeout 120 python3 benchmarks/export_weights.py --device cuda --experts 128 --layers 8 \
    --out $OUT/export_weights.json > $OUT/export_weights.log 2>&1
  echo "export rc=$?"; grep -E '"(hf_tensors|direct_ms|mbridge_ms|copy_ms|direct_over_mbridge_speedup)"|Error' $OUT/export_weights.log | tr -d '\n'; echo
}
if [ "${DS_PART:-a}" = ab ]; then
  timeout ${TESTS_TIMEOUT:-260} python3 -m pytest -v -p no:cacheprovider -p no:xdist \
    tests/gpu/test_native_decode_gpu.py tests/gpu/test_ipc_sync_gpu.py \
    "tests/gpu/test_train_gpu.py::test_colocated_training_on_one_gpu_syncs_every_tensor" \
    -k "${TESTS_K:-not nothing}" > $OUT/gpu_tests.log 2>&1
  echo "gpu tests rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/gpu_tests.log | tail -20
  profile e2e_moe 512 bf16
  profile e2e_moe 512 bf16 --baseline
  [ "${SYNC:-1}" = 1 ] && sync_export
fi
if [ "${DS_PART:-a}" = a ]; then
  timeout ${TESTS_TIMEOUT:-330} python3 -m pytest -v -p no:cacheprovider -p no:xdist \
    tests/gpu/test_native_decode_gpu.py tests/gpu/test_ipc_sync_gpu.py tests/gpu/test_fp8_moe_gpu.py \
    "tests/gpu/test_train_gpu.py::test_colocated_training_on_one_gpu_syncs_every_tensor" \
    > $OUT/gpu_tests.log 2>&1
  echo "gpu tests rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/gpu_tests.log | tail -30
  profile e2e_moe 512 bf16
  profile e2e_moe 512 bf16 --baseline
  head -16 $OUT/kernels_e2e_moe_512_bf16_step.txt | cut -c1-60,100-190
fi
if [ "${DS_PART:-a}" = b ]; then
  profile e2e_moe 512 fp8
  profile e2e_moe 64 bf16
  profile e2e_moe 64 bf16 --baseline
  sync_export
fi
if [ "${DS_PART:-a}" = c ]; then  # after ab: the other profiles
  profile e2e_moe 512 fp8
  profile e2e_moe 512 fp8 --baseline
  profile e2e_moe 64 bf16
  profile e2e_moe 64 bf16 --baseline
fi
if [ "${DS_PART:-a}" = s ]; then
  sync_export
fi
