"""``megarl bench``: the dispatcher, and a smoke run of ``weight-sync`` on a tiny model."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.bench import bench_main
from megarl.cli import main as cli_main
from megarl.data.tiny_model import make_tiny_model

pytestmark = pytest.mark.timeout(240)


def test_bench_lists_benchmarks_and_refuses_unknown_ones(capsys: pytest.CaptureFixture) -> None:
    assert cli_main(["bench"]) == 0
    listing = capsys.readouterr().out
    for name in ("weight-sync", "rollout", "actor", "scheduler"):
        assert f"  {name} " in listing
    assert bench_main(["nope"]) == 2
    assert "unknown benchmark 'nope'" in capsys.readouterr().err
    assert bench_main(["weight-sync", "--engines", "0"]) == 2


def test_weight_sync_smoke(tmp_path: Path) -> None:
    """Every backend moves the tiny model to one engine, every tensor checked, figures printed."""
    model = make_tiny_model(tmp_path / "moe", arch="qwen3_moe", with_tokenizer=False)
    run = subprocess.run(
        [sys.executable, "-m", "megarl.cli", "bench", "weight-sync", "--model", str(model),
         "--engines", "1", "--bucket-mb", "0.05", "--repeats", "1", "--work-dir", str(tmp_path)],
        check=False, capture_output=True, text=True, timeout=220,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert re.search(r"floor \(memory copy\): [0-9.]+ GB/s", out), out
    for backend in ("nccl", "nixl", "ipc", "disk"):
        row = re.search(rf"^{backend}\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)\s+(\d+)\s+([0-9.]+)"
                        rf"\s+(\d+)$", out, re.MULTILINE)
        assert row is not None, out
        seconds, _, _, buckets, _, checked = row.groups()
        assert float(seconds) > 0 and int(buckets) >= 8 and int(checked) == 45, row.group(0)



def test_weight_sync_with_lora_times_the_merged_and_the_adapter_sync(tmp_path: Path) -> None:
    """``--lora-rank 4``: the ipc row is the merged sync (every merged tensor checked on the
    engine) and the ``adapter`` row sends exactly the adapters PEFT trains on the model (fp32
    bytes), a small share of the merged model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = make_tiny_model(tmp_path / "dense", arch="qwen3", with_tokenizer=False)
    run = subprocess.run(
        [sys.executable, "-m", "megarl.cli", "bench", "weight-sync", "--model", str(model),
         "--engines", "1", "--backend", "ipc", "--repeats", "2", "--lora-rank", "4",
         "--work-dir", str(tmp_path)],
        check=False, capture_output=True, text=True, timeout=220,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    from safetensors import safe_open

    with safe_open(model / "model.safetensors", framework="pt") as f:
        merged_tensors = len(list(f.keys()))  # every checkpoint tensor, merged where adapted
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(model), LoraConfig(
        r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                             "down_proj"]))
    adapter_bytes = 4 * sum(p.numel() for p in peft.parameters() if p.requires_grad)
    row = re.search(r"^ipc\s+([0-9.]+)\s+\S+\s+\S+\s+\d+\s+\S+\s+(\d+)$", out, re.MULTILINE)
    assert row is not None and int(row.group(2)) == merged_tensors, out
    adapter = re.search(r"^adapter\s+([0-9.]+)\s+", out, re.MULTILINE)
    assert adapter is not None and float(adapter.group(1)) > 0, out
    share = re.search(r"LoRA rank 4: the adapter sync sends ([0-9.]+) MB \(([0-9.]+)% of the "
                      r"merged model\); the fastest merged sync \(ipc\) takes ([0-9.]+)x", out)
    assert share is not None, out
    assert float(share.group(1)) == pytest.approx(adapter_bytes / 1e6, abs=1e-3)
    assert float(share.group(2)) < 20
