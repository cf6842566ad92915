"""``build_workers`` on a real local Ray: the per-node input check runs before any worker
starts (PITFALLS S3), and a start-up that fails part-way leaves no actor or placement group."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
import ray

from megarl.cluster import init_ray
from megarl.cluster.preflight import NodePathError
from megarl.config import load_config
from megarl.config.estimates import GB
from megarl.demo import DEMO_CONFIG, prepare_demo_assets
from megarl.faults import FAIL_ENV, InjectedFault
from megarl.trainer.workers import build_workers


@pytest.fixture(scope="module")
def ray_runtime():
    """A fresh private local Ray with room for the demo's pools (2 train + 1 rollout CPUs)."""
    runtime = init_ray(num_cpus=4, on_existing="start")
    yield runtime
    ray.shutdown()


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's tiny model and data."""
    root = tmp_path_factory.mktemp("tiny")
    prepare_demo_assets(root)
    return root


def demo_config(assets: Path, out: Path, *overrides: str):
    """The CPU demo's config on ``assets``."""
    cfg, _ = load_config(DEMO_CONFIG, [
        f"model.path={assets / 'model'}", f"data.train_files=[{assets / 'data/train.parquet'}]",
        f"data.val_files=[{assets / 'data/val.parquet'}]", f"trainer.output_dir={out}",
        "trainer.phase_timeout_s=60", *overrides])
    return cfg


def live_megarl_actors() -> list[str]:
    """Class names of the actors of this Ray that are not dead (read from the GCS: the state
    API of ``ray.util.state`` needs the dashboard, which megarl does not start)."""
    from ray._private.state import actors

    return [a["ActorClassName"] for a in actors().values() if a["State"] != "DEAD"]


def live_placement_groups() -> list[str]:
    """Ids of placement groups that were not removed."""
    return [pg_id for pg_id, pg in ray.util.placement_group_table().items()
            if pg["state"] != "REMOVED"]


def test_missing_data_file_is_one_line_naming_node_and_path(ray_runtime, assets, tmp_path):
    missing = tmp_path / "elsewhere" / "train.parquet"
    empty_model = tmp_path / "model"
    empty_model.mkdir()
    (empty_model / "config.json").write_text("{}")
    cfg = demo_config(assets, tmp_path / "run", f"data.train_files=[{missing}]")
    cfg.model.path = str(empty_model)  # a card without weights (validation reads config only)
    start = time.monotonic()
    with pytest.raises(NodePathError) as err:
        build_workers(cfg, tmp_path / "run")
    elapsed = time.monotonic() - start
    lines = str(err.value).splitlines()
    node_ip = ray.util.get_node_ip_address()
    data_line = next(line for line in lines if "data.train_files" in line)
    assert f"({node_ip})" in data_line and f"{missing} does not exist" in data_line
    assert "fix: copy it to the same path on every node" in data_line
    model_line = next(line for line in lines if "model.path" in line)
    assert f"{empty_model} holds no weights" in model_line
    assert len(lines) == 3, lines  # the heading and one line per problem
    assert live_megarl_actors() == [] and live_placement_groups() == []
    assert elapsed < 20, elapsed


def test_inputs_readable_everywhere_pass(ray_runtime, assets, tmp_path):
    from megarl.trainer.workers import check_inputs_on_nodes

    cfg = demo_config(assets, tmp_path / "run")
    assert check_inputs_on_nodes(cfg) == 1


def test_failed_start_leaves_no_actor_or_placement_group(ray_runtime, assets, tmp_path,
                                                         monkeypatch):
    # the demo starts the rollout group first, then the actor: fail between the two
    monkeypatch.setenv(FAIL_ENV, "start_actor")
    cfg = demo_config(assets, tmp_path / "run")
    with pytest.raises(InjectedFault):
        build_workers(cfg, tmp_path / "run")
    deadline = time.monotonic() + 10
    while live_megarl_actors() and time.monotonic() < deadline:  # ray.kill is asynchronous
        time.sleep(0.2)
    assert live_megarl_actors() == []
    assert live_placement_groups() == []
    logs = list((tmp_path / "run" / "logs").glob("rollout*"))
    assert logs, "the rollout group was started before the failure"


