"""Fixtures for the critic tests: tiny HF models and pools of real gloo ranks.

The ranks come from the megatron tests' ``RankPool`` (``tests/megatron/dist_utils.py``),
importable from here as ``dist_utils``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "megatron"))

from dist_utils import RankPool

from megarl.data.tiny_model import make_tiny_model


@pytest.fixture(scope="session")
def dense_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Qwen3 with tied embeddings (the critic must untie its head from them)."""
    root = tmp_path_factory.mktemp("critic")
    return str(make_tiny_model(root / "qwen3", "qwen3", seed=0, tie_word_embeddings=True))


@pytest.fixture(scope="session")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Qwen3-MoE (4 experts, top-2)."""
    root = tmp_path_factory.mktemp("critic_moe")
    return str(make_tiny_model(root / "qwen3_moe", "qwen3_moe", seed=1))


@pytest.fixture(scope="module")
def pool1() -> Iterator[RankPool]:
    """One gloo rank, reused by the tests of one module."""
    pool = RankPool(1)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def pool2() -> Iterator[RankPool]:
    """Two gloo ranks on 127.0.0.1, reused by the tests of one module."""
    pool = RankPool(2)
    yield pool
    pool.close()
