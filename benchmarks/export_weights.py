"""The weight sync's export (HF-named tensors out of the megatron actor) on one rank: megarl's
direct path (megarl.megatron.hf_export) with its recorded views (every export after the first),
the same path recording again each time (``direct_recording``: mbridge's per-parameter
conversion, as every export ran before the views were kept), mbridge's ``export_weights`` and a
copy of every parameter, in the same run.

    python benchmarks/export_weights.py [--device cpu|cuda] [--experts 32] [--layers 4]
                                        [--out outputs/bench/export_weights.json]

The copy is a floor for an export that copies (each tensor cloned once); an export of views
can beat it. Figures: milliseconds per export (best of --repeats), HF tensors, bytes, GB/s.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist


def best_of(repeats: int, fn) -> float:
    """Fastest of ``repeats`` timed calls (after one warm-up call), seconds."""
    fn()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("outputs/bench/export_weights.json"))
    args = p.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29581"),
                      RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    from megarl.data.tiny_model import make_tiny_model
    from megarl.megatron import hf_export
    from megarl.megatron.hf_export import export_hf_weights
    from megarl.megatron.model import build_actor_model
    from megarl.megatron.parallel import ParallelSizes

    model_dir = make_tiny_model(Path(tempfile.mkdtemp()) / "model", arch="qwen3_moe", seed=0,
                                hidden_size=512, num_hidden_layers=args.layers,
                                num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                                intermediate_size=1024, num_experts=args.experts,
                                num_experts_per_tok=4, moe_intermediate_size=256,
                                vocab_size=4096, with_tokenizer=False)
    model = build_actor_model(str(model_dir), ParallelSizes(), torch.bfloat16)
    params = [p for c in model.chunks for p in c.parameters()]
    stats = {"tensors": 0, "bytes": 0}

    def drain(tensors) -> None:
        stats["tensors"] = stats["bytes"] = 0
        for _, t in tensors:
            stats["tensors"] += 1
            stats["bytes"] += t.numel() * t.element_size()

    with torch.no_grad():
        direct = best_of(args.repeats, lambda: drain(export_hf_weights(model)))
        recording = best_of(args.repeats, lambda: (hf_export._PLANS.clear(),
                                                   drain(export_hf_weights(model))))
        mbridge = best_of(args.repeats, lambda: drain(model.bridge.export_weights(model.chunks)))
        copy = best_of(args.repeats, lambda: [p.detach().clone() for p in params])
    gb = stats["bytes"] / 1e9
    result = {"device": args.device, "experts": args.experts, "layers": args.layers,
              "hf_tensors": stats["tensors"], "bytes": stats["bytes"],
              "direct_ms": direct * 1e3, "direct_recording_ms": recording * 1e3,
              "mbridge_ms": mbridge * 1e3, "copy_ms": copy * 1e3,
              "recorded_views_speedup": recording / direct,
              "direct_gb_per_s": gb / direct, "mbridge_gb_per_s": gb / mbridge,
              "copy_gb_per_s": gb / copy, "direct_over_mbridge_speedup": mbridge / direct}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
