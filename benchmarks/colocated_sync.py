"""The colocated weight sync on one GPU: packed buckets against zero-copy views, same run.

An embedded engine serves a random model of one of ``rollout_throughput.SHAPES`` (``e2e_moe``:
the 8-layer Qwen3-30B-A3B slice of ``e2e_step.py``). This process plays the train rank: it holds
the model's HF tensors as a Megatron actor does after DDP wraps it (views of one contiguous bf16
buffer, in reverse order; q/k/v as separate tensors, as mbridge's QKV split copies them) and
sends them with :class:`~megarl.weights.sglang_sender.ColocatedSender` over
``/update_weights_from_tensor``, first packing every bucket (``zero_copy=False``, the path before
zero-copy), then as views of the buffer, then persistent (the engine keeps the views it was sent
once and each sync posts only the q/k/v, packed, with a replay of the views). Each mode syncs
``--repeats`` times after two warm-ups (the persistent mode registers there); the engine's
tensors are compared with the sender's after the last sync of each mode. Reported: seconds per
sync (median), GB/s over the bf16 bytes, the fraction of the device copy rate measured in the
same run (a copy of B bytes reads and writes B), and the sender's split into packing and waiting
for the engine.

    python benchmarks/colocated_sync.py --shape e2e_moe --out /tmp/colocated_sync.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rollout_throughput import build_model

from megarl.net import free_port
from megarl.rollout.local.launch import launch_local_engines
from megarl.rollout.local.weights import iter_safetensors
from megarl.weights.sglang_sender import ColocatedSender, Persist, plan_buckets


def actor_layout(named: list[tuple[str, torch.Tensor]], device: str
                 ) -> list[tuple[str, torch.Tensor]]:
    """The tensors as a one-GPU Megatron actor exports them: q/k/v fresh tensors, the rest
    views of one contiguous buffer laid out in reverse order."""
    qkv = ("q_proj.weight", "k_proj.weight", "v_proj.weight")
    split = [(n, t) for n, t in named if n.endswith(qkv)]
    rest = [(n, t) for n, t in named if not n.endswith(qkv)]
    buffer = torch.empty(sum(t.numel() for _, t in rest), dtype=torch.bfloat16, device=device)
    views, end = {}, buffer.numel()
    for name, tensor in reversed(rest):
        end -= tensor.numel()
        views[name] = buffer[end:end + tensor.numel()].view(tensor.shape).copy_(tensor)
    fresh = {n: t.to(device, torch.bfloat16).clone() for n, t in split}
    return [(n, views[n] if n in views else fresh[n]) for n, _ in named]


def persist(named: list[tuple[str, torch.Tensor]]) -> Persist:
    """What the worker hands the sender for a persistent sync: the actor buffer's storage (the
    views' memory) and the q/k/v tensors, made afresh at every export (here: the same ones)."""
    qkv = ("q_proj.weight", "k_proj.weight", "v_proj.weight")
    storages = frozenset((t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
                         for n, t in named if not n.endswith(qkv))
    fresh = [(n, t) for n, t in named if n.endswith(qkv)]
    return Persist(storages, storages, tuple(n for n, _ in fresh), lambda: iter(fresh))


def copy_rate(nbytes: int, device: str, repeats: int = 10) -> float:
    """Bytes copied per second by one device copy of ``nbytes``."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - start)
    del src, dst
    if device == "cuda":
        torch.cuda.empty_cache()
    return nbytes / min(times)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def engine_matches(url: str, named: list[tuple[str, torch.Tensor]], sample: int = 24) -> bool:
    """Whether the engine holds what was sent, on a sample of tensors (first rows)."""
    import asyncio

    from megarl.rollout.sglang.client import SGLangClient

    async def read():
        client = SGLangClient([url])
        try:
            step = max(1, len(named) // sample)
            for name, tensor in named[::step]:
                held = torch.tensor((await client.get_weights_by_name(name, 4))[0])
                if not torch.equal(held, tensor[:4].float().cpu()):
                    return False
            return True
        finally:
            await client.close()

    return asyncio.run(read())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="e2e_moe")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself")
    p.add_argument("--bucket-mb", type=float, default=2048)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    port = free_port()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    tmp = Path(tempfile.mkdtemp())
    model_dir = build_model(tmp, args.shape, args.device)
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.empty_cache()
    (server,) = launch_local_engines(str(model_dir), 1, device=args.device, log_dir=tmp,
                                     extra_args=["--dtype", "bfloat16"], ready_timeout_s=600)
    result: dict = {"shape": args.shape, "bucket_mb": args.bucket_mb,
                    "device": torch.cuda.get_device_name() if cuda else "cpu"}
    try:
        named = actor_layout(list(iter_safetensors(model_dir)), args.device)
        total = sum(t.numel() * 2 for _, t in named)
        plan = plan_buckets([(n, list(t.shape)) for n, t in named], "bfloat16", args.bucket_mb)
        result.update(tensors=len(named), bytes=total, buckets=len(plan))
        result["copy_bytes_per_s"] = copy_rate(min(total, 2 << 30), args.device)
        for mode, zero_copy in (("packed", False), ("zero_copy", True), ("persistent", False)):
            sender = ColocatedSender(0, 1, [server.url], 1, zero_copy=zero_copy)
            walls, packs, waits = [], [], []
            for repeat in range(args.repeats + 2):
                for _, t in named[:1]:
                    t.mul_(1.0)  # an update's last write, as the optimizer leaves it
                sync(args.device)
                start = time.perf_counter()
                sender.send(iter(named), plan, torch.device(args.device), f"{mode}-{repeat}",
                            persist=persist(named) if mode == "persistent" else None)
                wall = time.perf_counter() - start
                if repeat > 1:  # the persistent mode registers at its first (CPU: two) syncs
                    walls.append(wall)
                    packs.append(sender.seconds["pack"])
                    waits.append(sender.seconds["engine"])
            sender.close()
            wall = statistics.median(walls)
            result[mode] = {"sync_s": wall, "gb_per_s": total / wall / 1e9,
                            "copy_fraction": total / wall / result["copy_bytes_per_s"],
                            "pack_s": statistics.median(packs),
                            "engine_s": statistics.median(waits), "posts": dict(sender.posts),
                            "engine_matches": engine_matches(server.url, named)}
            print(json.dumps({mode: result[mode]}), flush=True)
        result["zero_copy_speedup"] = result["packed"]["sync_s"] / result["zero_copy"]["sync_s"]
        result["persistent_speedup"] = (result["packed"]["sync_s"]
                                        / result["persistent"]["sync_s"])
    finally:
        server.stop()
        dist.destroy_process_group()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
