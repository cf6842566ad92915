"""Fixtures for the conversion tests: tiny HF models of every family, two local ranks, and each
model converted once to a megatron dist checkpoint."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from bridge_cases import FAMILIES, SAVE_LAYOUT

from megarl.data.tiny_model import make_tiny_model

os.environ.setdefault("OMP_NUM_THREADS", "1")



@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    """Tiny random HF model directories by family (fp32, 2 layers, 4 experts for MoE)."""
    root = tmp_path_factory.mktemp("bridge_models")
    return {name: str(make_tiny_model(root / name, arch=name, seed=i))
            for i, name in enumerate(FAMILIES)}


class _RanksCache:
    """Two local gloo ranks shared by the session, restarted if a test left them closed."""

    def __init__(self) -> None:
        self.pool = None

    def get(self):
        from bridge.launch import LocalRanks

        if self.pool is None or not self.pool.alive:
            self.pool = LocalRanks(2)
        return self.pool

    def close(self) -> None:
        """Stop the ranks, if running."""
        if self.pool is not None:
            self.pool.close()
            self.pool = None


_CACHE = _RanksCache()
BRIDGE_TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def _ranks_cache():
    yield _CACHE
    _CACHE.close()


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Close the ranks after the last conversion test: idle gloo ranks keep polling and would
    slow every later test of the session (they are started again if needed)."""
    if nextitem is None or BRIDGE_TESTS not in Path(nextitem.path).parents:
        _CACHE.close()


@pytest.fixture
def ranks(_ranks_cache):
    """Two local gloo ranks (megatron's checkpoint writer needs them non-daemonic, which
    tests/megatron's RankPool is not)."""
    return _ranks_cache.get()


@pytest.fixture(scope="session")
def converted(tiny_models, _ranks_cache, tmp_path_factory) -> dict[str, str]:
    """Each family converted once to a dist checkpoint (EP=2 for MoE families, else TP=2)."""
    from bridge.hf_to_mcore import hf_to_mcore

    root = tmp_path_factory.mktemp("bridge_mcore")
    return {name: hf_to_mcore(tiny_models[name], root / name, SAVE_LAYOUT[name],
                              runner=_ranks_cache.get().runner)["out"]
            for name in FAMILIES}
