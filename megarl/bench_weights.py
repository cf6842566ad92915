"""``megarl bench weight-sync``: the real export -> transport -> embedded engines path, timed.

    megarl bench weight-sync [--backend nccl nixl ipc disk] [--engines 2] [--model PATH]
                             [--tp 1] [--pp 1] [--ep 1] [--bucket-mb 64] [--repeats 3]
                             [--lora-rank 0]

Starts ``--engines`` embedded engine servers on the model and ``tp * pp * ep`` train ranks (gloo
on CPU, NCCL on GPUs) that build it with Megatron under that layout; rank 0 streams the export
to the engines over each backend. The first update per backend is checked: every tensor's
checksum on every engine must equal what rank 0 exported (it is not timed); then the best of
``--repeats`` updates gives GB/s (model bytes landed in every engine per second) and its ratio to
the floor measured in the same run: the copy bandwidth of the memory the buckets live in (a
512 MB host ``copy_`` on CPU, a device-to-device copy on GPU). An export-only pass (the gathers,
no transfer) is timed too, to show how much of a sync is the export. Without ``--model`` a random
Qwen3 dense model of about ``--size-mb`` is generated (a Qwen3-MoE when ``--ep`` > 1).

With ``--lora-rank r`` the model gets LoRA adapters (``actor.lora``'s default targets, B drawn
away from zero) and the engines ``--enable-lora``: each backend row is then the *merged* sync
(``actor.lora.sync: merged``, ``W + scale * B @ A`` under the base names, checked as above),
and an ``adapter`` row times the *adapter* sync (``actor.lora.sync: adapter``): the adapters
gathered in PEFT's format, one flattened bucket posted to every engine's
``/load_lora_adapter_from_tensors``, the previous version unloaded.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import queue
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megarl.children import die_with_parent, in_spawner_thread
from megarl.net import free_port

BACKENDS = ("nccl", "nixl", "ipc", "disk")
MB = 1 << 20


@dataclass(frozen=True)
class RankJob:
    """What every train rank of the benchmark needs."""

    model_dir: str
    tp: int
    pp: int
    ep: int
    dtype: str
    urls: tuple[str, ...]
    backends: tuple[str, ...]
    bucket_mb: float
    repeats: int
    disk_dir: str
    lora_rank: int = 0


def generated_model(root: Path, size_mb: float, moe: bool) -> Path:
    """A random Qwen3 (dense, or MoE with 8 experts) of about ``size_mb`` MB in fp32."""
    from megarl.data.tiny_model import make_tiny_model

    hidden, vocab, heads, kv_heads, head_dim = 1024, 4096, 8, 4, 128
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    if moe:
        mlp = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 768}
        layer = attention + 8 * 3 * hidden * 768 + 8 * hidden
    else:
        mlp = {"intermediate_size": 3 * hidden}
        layer = attention + 3 * hidden * 3 * hidden
    embed_mb = 2 * vocab * hidden * 4 / MB
    layers = max(1, round((size_mb - embed_mb) / (layer * 4 / MB)))
    return make_tiny_model(root / "model", arch="qwen3_moe" if moe else "qwen3",
                           with_tokenizer=False, hidden_size=hidden, vocab_size=vocab,
                           num_attention_heads=heads, num_key_value_heads=kv_heads,
                           head_dim=head_dim, num_hidden_layers=layers, **mlp)


def copy_floor_gbs(device: torch.device, nbytes: int = 512 * MB, repeats: int = 5) -> float:
    """GB/s of ``dst.copy_(src)`` on a large buffer of ``device`` (best of ``repeats``)."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def _transport(kind: str, device: torch.device, disk_dir: str) -> Any:
    from megarl.weights.transports import SENDERS

    if kind == "disk":
        return SENDERS[kind](root=Path(disk_dir))
    return SENDERS[kind](device=device)


