"""Fixtures for the megatron engine tests: tiny HF models and persistent pools of gloo ranks."""

from __future__ import annotations

import pytest
from dist_utils import RankPool

from megarl.data.tiny_model import make_tiny_model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    """Tiny random HF model directories by name (fp32, 2 layers unless the name says more)."""
    root = tmp_path_factory.mktemp("megatron_models")
    specs = {
        "qwen3": {"arch": "qwen3"},
        "qwen3_moe": {"arch": "qwen3_moe"},
        "qwen3_4layers": {"arch": "qwen3", "num_hidden_layers": 4},
        "qwen2": {"arch": "qwen2"},
        "qwen2_moe": {"arch": "qwen2_moe"},
        "mixtral": {"arch": "mixtral"},
        "llama": {"arch": "llama"},
    }
    return {
        name: str(make_tiny_model(root / name, seed=i, **kw))
        for i, (name, kw) in enumerate(specs.items())
    }


# Module scope: every megatron parallel state a test builds leaves gloo groups (and their
# polling threads) behind in the rank processes; a pool kept for the whole session would burn the
# CPU of every later test module.
@pytest.fixture(scope="module")
def pool1():
    """One gloo rank, reused by the tests of one module."""
    pool = RankPool(1)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def pool2():
    """Two gloo ranks on 127.0.0.1, reused by the tests of one module."""
    pool = RankPool(2)
    yield pool
    pool.close()
