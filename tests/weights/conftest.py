"""Fixtures for the checkpoint-engine tests: one pair of engine processes for the session.

The end-to-end tests drive Megatron ranks with the megatron tests' ``RankPool``
(``tests/megatron/dist_utils.py``), importable from here as ``dist_utils``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from weights_harness import EnginePair

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "megatron"))


@pytest.fixture(scope="session")
def engines() -> Iterator[EnginePair]:
    """Two engine processes (spawned once; each test sets up their state dicts)."""
    pair = EnginePair(2)
    try:
        yield pair
    finally:
        pair.close()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two tiny MoE models of one shape and different weights: model A serves, model B is sent
    (the HTTP weight-update tests)."""
    from megarl.data.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("models")
    a = make_tiny_model(root / "a", arch="qwen3_moe", seed=0, with_tokenizer=False)
    b = make_tiny_model(root / "b", arch="qwen3_moe", seed=1, with_tokenizer=False)
    return a, b
