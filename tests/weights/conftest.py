"""Fixtures for the checkpoint-engine tests: one pair of engine processes for the session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from weights_harness import EnginePair


@pytest.fixture(scope="session")
def engines() -> Iterator[EnginePair]:
    """Two engine processes (spawned once; each test sets up their state dicts)."""
    pair = EnginePair(2)
    try:
        yield pair
    finally:
        pair.close()
