"""The garbage collection of a colocated hand-off (``megarl.memory.free_cached_memory``, run
several times a step) in a train rank, with the rank's long-lived objects set aside after setup
(``settle_long_lived_objects``, what ``ActorWorker`` does) against without (all of them handed
back with ``gc.unfreeze``), in the same process.

    python benchmarks/handoff_gc.py [--device cpu|cuda] [--repeats 5]
                                    [--out outputs/bench/handoff_gc.json]

Figures: seconds per ``free_cached_memory`` (best of --repeats) both ways, their ratio, and the
objects the collector scans either way.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from pathlib import Path

import torch


def best_of(repeats: int, fn) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path("outputs/bench/handoff_gc.json"))
    args = p.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29541", RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    import torch.distributed as dist

    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=0, world_size=1)
    from megarl.data.tiny_model import make_tiny_model
    from megarl.megatron.optimizer import OptimizerSettings
    from megarl.megatron.parallel import ParallelSizes
    from megarl.megatron.update import LossSettings
    from megarl.megatron.worker import ActorSpec, ActorWorker
    from megarl.memory import free_cached_memory

    model = make_tiny_model(Path(tempfile.mkdtemp()) / "model", arch="qwen3_moe")
    ActorWorker(ActorSpec(model_path=str(model), dtype="float32", sizes=ParallelSizes(),
                          optim=OptimizerSettings(lr=1e-3), loss=LossSettings(), with_ref=False,
                          temperature=1.0, max_tokens_per_micro_batch=64, seed=1))
    settled_objects = len(gc.get_objects())
    settled = best_of(args.repeats, free_cached_memory)
    frozen = gc.get_freeze_count()
    gc.unfreeze()
    unsettled_objects = len(gc.get_objects())
    unsettled = best_of(args.repeats, free_cached_memory)
    result = {"device": args.device, "settled_s": settled, "unsettled_s": unsettled,
              "speedup": unsettled / max(settled, 1e-9), "objects_set_aside": frozen,
              "objects_scanned_settled": settled_objects,
              "objects_scanned_unsettled": unsettled_objects}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2), flush=True)
    os._exit(0)  # skips the interpreter's teardown of torch and megatron


if __name__ == "__main__":
    main()