def _measure_backend(job: RankJob, kind: str, exporter: Any, device: torch.device,
                     dtype: torch.dtype) -> dict[str, Any] | None:
    """One backend on every rank: a checked update, then ``repeats`` timed ones."""
    from megarl.weights import WeightSender, sync_weights
    from megarl.weights.links import HttpLink

    sender = link = None
    if exporter.is_sender:
        link = HttpLink(list(job.urls), timeout_s=600)
        sender = WeightSender(_transport(kind, device, job.disk_dir), link,
                              bucket_size_mb=job.bucket_mb, dtype=dtype)
        sender.connect()
    try:
        check = sync_weights(exporter, sender, f"{kind}-check", verify_checksums=True)
        timed = [sync_weights(exporter, sender, f"{kind}-{r}") for r in range(job.repeats)]
    finally:
        if sender is not None and link is not None:
            sender.close()
            link.close()
    if check is None:
        return None
    bad = {i: m[:3] for i, m in (check.mismatches or {}).items() if m}
    if bad:
        raise RuntimeError(f"backend {kind}: engines hold other tensors than rank 0 exported: "
                           f"{bad}")
    best = min(r.seconds for r in timed if r is not None)
    return {"backend": kind, "seconds": best, "gb_per_s": check.bytes / best / 1e9,
            "bytes": check.bytes, "tensors_checked": check.num_tensors * len(job.urls),
            "buckets": check.num_buckets, "peak_buffer_mb": check.peak_buffer_bytes / MB}


def run_rank(job: RankJob) -> dict[str, Any] | None:
    """Build the model on this rank and run every backend; rank 0 returns the figures."""
    import torch.distributed as dist

    from megarl.megatron.model import build_actor_model
    from megarl.megatron.parallel import ParallelSizes
    from megarl.weights import MegatronExporter, parse_dtype

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    dtype = parse_dtype(job.dtype)
    model = build_actor_model(job.model_dir, ParallelSizes(tp=job.tp, pp=job.pp, ep=job.ep),
                              dtype, spec="native" if job.lora_rank else "auto")
    settings = _with_adapters(model, job.lora_rank) if job.lora_rank else None
    exporter = MegatronExporter(model)
    exporter.specs()
    start = time.perf_counter()
    exported = sum(t.numel() * t.element_size() for _, t in exporter.named_tensors())
    export_s = time.perf_counter() - start
    rows = [_measure_backend(job, kind, exporter, device, dtype) for kind in job.backends]
    if settings is not None:
        rows.append(_measure_adapter_sync(job, model, settings))
    if dist.get_rank() != 0:
        return None
    return {"rows": rows, "export_s": export_s, "export_bytes": exported,
            "floor_gbs": copy_floor_gbs(device)}


def _with_adapters(model: Any, rank: int) -> Any:
    """Adapters of rank ``rank`` on ``actor.lora``'s default targets, B seeded away from zero
    (a merge of B = 0 would change nothing); returns their LoraSettings."""
    from megarl.megatron.lora import adapters, apply_lora
    from megarl.megatron.settings import LoraSettings

    settings = LoraSettings(rank=rank, alpha=2.0 * rank)
    apply_lora(model, settings)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for adapter in adapters(model).values():
            for name, param in adapter.named_parameters():
                if name.startswith("lora_B"):
                    param.copy_(0.01 * torch.randn(param.shape, generator=generator))
    return settings


