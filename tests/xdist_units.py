"""A pytest plugin: how ``pytest -n 2`` (pytest-xdist) shares the suite between its workers.

Each worker runs whole *units*, in the order of their measured cost, longest first (the
longest-processing-time rule: the two workers then end within a short unit of each other).
A unit is a test file, or a whole test directory where that directory's ``conftest.py`` has a
session-scoped fixture: such a fixture (an engine server, converted checkpoints, the trainer's
uninterrupted reference run) is then built in one worker only, not in both.

xdist's own ``--dist loadfile`` groups by file and orders by the number of tests; here the
trainer's few long runs would come last and leave one worker running them alone for minutes.
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

# Files of a grouped directory that use none of its expensive session fixtures: units of their
# own, so that the directory's unit is not one long run.
SEPARATE = frozenset({"trainer/test_trainer_e2e.py", "trainer/test_engine_restart.py"})

# Seconds each file took in a serial run on 2 cores (`--durations=0`, 2026-12-06); files not
# listed count DEFAULT_SECONDS. Only the order depends on them: a stale figure costs balance,
# never a test.
FILE_SECONDS = {
    "trainer/test_trainer_e2e.py": 245, "trainer/test_resume.py": 108,
    "trainer/test_lora_run.py": 99, "benchmarks/test_e2e_step.py": 65,
    "bridge/test_convert_verify.py": 44, "launch/test_launch_local.py": 37,
    "scheduler/test_schedulers_e2e.py": 35, "launch/test_launch_slurm_job.py": 32,
    "weights/test_bench_cli.py": 31, "benchmarks/test_smoke.py": 28,
    "trainer/test_engine_restart.py": 28, "bridge/test_deepseek_v3.py": 26,
    "reliability/test_engine_failure.py": 26, "weights/test_end_to_end.py": 22,
    "megatron/test_lora_checkpoint.py": 21, "trainer/test_trainer_naive.py": 21,
    "megatron/test_context_parallel.py": 21, "reliability/test_orphans.py": 19,
    "megatron/test_checkpoint.py": 18, "reliability/test_bad_model_inputs.py": 18,
    "rollout/test_lora_serving.py": 17, "replay/test_replay_trainer.py": 17,
    "cluster/test_ray_cluster.py": 17, "megatron/test_lora.py": 16,
    "weights/test_sglang_sender.py": 15, "rollout/test_control.py": 14,
    "bridge/test_convert_fp8.py": 14, "scheduler/test_partial_rollout.py": 13,
    "rollout/test_sglang_conformance.py": 13, "bridge/test_convert_errors.py": 12,
    "critic/test_critic_model.py": 12, "replay/test_replay_worker.py": 11,
    "megatron/test_update.py": 10,
}
DEFAULT_SECONDS = 2.0


@cache
def _has_session_fixture(directory: Path) -> bool:
    conftest = directory / "conftest.py"
    return conftest.is_file() and 'scope="session"' in conftest.read_text()


def unit_of(nodeid: str) -> str:
    """The unit of a test (its node id relative to the rootdir, ``tests/...``): its directory
    when that directory's conftest has a session-scoped fixture (unless the file is in
    SEPARATE), else its file."""
    path = nodeid.split("::", 1)[0]
    rel = Path(path).relative_to("tests") if path.startswith("tests/") else Path(path)
    if rel.as_posix() in SEPARATE or rel.parent == Path("."):
        return path
    return f"tests/{rel.parent.as_posix()}" if _has_session_fixture(TESTS / rel.parent) else path


def file_seconds(path: str) -> float:
    return FILE_SECONDS.get(path.removeprefix("tests/"), DEFAULT_SECONDS)


def order_by_unit_cost(nodeids: list[str]) -> list[int]:
    """Indices of ``nodeids`` with whole units together, the costliest unit first (ties: the
    unit met first), each unit's tests in their collected order."""
    units: dict[str, list[int]] = {}
    files: dict[str, set[str]] = {}
    for i, nodeid in enumerate(nodeids):
        unit = unit_of(nodeid)
        units.setdefault(unit, []).append(i)
        files.setdefault(unit, set()).add(nodeid.split("::", 1)[0])
    cost = {u: sum(file_seconds(f) for f in fs) for u, fs in files.items()}
    return [i for u in sorted(units, key=lambda u: -cost[u]) for i in units[u]]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Only in an xdist worker: every worker collects the same list, and the controller hands out
    # its units in this order. A run without -n keeps pytest's order.
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items[:] = [items[i] for i in order_by_unit_cost([item.nodeid for item in items])]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        """xdist's scope scheduling with :func:`unit_of` as the scope, in collected order."""

        def __init__(self, config: pytest.Config, log=None) -> None:
            super().__init__(config, log)
            config.option.loadscopereorder = False  # the workers' order: costliest first

        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return UnitScheduling(config, log)
