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