def _measure_adapter_sync(job: RankJob, model: Any, settings: Any) -> dict[str, Any] | None:
    """The adapter sync, ``repeats`` times (each a new adapter name, the previous unloaded):
    gather in PEFT's format (collective), routed experts' adapters one per expert as the
    trainer sends them, flatten, post to every engine; rank 0 returns the
    figures of the fastest."""
    import httpx

    from megarl.megatron.lora import peft_adapter
    from megarl.weights.expert_adapters import per_expert_adapter
    from megarl.weights.flattened import FLATTENED_BUCKET, flatten_bucket, serialize

    def post(client: httpx.Client, path: str, body: dict[str, Any]) -> None:
        for url in job.urls:
            answer = client.post(url + path, json=body).json()
            if not answer.get("success"):
                raise RuntimeError(f"adapter sync: {url}{path}: {answer.get('error_message')}")

    times, sent, previous = [], 0, None
    with httpx.Client(timeout=600, trust_env=False) as client:  # engines directly (M5)
        for r in range(job.repeats + 1):  # the first one is not timed
            start = time.perf_counter()
            adapter = peft_adapter(model, settings)
            if adapter is None:
                continue
            config, tensors = per_expert_adapter(*adapter)  # what the trainer sends
            payload = flatten_bucket([(k, v.detach().cpu()) for k, v in tensors.items()])
            name = f"bench-{r}"
            post(client, "/load_lora_adapter_from_tensors",
                 {"lora_name": name, "config_dict": config, "serialized_tensors":
                  serialize(payload), "load_format": FLATTENED_BUCKET})
            if previous is not None:
                post(client, "/unload_lora_adapter", {"lora_name": previous})
            previous = name
            sent = sum(t.numel() * t.element_size() for t in tensors.values())
            if r:
                times.append(time.perf_counter() - start)
    if not times:
        return None
    best = min(times)
    return {"backend": "adapter", "seconds": best, "gb_per_s": sent / best / 1e9, "bytes": sent,
            "tensors_checked": 0, "buckets": 1, "peak_buffer_mb": sent / MB}


def _rank_main(rank: int, world_size: int, port: int, job: RankJob, results: Any) -> None:
    parent = multiprocessing.parent_process()
    die_with_parent(parent.pid if parent else None)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    import torch.distributed as dist

    if torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=rank,
                            world_size=world_size)
    try:
        results.put((rank, True, run_rank(job)))
    except BaseException:  # noqa: BLE001 - the traceback goes back to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def run_ranks(job: RankJob, timeout_s: float) -> dict[str, Any]:
    """Spawn ``tp * pp * ep`` ranks on 127.0.0.1 and return rank 0's figures."""
    import torch.multiprocessing as mp

    world = job.tp * job.pp * job.ep
    port = free_port()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, job, results), daemon=True)
             for r in range(world)]
    in_spawner_thread(lambda: [proc.start() for proc in procs])
    outcomes: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(outcomes) < world:
            try:
                rank, ok, value = results.get(timeout=1.0)
                outcomes[rank] = (ok, value)
                continue
            except queue.Empty:
                pass
            dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in outcomes]
            failed = [v for ok, v in outcomes.values() if not ok]
            if dead or failed or time.monotonic() > deadline:
                why = f"ranks {dead} died" if dead else "a rank failed" if failed else "timeout"
                raise RuntimeError(f"weight-sync ranks stopped ({why}):\n" + "\n".join(failed))
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    failed = [v for ok, v in outcomes.values() if not ok]
    if failed:
        raise RuntimeError("weight-sync ranks failed:\n" + "\n".join(failed))
    return outcomes[0][1]


def build_parser() -> argparse.ArgumentParser:
    """Options of ``megarl bench weight-sync``."""
    p = argparse.ArgumentParser(prog="megarl bench weight-sync",
                                description=__doc__.splitlines()[0])
    p.add_argument("--backend", nargs="+", default=list(BACKENDS), choices=BACKENDS,
                   help="transports to measure (default: all four)")
    p.add_argument("--engines", type=int, default=2, help="embedded engine servers")
    p.add_argument("--model", default=None, help="HF model directory (default: generated)")
    p.add_argument("--size-mb", type=float, default=256.0,
                   help="size of the generated model when --model is not given")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--dtype", default=None,
                   help="train and rollout dtype (default: float32 on CPU, bfloat16 on GPU)")
    p.add_argument("--bucket-mb", type=float, default=64.0)
    p.add_argument("--repeats", type=int, default=3, help="timed updates per backend (best kept)")
    p.add_argument("--work-dir", default=None,
                   help="where the generated model, engine logs and disk updates go "
                        "(default: a new temporary directory)")
    p.add_argument("--timeout-s", type=float, default=1800.0)
    p.add_argument("--lora-rank", type=int, default=0,
                   help="LoRA adapters of this rank: the backends time the merged sync, an "
                        "'adapter' row the adapter sync (0: no adapters)")
    return p


