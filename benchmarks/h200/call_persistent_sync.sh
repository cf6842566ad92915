# GPU call (issue 30): the persistent colocated sync: its GPU tests (CUDA IPC, the colocated
# training run) and benchmarks/colocated_sync.py on the e2e MoE slice (packed, zero-copy, persistent).
source benchmarks/h200/setup.sh
timeout 300 python3 -m pytest -q -p no:cacheprovider -p no:xdist tests/gpu/test_ipc_sync_gpu.py "tests/gpu/test_train_gpu.py::test_colocated_training_on_one_gpu_syncs_every_tensor" > $OUT/gpu_tests.log 2>&1
echo "tests rc=$?"; grep -E "passed|failed|Error" $OUT/gpu_tests.log | tail -8
timeout 240 python3 benchmarks/colocated_sync.py --shape e2e_moe --out $OUT/colocated_sync.json > $OUT/colocated_sync.log 2>&1
echo "sync rc=$?"; grep -E '^\{"(packed|zero_copy|persistent)"|Error' $OUT/colocated_sync.log | cut -c1-700
