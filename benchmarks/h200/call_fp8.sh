# H200 calls (issue 31): the FP8 GPU tests (which GEMM the engine gets; the colocated FP8 sync
# exact against a CPU quantization of the actor's export), then decode throughput
# of the embedded engine in block FP8 against bf16 on one of e2e_step's shapes, 64 and 512
# prompts (256 prompt + 256 new tokens), written to $OUT/fp8_decode_h200.json for
# benchmarks/results/. One shape a call (both did not finish 64 prompts in 200 s on an H100):
#   bash benchmarks/h200/call_fp8.sh                      # e2e_moe
#   FP8_SHAPES=e2e_dense FP8_TESTS=0 bash benchmarks/h200/call_fp8.sh
#   FP8_MICRO=1 FP8_TESTS=0 FP8_PROMPTS= bash ...   # only fp8_gemm_micro.py (per-projection us)
#   FP8_TESTS_SKIP="(native_decoder or grouped)" FP8_PROMPTS= bash ...   # some of the tests only
#   FP8_IGNORED=self_attn FP8_TESTS=0 bash ...   # the attention in bf16 (rollout.fp8_attention=false)
# Each generation's seconds go to $OUT/fp8_decode_<prompts>.log as they happen.
source benchmarks/h200/setup.sh
if [ "${FP8_TESTS:-1}" = 1 ]; then
  timeout ${FP8_TESTS_TIMEOUT:-300} python3 -m pytest -v -p no:cacheprovider tests/gpu/test_fp8_gpu.py \
    tests/gpu/test_fp8_moe_gpu.py -k "not ${FP8_TESTS_SKIP:-nothing_skipped}" \
    "tests/gpu/test_train_gpu.py::test_fp8_rollout_on_one_gpu_holds_the_quantized_actor_exactly" \
    > $OUT/fp8_gpu_tests.log 2>&1
  echo "fp8 gpu tests rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed|assert" \
    $OUT/fp8_gpu_tests.log | tail -12
fi
if [ "${FP8_MICRO:-0}" != 0 ]; then  # per-projection us, bf16 vs FP8 (FP8_MICRO=moe: + experts)
  timeout 150 python3 benchmarks/h200/fp8_gemm_micro.py $([ "$FP8_MICRO" = moe ] && echo --moe) --out $OUT/fp8_gemm_micro.json \
    > $OUT/fp8_gemm_micro.log 2>&1
  echo "fp8 gemm micro rc=$?"; tail -22 $OUT/fp8_gemm_micro.log
fi
for prompts in ${FP8_PROMPTS-64 512}; do  # FP8_PROMPTS= (empty): none
  timeout ${FP8_TIMEOUT:-240} python3 benchmarks/rollout_throughput.py --device cuda --no-http \
    --quantization fp8 ${FP8_IGNORED:+--fp8-ignored-layers $FP8_IGNORED} \
    --shapes ${FP8_SHAPES:-e2e_moe} --num-prompts $prompts \
    --hf-repeats 0 --repeats 2 --out $OUT/fp8_decode_$prompts.json > $OUT/fp8_decode_$prompts.log 2>&1
  echo "decode $prompts prompts rc=$?"; grep -E "engine|floor|fp8 / bf16|Error" \
    $OUT/fp8_decode_$prompts.log | tail -12
done
python3 - <<'PY'
import json, os, pathlib
out = pathlib.Path(os.environ["OUT"])
rows = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("fp8_decode_*.json"))}
(out / "fp8_decode_h200.json").write_text(json.dumps(rows, indent=2))
PY