def print_figures(args: argparse.Namespace, model: str, result: dict[str, Any]) -> None:
    """The table: one line per backend."""
    floor = result["floor_gbs"]
    export_gbs = result["export_bytes"] / result["export_s"] / 1e9
    print(f"model {model}: {result['export_bytes'] / 1e6:.1f} MB exported ({args.dtype}); layout "
          f"tp={args.tp} pp={args.pp} ep={args.ep}; {args.engines} engines; buckets of "
          f"{args.bucket_mb:g} MB; best of {args.repeats}")
    print(f"floor (memory copy): {floor:.2f} GB/s; export alone: {result['export_s']:.3f} s = "
          f"{export_gbs:.3f} GB/s")
    print(f"{'backend':<8} {'seconds':>8} {'GB/s':>7} {'x floor':>8} {'buckets':>8} "
          f"{'peak buf MB':>12} {'checked':>8}")
    for row in result["rows"]:
        print(f"{row['backend']:<8} {row['seconds']:>8.3f} {row['gb_per_s']:>7.3f} "
              f"{row['gb_per_s'] / floor:>8.3f} {row['buckets']:>8} "
              f"{row['peak_buffer_mb']:>12.1f} {row['tensors_checked']:>8}")
    adapter = next((r for r in result["rows"] if r["backend"] == "adapter"), None)
    if adapter is not None:
        merged = [r for r in result["rows"] if r["backend"] != "adapter"]
        fastest = min(merged, key=lambda r: r["seconds"]) if merged else None
        line = (f"LoRA rank {args.lora_rank}: the adapter sync sends {adapter['bytes'] / 1e6:.3f}"
                f" MB ({adapter['bytes'] / result['export_bytes']:.2%} of the merged model)")
        if fastest is not None:
            line += (f"; the fastest merged sync ({fastest['backend']}) takes "
                     f"{fastest['seconds'] / adapter['seconds']:.1f}x its time")
        print(line)


def weight_sync_main(argv: Sequence[str]) -> int:
    """``megarl bench weight-sync``: run and print the figures; 0 when every tensor matched."""
    from megarl.rollout.local.launch import launch_local_engines

    args = build_parser().parse_args(list(argv))
    for field in ("engines", "tp", "pp", "ep", "repeats"):
        if getattr(args, field) < 1:
            print(f"--{field}: must be >= 1", file=sys.stderr)
            return 2
    if args.lora_rank < 0:
        print("--lora-rank: must be >= 0 (0: no adapters)", file=sys.stderr)
        return 2
    on_gpu = torch.cuda.is_available()
    args.dtype = dtype = args.dtype or ("bfloat16" if on_gpu else "float32")
    with tempfile.TemporaryDirectory(dir=args.work_dir) as work:
        root = Path(work)
        model_dir = Path(args.model) if args.model else generated_model(root, args.size_mb,
                                                                        args.ep > 1)
        lora = ["--enable-lora"] if args.lora_rank else []
        servers = launch_local_engines(str(model_dir), args.engines,
                                       num_threads=None if on_gpu else 1,
                                       extra_args=["--dtype", dtype, *lora],
                                       log_dir=root / "logs", ready_timeout_s=args.timeout_s)
        try:
            job = RankJob(str(model_dir), args.tp, args.pp, args.ep, dtype,
                          tuple(s.url for s in servers), tuple(args.backend), args.bucket_mb,
                          args.repeats, str(root / "disk"), args.lora_rank)
            result = run_ranks(job, args.timeout_s)
        except RuntimeError as err:
            print(f"megarl bench weight-sync: {err}", file=sys.stderr)
            return 1
        finally:
            for server in servers:
                server.stop()
    model = args.model or f"generated {'qwen3_moe' if args.ep > 1 else 'qwen3'}"
    print_figures(args, model, result)
    return 0
