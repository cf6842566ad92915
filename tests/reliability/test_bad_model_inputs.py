"""The bad-input corpus, part 2: model directories, engine input and checkpoints.

Like part 1 (test_bad_inputs.py): the real entry point (``megarl serve``, the rollout client
against a real embedded server on 127.0.0.1, a Megatron checkpoint load in its own process),
the one-line message, and nothing left half-written.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from megarl.data.tiny_model import make_tiny_model
from megarl.rollout.interface import SamplingParams
from megarl.rollout.local.launch import launch_local_engines
from megarl.rollout.process import ManagedServer, free_port
from megarl.rollout.sglang.client import EngineError, SGLangClient

from .corpus import expect_one_line

# ---------------------------------------------------------------------------------------------
# Model directory and engine input


def test_megarl_serve_refuses_a_model_directory_without_weights(model_dir, tmp_path):
    card = tmp_path / "card"
    card.mkdir()
    (card / "config.json").write_bytes((model_dir / "config.json").read_bytes())
    result = subprocess.run([sys.executable, "-m", "megarl.rollout.local.server", "--model",
                             str(card), "--port", "9"], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"--model {card}: config.json but no weights (*.safetensors, pytorch_model*.bin) there; "
        "pass the HF checkpoint directory, not a model card")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["card", "config.json"]


@pytest.fixture(scope="module")
def engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedServer]:
    """One embedded engine on 127.0.0.1 serving the tiny model."""
    (server,) = launch_local_engines(str(model_dir), 1, num_threads=1, ready_timeout_s=300,
                                     log_dir=tmp_path_factory.mktemp("engine_log"))
    yield server
    server.stop()


@pytest.mark.parametrize("prompt,pattern", [
    ([5, 128], (r"HTTP 400: input_ids\[0\]: token id 128 is outside the vocabulary \[0, 128\); "
                r"check the tokenizer and the model")),
    ([5, -3], r"HTTP 400: input_ids\[0\]: token id -3 is outside the vocabulary"),
    ([5] * 600, r"HTTP 400: .*600.*context"),
])
def test_engine_rejects_bad_token_ids_with_one_line(engine, prompt, pattern, tmp_path):
    async def generate() -> None:
        client = SGLangClient([engine.url])
        try:
            await client.generate([prompt], SamplingParams(max_new_tokens=4))
        finally:
            await client.close()

    expect_one_line(lambda: asyncio.run(generate()), EngineError, pattern, tmp_path)

    async def still_serving() -> list:
        client = SGLangClient([engine.url])
        try:
            return await client.generate([[5, 6]], SamplingParams(max_new_tokens=2, ignore_eos=True))
        finally:
            await client.close()

    assert len(asyncio.run(still_serving())[0].response_ids) == 2


# ---------------------------------------------------------------------------------------------
# A checkpoint directory from a different model

CHECKPOINT_SCRIPT = """
import os, sys
from pathlib import Path
import torch
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[4], RANK="0", WORLD_SIZE="1")
from megarl.megatron.checkpoint import load_checkpoint, save_checkpoint
from megarl.megatron.model import build_actor_model
from megarl.megatron.parallel import ParallelSizes, destroy_parallel, init_distributed_from_env
init_distributed_from_env("gloo")
def build(path):
    return build_actor_model(path, ParallelSizes(), torch.float32, spec="native")
save_checkpoint(sys.argv[3], build(sys.argv[1]), 1)
destroy_parallel()
other = build(sys.argv[2])
def files():
    return sorted((str(p), p.stat().st_mtime_ns) for p in Path(sys.argv[3]).rglob("*"))
before = files()
try:
    load_checkpoint(sys.argv[3], other)
except ValueError as err:
    print("UNCHANGED" if files() == before else "CHANGED")
    print(err)
"""


def test_checkpoint_from_a_different_model_is_refused(model_dir, tmp_path):
    other = make_tiny_model(tmp_path / "wider", arch="qwen3", hidden_size=96)
    result = subprocess.run(
        [sys.executable, "-c", CHECKPOINT_SCRIPT, str(model_dir), str(other),
         str(tmp_path / "ckpt"), str(free_port())],
        capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    status, message = result.stdout.strip().splitlines()[-2:]
    assert status == "UNCHANGED"
    assert re.fullmatch(r"checkpoint .*step_00000001 was saved from a different model \("
                        r".*hidden_size: checkpoint 64, model 96.*\); load it into a model built "
                        r"from the same HF config, or use another checkpoint directory", message)
