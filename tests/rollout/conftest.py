"""Fixtures: tiny Qwen3-MoE models and real embedded servers on 127.0.0.1 (one per session)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from megarl.data.tiny_model import make_tiny_model
from megarl.faults import ENGINE_DELAY_ENV, OOM_ENV
from megarl.rollout.local.launch import launch_local_engines
from megarl.rollout.process import ManagedServer

CONTEXT_LENGTH = 512  # max_position_embeddings of the tiny models
HEALTH_CHECK_TIMEOUT_S = 1.0  # how long /health waits while paused (SGLang: 20 s)
SLOW_STEP_S = 0.01  # the slow server's least time per generation step


def _serve(model_dir: Path, log_dir: Path, seed: int | None = 0,
           step_delay_s: float = 0.0, oom_at: str | None = None) -> Iterator[ManagedServer]:
    with pytest.MonkeyPatch.context() as env:  # the server's environment, not the session's
        if step_delay_s:
            env.setenv(ENGINE_DELAY_ENV, str(step_delay_s))
        if oom_at:
            env.setenv(OOM_ENV, oom_at)
        servers = launch_local_engines(str(model_dir), 1, num_threads=1, log_dir=log_dir,
                                       seed=seed, extra_args=["--health-check-timeout",
                                                              str(HEALTH_CHECK_TIMEOUT_S)],
                                       ready_timeout_s=120)
    try:
        yield servers[0]
    finally:
        servers[0].stop()


@pytest.fixture(scope="session")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-MoE with a tokenizer (seed 0)."""
    return make_tiny_model(tmp_path_factory.mktemp("moe") / "model", arch="qwen3_moe", seed=0)


@pytest.fixture(scope="session")
def server(moe_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedServer]:
    """An embedded server on ``moe_dir``, shared by the read-only tests (seeded: it honours
    ``sampling_seed``, ``--enable-deterministic-inference``)."""
    yield from _serve(moe_dir, tmp_path_factory.mktemp("server_logs"))


@pytest.fixture(scope="session")
def unseeded_server(moe_dir: Path,
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedServer]:
    """An embedded server started without a seed (it ignores ``sampling_seed``, as SGLang does
    without ``--enable-deterministic-inference``)."""
    yield from _serve(moe_dir, tmp_path_factory.mktemp("unseeded_logs"), seed=None)


@pytest.fixture(scope="session")
def slow_server(moe_dir: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedServer]:
    """The seeded server on a slow device: every generation step takes at least
    ``SLOW_STEP_S`` (``MEGARL_ENGINE_STEP_DELAY_S``), so a request of N tokens is in progress
    for at least N * SLOW_STEP_S after its first step, whatever the machine's speed. For the
    tests that abort or pause a request they saw running."""
    yield from _serve(moe_dir, tmp_path_factory.mktemp("slow_logs"), step_delay_s=SLOW_STEP_S)


@pytest.fixture(scope="session")
def hf_model(moe_dir: Path) -> torch.nn.Module:
    """The same model loaded by plain transformers (the reference)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    """A few prompts of different lengths (token ids of the tiny vocabulary, no EOS)."""
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(5, 128, (n,), generator=gen).tolist() for n in (3, 7, 12, 20)]


@pytest.fixture(scope="module")
def resume_oom_server(moe_dir: Path,
                      tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedServer]:
    """An embedded server whose every resume of its weights raises an out-of-memory error
    (``MEGARL_OOM_AT=resume_rollout``)."""
    yield from _serve(moe_dir, tmp_path_factory.mktemp("resume_oom_logs"), oom_at="resume_rollout")


@pytest.fixture(scope="module")
def decode_oom_server(moe_dir: Path,
                      tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedServer]:
    """An embedded server whose every decode step raises an out-of-memory error
    (``MEGARL_OOM_AT=engine_decode``)."""
    yield from _serve(moe_dir, tmp_path_factory.mktemp("decode_oom_logs"), oom_at="engine_decode")
