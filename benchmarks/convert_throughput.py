"""Conversion throughput and peak memory of ``megarl-convert``, against plain safetensors I/O.

Generates a random HF model of about ``--size-gb`` GB (Qwen3 dense by default, fp32, split into
HF-style shards), then times, each in a fresh subprocess so that its peak RSS is its own:

1. baseline: read every safetensors file (``load_file``) and write it again (``save_file``);
2. ``hf-to-mcore`` with the chosen layout (its ranks are spawned inside the step);
3. ``mcore-to-hf`` back to HF shards of ``--max-shard-size``.

For each step it prints GB/s of weights (bytes / wall seconds of the step's work, rank start-up
included for hf-to-mcore) with the ratio to the baseline, and the peak RSS of the largest
process, and for mcore-to-hf also the RSS growth over the process's size after its imports,
next to the largest tensor and the shard size. All files are read from the page cache (they
were just written), the same for every step.

    python benchmarks/convert_throughput.py                    # ~2 GB, a few minutes on 2 cores
    python benchmarks/convert_throughput.py --size-gb 0.2      # quick
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Self

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Qwen3-style dense dimensions; the layer count is chosen to reach the requested size.
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 1024, 16, 8, 64, 4096, 32000


def layers_for(size_gb: float, bytes_per_param: int = 4) -> int:
    """Decoder layers that bring the model to about ``size_gb`` GB."""
    per_layer = (HIDDEN * HEAD_DIM * (2 * HEADS + 2 * KV_HEADS) + 3 * HIDDEN * FFN
                 + 2 * HIDDEN + 2 * HEAD_DIM)
    embeddings = 2 * VOCAB * HIDDEN
    return max(1, round((size_gb * 1e9 / bytes_per_param - embeddings) / per_layer))


def generate_model(path: Path, size_gb: float, shard_size: str) -> Path:
    """A random Qwen3 model in HF format (config, sharded fp32 safetensors, tokenizer)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from megarl.data.tiny_model import build_tokenizer, tiny_config_dict

    fields = tiny_config_dict("qwen3", vocab_size=VOCAB, hidden_size=HIDDEN,
                              intermediate_size=FFN, num_attention_heads=HEADS,
                              num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                              num_hidden_layers=layers_for(size_gb))
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path, max_shard_size=shard_size)
    build_tokenizer(VOCAB).save_pretrained(path)
    return path


def weight_bytes(directory: Path) -> int:
    """Bytes of all safetensors files in ``directory``."""
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))


def peak_rss_gb(who: int) -> float:
    """Peak resident memory (GB) of this process or of its largest waited-for descendant."""
    return resource.getrusage(who).ru_maxrss * 1024 / 1e9


