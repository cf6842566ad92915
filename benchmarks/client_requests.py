"""How the SGLang client sends a prompt's n samples: one batched ``/generate`` per prompt (n
single-sample items, each with its own ``sampling_seed`` and rid) against one request per
sample, on a running embedded engine, in the same run.

    python benchmarks/client_requests.py [--device cpu|cuda] [--prompts 64] [--n 8]
                                         [--tokens 8] [--repeats 2] [--smoke]

Both ways produce the same number of samples (prompts x n, seeded the same way); the ratio
per-sample seconds / batched seconds is what batching the requests saves (the engine's HTTP and
scheduling overhead per request). Prints a JSON line per repeat and the median ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path


async def _measure(url: str, prompts: list[list[int]], n: int, tokens: int) -> dict[str, float]:
    from megarl.rollout.interface import SamplingParams
    from megarl.rollout.sglang.client import SGLangClient

    client = SGLangClient([url])
    grouped = SamplingParams(max_new_tokens=tokens, temperature=1.0, ignore_eos=True, n=n)
    single = SamplingParams(max_new_tokens=tokens, temperature=1.0, ignore_eos=True)
    try:
        start = time.perf_counter()
        batched = await client.generate(prompts, grouped, seeds=list(range(len(prompts))))
        middle = time.perf_counter()
        each = await client.generate([p for p in prompts for _ in range(n)], single,
                                     seeds=list(range(len(prompts) * n)))
        end = time.perf_counter()
    finally:
        await client.close()
    assert len(batched) == len(each) == len(prompts) * n
    return {"batched_s": middle - start, "per_sample_s": end - middle,
            "ratio": (end - middle) / (middle - start)}


def main(argv: list[str]) -> int:
    """Run the comparison; print one JSON line per repeat and the median ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="4 prompts x 2 samples, 1 repeat")
    args = parser.parse_args(argv)
    if args.smoke:
        args.prompts, args.n, args.repeats = 4, 2, 1
    from megarl.data.tiny_model import make_tiny_model
    from megarl.rollout.local.launch import launch_local_engines

    root = Path(tempfile.mkdtemp(prefix="megarl-client-bench-"))
    model = make_tiny_model(root / "model", arch="qwen3_moe", with_tokenizer=False)
    (server,) = launch_local_engines(str(model), 1, device=args.device, num_threads=1,
                                     log_dir=root, seed=0)
    prompts = [[5 + i % 50, 6, 7, 8, 9, 10] for i in range(args.prompts)]
    try:
        rows = [asyncio.run(_measure(server.url, prompts, args.n, args.tokens))
                for _ in range(args.repeats)]
    finally:
        server.stop()
    for row in rows:
        print(json.dumps({k: round(v, 4) for k, v in row.items()}))
    print(f"median per-sample / batched: {statistics.median(r['ratio'] for r in rows):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
