"""``rollout.max_num_seqs`` reaches both engines: the number set, or the one ``auto`` derives
(the engine concurrency ``megarl config show`` prints)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from megarl.config import derive_sizes, load_config_dict, load_model_info, resolve_sizes
from megarl.data.tiny_model import make_tiny_model
from megarl.rollout.server_worker import EngineSpec, RolloutServerWorker, engine_command
from megarl.trainer.workers import engine_spec

BASE: dict[str, Any] = {  # 60 prompts x 12 samples over 2 engines of 3 GPUs: 360 per engine
    "model": {"path": "/m"},
    "data": {"train_files": ["/t.parquet"], "train_batch_size": 60, "max_prompt_length": 512,
             "max_response_length": 1536},
    "actor": {"ppo_mini_batch_size": 15, "ppo_micro_batch_size_per_gpu": 5},
    "rollout": {"n": 12, "gpus_per_engine": 3},
    "resources": {"train_pool": {"nnodes": 1, "gpus_per_node": 6}},
}


def flag(argv: list[str], name: str) -> str | None:
    """The value after ``name`` in ``argv`` (None when absent)."""
    return argv[argv.index(name) + 1] if name in argv else None


def spec_of(tmp_path: Path, backend: str, max_num_seqs: int | str) -> EngineSpec:
    """``engine_spec`` of the base config with this backend and max_num_seqs."""
    cfg, _ = load_config_dict(BASE, [f"rollout.backend={backend}",
                                     f"rollout.max_num_seqs={max_num_seqs}"])
    return engine_spec(cfg, tmp_path)


@pytest.mark.parametrize("backend", ["sglang", "local"])
@pytest.mark.parametrize(("setting", "expected"), [("auto", "360"), (64, "64")])
def test_engine_command_carries_max_running_requests(tmp_path: Path, backend: str,
                                                     setting: int | str, expected: str) -> None:
    cfg, _ = load_config_dict(BASE)
    assert derive_sizes(cfg).max_num_seqs == 360  # what config show prints for auto
    argv = engine_command(spec_of(tmp_path, backend, setting), rank=0, port=9, device="cpu")
    assert flag(argv, "--max-running-requests") == expected
    entry = "sglang.launch_server" if backend == "sglang" else "megarl.rollout.local.server"
    assert entry in argv


def test_auto_is_capped_by_the_kv_cache_as_config_show_says(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "model", arch="qwen3")
    cfg, _ = load_config_dict({
        **BASE, "model": {"path": str(model), "dtype": "float32"},
        "rollout": {"n": 12, "gpus_per_engine": 3, "backend": "local"},
        "resources": {"train_pool": {"nnodes": 1, "gpus_per_node": 6},
                      "gpu_memory_gb": 0.002}})
    sizes = resolve_sizes(cfg, load_model_info(model))  # what config show prints
    assert sizes.max_num_seqs is not None and sizes.max_num_seqs < sizes.sequences_per_engine
    assert engine_spec(cfg, tmp_path).max_running_requests == sizes.max_num_seqs
    # colocated: the engines share the GPU with what the actor keeps, so fewer fit than a
    # share of the whole GPU would hold
    assert cfg.rollout.colocate
    assert sizes.max_num_seqs < derive_sizes(cfg, load_model_info(model)).max_num_seqs


def test_embedded_engine_started_by_the_worker_reports_it(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "model", arch="qwen3")
    worker = RolloutServerWorker(EngineSpec(model_path=str(model), backend="local",
                                            dtype="float32", log_dir=str(tmp_path),
                                            max_running_requests=7))
    try:
        url = worker.wait_ready(300)
        info = httpx.get(f"{url}/get_server_info", timeout=30).json()
        assert info["max_running_requests"] == 7
    finally:
        worker.stop()