def test_memory_preflight_reads_every_node_and_names_the_gpu(ray_runtime, assets, tmp_path):
    """The per-node check reads each node (the driver's own in the driver, any other by a pinned
    task) and holds every phase against the GPU with the least free memory, labelled by node.
    This machine has no GPU: the node-side reading is given (the Ray plumbing, the estimates and
    the verdict are real). A reading that fails is a line of its own, with its error."""
    from megarl.cluster.preflight import NodeMemoryError
    from megarl.trainer.workers import check_memory_on_nodes

    cfg = demo_config(assets, tmp_path / "run", "resources.device=cuda")
    plenty = lambda: {"GPU 0": (70 * GB, 80 * GB), "GPU 1": (79 * GB, 80 * GB)}
    host = lambda: (500 * GB, 512 * GB, "MemAvailable")  # a lambda travels by value
    lines = check_memory_on_nodes(cfg, read=plenty, read_host=host)
    node_ip = ray.util.get_node_ip_address()
    assert len(lines) == 2 and lines[0].startswith("preflight on every node: every phase fits")
    assert f"({node_ip}) GPU 0, 70.0 GB, of 2 GPU(s)" in lines[0]
    assert lines[1].startswith("preflight on every node: host memory fits on every node")
    from megarl.cluster.preflight import gpu_memory_on_nodes

    def broken() -> dict:
        raise OSError("nvidia-smi: not found")

    assert gpu_memory_on_nodes(broken) == ({}, [
        f"preflight: node {node_ip}: its GPUs could not be read (OSError: nvidia-smi: not found)"])
    busy = lambda: {"GPU 0": (70 * GB, 80 * GB), "GPU 1": (1 << 20, 80 * GB)}
    with pytest.raises(NodeMemoryError) as err:
        check_memory_on_nodes(cfg, read=busy, read_host=host)
    refused = str(err.value).splitlines()[1:]
    assert refused and all(f"({node_ip}) GPU 1 has 0.0 GB free" in line for line in refused)
    assert any("phase 'update_actor'" in line and "actor.recompute.granularity" in line
               for line in refused), refused
    assert check_memory_on_nodes(cfg, read=dict) == []  # no GPU on any node: nothing to hold
    off = demo_config(assets, tmp_path / "run", "resources.device=cuda", "trainer.preflight=false")
    assert check_memory_on_nodes(off, read=busy) == []


def test_host_memory_preflight_refuses_a_node_that_cannot_hold_the_run(ray_runtime, assets,
                                                                       tmp_path):
    """The host check reads every node's available memory in a pinned task and refuses, before
    any worker starts, a node that cannot hold the offloaded state and the processes (the
    colocated engines drop their released weights); the line names the node, both sizes, the
    parts and the fields. This machine has no GPU: the GPU and host readings are given (the Ray plumbing, the
    estimate and the verdict are real)."""
    from megarl.cluster.preflight import NodeMemoryError
    from megarl.trainer.workers import check_memory_on_nodes

    cfg = demo_config(assets, tmp_path / "run", "resources.device=cuda", "rollout.colocate=true",
                      "resources.rollout_pool=null")
    gpus = lambda: {"GPU 0": (70 * GB, 80 * GB), "GPU 1": (79 * GB, 80 * GB)}
    short = lambda: (20 * GB, 24 * GB, "MemAvailable")
    with pytest.raises(NodeMemoryError) as err:
        check_memory_on_nodes(cfg, read=gpus, read_host=short)
    header, line = str(err.value).splitlines()
    assert header.startswith("1 node(s) cannot hold the run's host memory")
    node = f"node {socket.gethostname()} ({ray.util.get_node_ip_address()})"
    assert line.startswith(f"preflight: {node} needs ~24.0 GB of host memory, it has 20.0 GB "
                           "available (MemAvailable)"), line
    for part in ("actor optimizer", "processes 24.0 GB", "for 2 train GPU(s)",
                 "— lower it with resources.train_pool.gpus_per_node=1 (~8.0 GB per train GPU"):
        assert part in line, part  # the tiny model's state frees too little to be offered
    separate = demo_config(assets, tmp_path / "run", "resources.device=cuda")
    assert check_memory_on_nodes(separate, read=gpus, read_host=lambda: (
        21 * GB, 24 * GB, "MemAvailable"))[1].startswith("preflight on every node: host memory "
                                                         "fits")
