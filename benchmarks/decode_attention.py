"""Decode attention over the embedded engine's static KV cache: FlashAttention's varlen kernel
(what the native decoder ran before) against the split-K Triton kernel
(``megarl.rollout.local.decode_attention_triton``), same inputs, same run.

For each head layout of the e2e shapes (``dense``: Qwen3-1.7B's 16 query heads over 8 KV heads;
``moe``: the Qwen3-30B-A3B slice's 32 over 4; head_dim 128, bf16) and each (rows, context):
rows with log-normal lengths around the context (the e2e benchmark's long tail) in a cache of
the engine's capacity, and rows padded to the decode-graph bucket (``--padded``: a quarter of
the rows at the scratch column, as the engine's graphs run them). Reported: microseconds per
call (median of CUDA events), the K/V bytes the rows' tokens hold, and that over the time (the
bandwidth each kernel reaches; the HBM copy rate is measured in the same run), and the largest
difference between the two outputs. ``paged``: the split kernel over the same tokens in a page
pool (kv_cache.PagedKVCache's layout, the pages shuffled) through a page table, as the engine
runs it now; ``paged_over_split`` is its speed against the rectangle's.

    python benchmarks/decode_attention.py --out /tmp/decode_attention.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from colocated_sync import copy_rate
from profile_decode import cuda_ms

from megarl.rollout.local.decode_attention_triton import decode_attention, num_splits
from megarl.rollout.local.kv_cache import PAGE_SIZE

LAYOUTS = {"dense": (16, 8), "moe": (32, 4)}


def cuda_us(fn, repeats: int = 20) -> float:
    """Median microseconds of ``fn`` between CUDA events."""
    return cuda_ms(fn, repeats=repeats) * 1e3


def case(layout: str, rows: int, context: int, padded: bool, seed: int = 0) -> dict:
    heads, kv_heads = LAYOUTS[layout]
    dim, capacity = 128, 2 * context + 256
    rng = random.Random(seed)
    real = rows - rows // 4 if padded else rows
    used = [max(1, min(capacity - 2, round(rng.lognormvariate(math.log(context), 0.5))))
            for _ in range(real)] + [1] * (rows - real)  # padded rows attend to one token
    q = torch.randn(rows, heads, dim, device="cuda", dtype=torch.bfloat16)
    keys = torch.randn(rows, capacity, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    values = torch.randn_like(keys)
    used_t = torch.tensor(used, dtype=torch.int32, device="cuda")
    # FlashAttention as the decoder called it: padded rows read the whole capacity
    flash_used = torch.tensor([u if i < real else capacity for i, u in enumerate(used)],
                              dtype=torch.int32, device="cuda")
    cu_q = torch.arange(rows + 1, device="cuda", dtype=torch.int32)
    scale = dim ** -0.5

    def flash(seqused=flash_used):
        return torch.ops.aten._flash_attention_forward(
            q, keys.view(-1, kv_heads, dim), values.view(-1, kv_heads, dim), cu_q,
            cu_q * capacity, 1, capacity, 0.0, False, False, scale=scale,
            seqused_k=seqused)[0]

    def split():
        return decode_attention(q, keys, values, used_t, scale)

    # the same tokens in the engine's page pool, its pages shuffled (a row's pages lie anywhere)
    cols = capacity // PAGE_SIZE
    order = torch.randperm(rows * cols, device="cuda")  # pool page i holds rectangle page order[i]
    where = torch.empty_like(order)
    where[order] = torch.arange(rows * cols, device="cuda")
    table = where.view(rows, cols).to(torch.int32)
    pool_k, pool_v = (t.view(rows * cols, PAGE_SIZE, kv_heads, dim)[order] for t in (keys, values))

    def paged():
        return decode_attention(q, pool_k, pool_v, used_t, scale, pages=table)

    token_bytes = 2 * kv_heads * dim * 2
    kv_bytes = sum(used) * token_bytes
    out = {"layout": layout, "rows": rows, "context": context, "padded": padded,
           "capacity": capacity, "kv_gb": kv_bytes / 1e9,
           "splits": num_splits(rows, kv_heads, capacity,
                                2 * torch.cuda.get_device_properties(0).multi_processor_count),
           "max_abs_diff": float((flash(used_t).float() - split().float()).abs().max()),
           "paged_max_abs_diff": float((paged().float() - split().float()).abs().max())}
    out["flash_us"] = cuda_us(flash)
    out["flash_same_rows_us"] = cuda_us(lambda: flash(used_t))
    out["split_us"] = cuda_us(split)
    out["paged_us"] = cuda_us(paged)
    for name in ("flash", "flash_same_rows", "split", "paged"):
        out[f"{name}_tb_per_s"] = kv_bytes / (out[f"{name}_us"] / 1e6) / 1e12
    out["speedup"] = out["flash_us"] / out["split_us"]
    out["paged_over_split"] = out["split_us"] / out["paged_us"]
    return out


def tiling_sweep() -> dict[str, float]:
    """The main kernel's (keys per step, warps, stages) on the dense layout, 512 rows of ~1,024
    tokens: microseconds per call of each."""
    heads, kv_heads = LAYOUTS["dense"]
    rows, capacity = 512, 2304
    q = torch.randn(rows, heads, 128, device="cuda", dtype=torch.bfloat16)
    keys = torch.randn(rows, capacity, kv_heads, 128, device="cuda", dtype=torch.bfloat16)
    values = torch.randn_like(keys)
    rng = random.Random(1)
    used = torch.tensor([max(1, min(capacity - 2, round(rng.lognormvariate(math.log(1024), 0.5))))
                         for _ in range(rows)], dtype=torch.int32, device="cuda")
    out = {}
    for tiling in ((64, 4, 2), (64, 4, 3), (32, 4, 2), (64, 8, 2), (128, 8, 2), (128, 4, 2)):
        try:
            out[str(tiling)] = cuda_us(lambda tiling=tiling: decode_attention(
                q, keys, values, used, 0.1, tiling=tiling))
        except Exception as err:  # noqa: BLE001 (a tiling that does not compile: say so)
            out[str(tiling)] = f"failed: {str(err)[:200]}"
        print(f"tiling {tiling}: {out[str(tiling)]}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("decode_attention.json"))
    p.add_argument("--rows", type=int, nargs="*", default=[8, 64, 512])
    p.add_argument("--contexts", type=int, nargs="*", default=[512, 1024, 2048])
    args = p.parse_args(argv)
    rate = copy_rate(1 << 30, "cuda")
    print(f"copy rate {rate / 1e12:.2f} TB/s", flush=True)
    results = []
    for layout in LAYOUTS:
        for rows in args.rows:
            for context in args.contexts:
                for padded in (False, True):
                    if padded and rows < 8:
                        continue
                    r = case(layout, rows, context, padded)
                    results.append(r)
                    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                                      for k, v in r.items()}), flush=True)
                    torch.cuda.empty_cache()
    tilings = tiling_sweep()
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(0),
                                    "copy_bytes_per_s": rate, "cases": results,
                                    "tilings_us": tilings}, indent=1))
    print(f"{'layout':<6}{'rows':>5}{'ctx':>6}{'pad':>5}{'flash us':>10}{'split us':>10}"
          f"{'x':>6}{'flash TB/s':>11}{'split TB/s':>11}{'paged us':>10}{'paged x':>8}")
    for r in results:
        print(f"{r['layout']:<6}{r['rows']:>5}{r['context']:>6}{str(r['padded'])[0]:>5}"
              f"{r['flash_us']:>10.1f}{r['split_us']:>10.1f}{r['speedup']:>6.2f}"
              f"{r['flash_tb_per_s']:>11.2f}{r['split_tb_per_s']:>11.2f}{r['paged_us']:>10.1f}"
              f"{r['paged_over_split']:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
