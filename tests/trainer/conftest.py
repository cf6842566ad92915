"""Fixtures of the trainer tests: the demo's tiny model and data, and the uninterrupted Ray run
that the no-Ray run and the crashed-and-resumed runs must reproduce; each made once a session."""

from __future__ import annotations

from pathlib import Path

import pytest
from trainer_runs import TOTAL_STEPS, run_metrics, train

from megarl.demo import prepare_demo_assets


@pytest.fixture(scope="session")
def demo_assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's tiny Qwen3-MoE and copy_digit train/val data (``<root>/model``, ``data/``)."""
    root = tmp_path_factory.mktemp("tiny")
    prepare_demo_assets(root)
    return root


@pytest.fixture(scope="module")
def private_ray():
    """One private local Ray for a module's in-process trainers (``pytestmark``): each attaches
    to it (and releases its pools at close) instead of starting and stopping one of its own."""
    import ray

    from megarl.cluster import init_ray

    init_ray("local", num_cpus=4)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def reference_run(demo_assets: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The output directory of an uninterrupted ``megarl train`` on Ray (trainer_runs' run)."""
    out = tmp_path_factory.mktemp("reference") / "run"
    train(demo_assets, out)
    assert sorted(run_metrics(out)) == list(range(1, TOTAL_STEPS + 1))
    return out


@pytest.fixture(scope="session")
def expected(reference_run: Path) -> dict[int, dict[str, float]]:
    """The per-step metrics of the uninterrupted run that do not depend on time."""
    return run_metrics(reference_run)