class RssSampler:
    """The largest resident size (GB) of this process while the block runs (sampled every 5 ms),
    and its size when the block began."""

    def __init__(self) -> None:
        import psutil

        self._process = psutil.Process()
        self.start_gb = self.peak_gb = self._process.memory_info().rss / 1e9
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak_gb = max(self.peak_gb, self._process.memory_info().rss / 1e9)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def step_baseline(source: Path, out: Path) -> None:
    """Plain safetensors: every file read whole and written again."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    for file in sorted(source.glob("*.safetensors")):
        save_file(load_file(file), out / file.name, metadata={"format": "pt"})


def step_hf_to_mcore(source: Path, out: Path, args: argparse.Namespace) -> dict:
    """``megarl-convert hf-to-mcore`` with the benchmark's layout; rank 0's phase times."""
    from bridge.checks import Layout
    from bridge.hf_to_mcore import hf_to_mcore

    return hf_to_mcore(source, out, Layout(tp=args.tp, pp=args.pp, ep=args.ep))["rank0_phases"]


def step_mcore_to_hf(source: Path, out: Path, args: argparse.Namespace) -> None:
    """``megarl-convert mcore-to-hf`` into shards of ``--max-shard-size``."""
    from bridge.cli import parse_size
    from bridge.mcore_to_hf import mcore_to_hf

    mcore_to_hf(source, out, max_shard_bytes=parse_size(args.max_shard_size))


def run_step(args: argparse.Namespace) -> None:
    """Child mode: import, do one step, print one JSON line with time and memory."""
    from bridge.launch import quiet_library_warnings

    quiet_library_warnings()
    # imports are not part of the timed work
    import mbridge  # noqa: F401
    import transformers  # noqa: F401

    import bridge.hf_to_mcore
    import bridge.mcore_to_hf  # noqa: F401
    import megarl.megatron.model  # noqa: F401

    steps = {"baseline": lambda s, o: step_baseline(s, o),
             "hf-to-mcore": lambda s, o: step_hf_to_mcore(s, o, args),
             "mcore-to-hf": lambda s, o: step_mcore_to_hf(s, o, args)}
    with RssSampler() as rss:
        start = time.perf_counter()
        detail = steps[args.step](Path(args.source), Path(args.out))
        seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "detail": detail, "rss_start_gb": rss.start_gb,
                      "rss_peak_gb": rss.peak_gb,
                      "rss_children_gb": peak_rss_gb(resource.RUSAGE_CHILDREN)}))


def measure(step: str, source: Path, out: Path, args: argparse.Namespace) -> dict:
    """Run one step in a fresh subprocess (after flushing earlier writes); its JSON report."""
    os.sync()
    command = [sys.executable, __file__, "--step", step, "--source", str(source), "--out",
               str(out), "--tp", str(args.tp), "--pp", str(args.pp), "--ep", str(args.ep),
               "--max-shard-size", args.max_shard_size]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{step} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def largest_tensor_gb(directory: Path) -> float:
    """Size of the largest tensor of an HF directory (from the safetensors headers)."""
    from bridge.checks import hf_weight_index

    return max(t.nbytes for t in hf_weight_index(directory).values()) / 1e9


def report(total: int, results: dict[str, dict], args: argparse.Namespace, largest: float) -> None:
    """The table of throughputs, ratios and memory."""
    gb = total / 1e9
    base = gb / results["baseline"]["seconds"]
    print(f"\nmodel: {gb:.2f} GB fp32 Qwen3 dense, largest tensor {largest:.3f} GB; layout "
          f"tp={args.tp} pp={args.pp} ep={args.ep}; mcore-to-hf shards {args.max_shard_size}")
    print(f"{'step':<13}{'seconds':>9}{'GB/s':>8}{'vs base':>9}{'peak RSS GB':>13}")
    for step, r in results.items():
        rate = gb / r["seconds"]
        rss = max(r["rss_peak_gb"], r["rss_children_gb"])
        print(f"{step:<13}{r['seconds']:>9.1f}{rate:>8.3f}{rate / base:>9.2f}{rss:>13.2f}")
    phases = ", ".join(f"{k} {v:.1f} s" for k, v in results["hf-to-mcore"]["detail"].items())
    print(f"hf-to-mcore rank 0: {phases} (the rest: starting the ranks)")
    to_hf = results["mcore-to-hf"]
    print(f"mcore-to-hf RSS growth during the conversion (over its size after imports): "
          f"{to_hf['rss_peak_gb'] - to_hf['rss_start_gb']:.3f} GB (model {gb:.2f} GB, largest "
          f"tensor {largest:.3f} GB, output shards {args.max_shard_size})")


def main() -> None:
    """Parse arguments; as the parent, generate the model and measure every step."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=2.0, help="model size to generate")
    parser.add_argument("--source-shard-size", default="500MB", help="HF shard size generated")
    parser.add_argument("--max-shard-size", default="500MB", help="mcore-to-hf output shards")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--workdir", help="where to write (default: a temporary directory)")
    parser.add_argument("--step", help=argparse.SUPPRESS)
    parser.add_argument("--source", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.step:
        run_step(args)
        return
    root = Path(args.workdir or tempfile.mkdtemp(prefix="convert_bench_"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        start = time.perf_counter()
        source = generate_model(root / "hf", args.size_gb, args.source_shard_size)
        total = weight_bytes(source)
        print(f"generated {total / 1e9:.2f} GB in {time.perf_counter() - start:.0f} s", flush=True)
        results = {"baseline": measure("baseline", source, root / "copy", args)}
        results["hf-to-mcore"] = measure("hf-to-mcore", source, root / "mcore", args)
        results["mcore-to-hf"] = measure("mcore-to-hf", root / "mcore", root / "back", args)
        report(total, results, args, largest_tensor_gb(source))
    finally:
        if not args.workdir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
