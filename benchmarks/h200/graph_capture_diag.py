"""Which call invalidates the CUDA-graph capture of a multi-sequence micro-batch's backward
(the strict xfail of tests/megatron/test_update_gpu.py). One GPU, in-process:
A. FlashAttention varlen forward + backward captured alone, with an empty sequence;
B. the xfail update with every aten op of the backward capture logged (the ops before the error);
C. the same update with capture_error_mode relaxed and global.
It captures as GraphedChunk did before the leaf aliases (a fresh side stream per bucket, and the
capture on torch's own capture stream): on 2026-12-04 every capture failed at the first weight
gradient, next to torch's AccumulateGrad-stream warning (benchmarks/RESULTS.md)."""
import os
import sys
import tempfile
import threading

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

sys.path[:0] = ["tests/megatron", "tests"]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", RANK="0", WORLD_SIZE="1",
                  LOCAL_RANK="0")
torch.cuda.set_device(0)
if os.environ.get("DIAG_BLAS"):
    torch.backends.cuda.preferred_blas_library(os.environ["DIAG_BLAS"])
dist.init_process_group("nccl", rank=0, world_size=1)

from megarl.megatron.native_ops import flash_varlen_attention

EXPERIMENT = int(sys.argv[1]) if len(sys.argv) > 1 else 0
EXPERIMENTS = (("qwen3", "thread_local", True, 24), ("qwen3", "relaxed", False, 24),
               ("qwen3", "global", False, 24), ("qwen3", "thread_local", True, 14),
               ("qwen3_moe", "relaxed", False, 24))
for bounds in ([0, 10, 20, 32, 32], [0, 5, 10, 20, 32]) if EXPERIMENT == 0 else ():
    try:
        q = torch.randn(32, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(32, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(32, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                o = flash_varlen_attention(q, k, v, cu, 32, None)
                torch.autograd.grad(o, (q, k, v), torch.ones_like(o))
        torch.cuda.current_stream().wait_stream(s)
        g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(g1, capture_error_mode="thread_local"):
            o = flash_varlen_attention(q, k, v, cu, 32, None)
        go = torch.ones_like(o)
        with torch.cuda.graph(g2, capture_error_mode="thread_local"):
            torch.autograd.grad(o, (q, k, v), go)
        g1.replay()
        g2.replay()
        torch.cuda.synchronize()
        print("A flash varlen capture OK", bounds, flush=True)
    except Exception as err:  # noqa: BLE001 - a diagnosis reports every failure
        print("A flash varlen capture FAILED", bounds, err, flush=True)

from test_update import make_batch, update_on_rank

from megarl.data.tiny_model import make_tiny_model
from megarl.megatron import cuda_graphs
from megarl.megatron.native_layers import clear_rotary_tables
from megarl.megatron.parallel import ParallelSizes, destroy_parallel


class OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)][:3]
        self.ops.append(f"{func} {shapes} thread={threading.current_thread().name}")
        return func(*args, **(kwargs or {}))


SETTINGS = {"mode": "thread_local", "log": False}


def capture(self, bucket):
    bucket.leaves = self._leaves()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            out = self._run_forward(bucket)
            self._run_backward(bucket, out, torch.zeros_like(out))
            del out
    torch.cuda.current_stream().wait_stream(stream)
    if os.environ.get("DIAG_SYNC"):
        torch.cuda.synchronize()
    if self._pool is None:
        self._pool = torch.cuda.graph_pool_handle()
    clear_rotary_tables()
    forward, backward = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    mode = SETTINGS["mode"]
    log = OpLog()
    stage = "forward"
    try:
        with torch.cuda.graph(forward, pool=self._pool, capture_error_mode=mode):
            if SETTINGS["log"]:
                with log:
                    output = self._run_forward(bucket)
            else:
                output = self._run_forward(bucket)
        grad_output = torch.empty_like(output)
        stage = "backward"
        n_fwd = len(log.ops)
        with torch.cuda.graph(backward, pool=self._pool, capture_error_mode=mode):
            if SETTINGS["log"]:
                with log:
                    grads = self._run_backward(bucket, output, grad_output)
            else:
                grads = self._run_backward(bucket, output, grad_output)
    except Exception as err:
        print(f"B capture failed in the {stage} ({mode}, bucket {bucket.tokens}/"
              f"{bucket.sequences}): {str(err).splitlines()[0]}", flush=True)
        if SETTINGS["log"]:
            ops = log.ops[n_fwd:] if stage == "backward" else log.ops
            print(f"  {len(ops)} ops logged in the {stage}; the last 25:", flush=True)
            for line in ops[-25:]:
                print("   ", line, flush=True)
        raise
    finally:
        clear_rotary_tables()
    bucket.forward, bucket.backward = forward.replay, backward.replay
    bucket.output, bucket.grad_output, bucket.grads = output.detach(), grad_output, grads
    bucket.graphs = (forward, backward)
    print(f"B captured bucket {bucket.tokens}/{bucket.sequences} ({mode})", flush=True)


cuda_graphs.GraphedChunk._capture = capture
root = tempfile.mkdtemp()
dirs = {arch: str(make_tiny_model(os.path.join(root, arch), seed=0, arch=arch))
        for arch in ("qwen3", "qwen3_moe") if arch == EXPERIMENTS[EXPERIMENT][0]}
batches = {arch: make_batch(d) for arch, d in dirs.items()}
for arch, mode, log, budget in EXPERIMENTS[EXPERIMENT:EXPERIMENT + 1]:
    SETTINGS.update(mode=mode, log=log)
    print(f"== {arch} budget {budget} mode {mode}", flush=True)
    try:
        metrics, _ = update_on_rank(dirs[arch], ParallelSizes(), batches[arch], optimizer="adam",
                                    dtype=torch.bfloat16, budget=budget, graph_bucket=16,
                                    graph_emulate=False)
        print(f"   update passed: grad_norm {metrics['actor/grad_norm']:.5f}", flush=True)
    except BaseException as err:  # noqa: BLE001 - a diagnosis reports every failure
        print(f"   update failed: {str(err).splitlines()[0][:300]}", flush=True)
    destroy_parallel()
    torch.cuda.synchronize()
dist.destroy_process_group()
