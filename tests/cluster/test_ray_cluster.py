"""Ray pools and worker groups on a real local Ray (3 logical CPUs, no dashboard).

One Ray instance and one set of pools/groups serve the whole module: a train pool of 2 CPU
bundles and a rollout pool of 1, with an EchoWorker group on each. Failure tests that leave a
group unusable start their own small group.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import ray

from megarl.cluster import (
    PoolSchedulingError,
    RayStartError,
    RayWorkerGroup,
    WorkerDiedError,
    WorkerError,
    WorkerTimeoutError,
    create_pools,
    create_resource_pool,
    find_local_ray,
    init_ray,
    write_timeline,
)
from megarl.cluster.pools import Slot
from megarl.cluster.worker_group import rank_order
from megarl.config.schema import PoolConfig, ResourcesConfig

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
BUNDLE_CPUS = 0.5
TIMINGS: dict[str, float] = {}


# What torchrun gives the processes it starts (torch.distributed.elastic's local agent).
TORCHRUN_ENV = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400", "GROUP_RANK": "0",
                "ROLE_RANK": "0", "ROLE_NAME": "default", "TORCHELASTIC_RUN_ID": "test",
                "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"}


@pytest.fixture(scope="module")
def ray_runtime():
    """A fresh local Ray of 3 logical CPUs whose workers can import cluster_workers.

    It is started with torchrun's environment, as when the driver runs under torchrun, so every
    Ray worker inherits it: the worker groups must not take that launcher's rendezvous for
    their own (TORCHELASTIC_USE_AGENT_STORE made every rank a store client: gloo hung)."""
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, str(HERE))
    start = time.monotonic()
    saved = {k: os.environ.get(k) for k in TORCHRUN_ENV}
    os.environ.update(TORCHRUN_ENV)
    try:
        runtime = init_ray(num_cpus=3, on_existing="start")
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    TIMINGS["ray_init_s"] = time.monotonic() - start
    yield runtime
    ray.shutdown()
    print("\nstart-up times:", {k: round(v, 2) for k, v in TIMINGS.items()})


@pytest.fixture(scope="module")
def pools(ray_runtime):
    """A train pool (1 node x 2) and a rollout pool (1 node x 1) of half-CPU bundles."""
    start = time.monotonic()
    train = create_resource_pool("train_pool", 1, 2, "cpu", cpus_per_bundle=BUNDLE_CPUS)
    rollout = create_resource_pool("rollout_pool", 1, 1, "cpu", cpus_per_bundle=BUNDLE_CPUS)
    TIMINGS["two_pools_s"] = time.monotonic() - start
    yield train, rollout
    train.remove()
    rollout.remove()


@pytest.fixture(scope="module")
def groups(pools, tmp_path_factory):
    """EchoWorker groups: 'train' on the train pool (2 ranks), 'rollout' on the other (1)."""
    from cluster_workers import EchoWorker

    log_dir = tmp_path_factory.mktemp("worker_logs")
    train_pool, rollout_pool = pools
    start = time.monotonic()
    train = RayWorkerGroup(EchoWorker, train_pool, "train", log_dir=log_dir, args=("t",),
                           env={"MEGARL_TEST_ENV": "on"}, call_timeout_s=60)
    TIMINGS["train_group_2_workers_s"] = time.monotonic() - start
    start = time.monotonic()
    # by path: imported in the worker only (how the trainer starts the megatron workers)
    rollout = RayWorkerGroup("cluster_workers:EchoWorker", rollout_pool, "rollout", log_dir=log_dir,
                             kwargs={"tag": "r"}, call_timeout_s=60)
    TIMINGS["rollout_group_1_worker_s"] = time.monotonic() - start
    yield train, rollout
    train.shutdown()
    rollout.shutdown()


def test_two_pools_give_distinct_deterministic_ranks(pools, groups):
    train, rollout = groups
    ids = train.execute_all("identity")
    assert [i["rank"] for i in ids] == [0, 1]
    assert [i["env"]["RANK"] for i in ids] == ["0", "1"]
    assert {i["env"]["WORLD_SIZE"] for i in ids} == {"2"}
    assert [i["env"]["LOCAL_RANK"] for i in ids] == ["0", "1"]
    assert {i["env"]["MEGARL_ROLE"] for i in ids} == {"train"}
    assert {i["env"]["MEGARL_TEST_ENV"] for i in ids} == {"on"}
    assert {i["tag"] for i in ids} == {"t"}
    # Ray was started with torchrun's environment; none of it reaches the workers.
    assert {i["env"]["TORCHELASTIC_USE_AGENT_STORE"] for i in ids} == {None}
    assert {i["env"]["TORCHELASTIC_RUN_ID"] for i in ids} == {None}
    # One rendezvous per group: rank 0's node IP and one port, shared by the group's ranks.
    assert len({(i["env"]["MASTER_ADDR"], i["env"]["MASTER_PORT"]) for i in ids}) == 1
    assert ids[0]["env"]["MASTER_ADDR"] == train.infos[0].node_ip
    # On one node, rank r sits on bundle r of the pool's placement group.
    assert train.slots == pools[0].slots
    assert [(s.pg_index, s.bundle_index) for s in train.slots] == [(0, 0), (0, 1)]

    (rid,) = rollout.execute_all("identity")
    assert (rid["rank"], rid["world_size"], rid["role"], rid["tag"]) == (0, 1, "rollout", "r")
    assert rid["env"]["MEGARL_TEST_ENV"] is None
    assert rid["env"]["MASTER_PORT"] != ids[0]["env"]["MASTER_PORT"]
    assert len({i["pid"] for i in ids} | {rid["pid"]}) == 3
    # Workers compete for CPU on equal terms with the driver (Ray's default is niceness 15).
    assert {i["niceness"] for i in ids} | {rid["niceness"]} == {os.nice(0)}
    # Each worker's stdout went to its own log file.
    for rank, path in enumerate(train.log_paths):
        assert path.endswith(f"train_rank{rank}.log")
        assert f"EchoWorker train rank {rank} init tag=t" in Path(path).read_text()


def test_rank_order_is_node_ip_then_gpu_then_bundle():
    slots = [Slot(pg, b, f"n{pg}", "") for pg in range(2) for b in range(2)]
    placements = [  # pg 0 landed on 10.0.0.10, pg 1 on 10.0.0.9; bundles got GPUs out of order
        {"node_ip": "10.0.0.10", "gpu_ids": [3]}, {"node_ip": "10.0.0.10", "gpu_ids": [1]},
        {"node_ip": "10.0.0.9", "gpu_ids": [0]}, {"node_ip": "10.0.0.9", "gpu_ids": [5]},
    ]
    assert rank_order(placements, slots) == [2, 3, 1, 0]
    cpu = [{"node_ip": "10.0.0.2", "gpu_ids": []}, {"node_ip": "10.0.0.1", "gpu_ids": []}]
    assert rank_order(cpu, [Slot(0, 0, "a", ""), Slot(1, 0, "b", "")]) == [1, 0]


def test_train_workers_all_reduce_over_gloo(groups):
    train, _ = groups
    results = train.execute_all("all_reduce")
    # Rank r contributes [r+1, 10(r+1)]: the sum over 2 ranks is [3, 30] on both.
    assert results == [[0, 2, 3.0, 30.0], [1, 2, 3.0, 30.0]]


def test_execute_rank_split_delivers_each_rank_its_args(groups):
    train, _ = groups
    out = train.execute_rank_split("echo", [(1, "a"), {"x": 2}], common=7)
    assert out == [(0, (1, "a"), {"common": 7}), (1, ({"x": 2},), {"common": 7})]
    # Object refs among the arguments are fetched on the worker.
    out = train.execute_rank_split("echo", [(ray.put(5),), 6], k=ray.put("v"))
    assert out == [(0, (5,), {"k": "v"}), (1, (6,), {"k": "v"})]
    handle = train.execute_all_async("echo", [5, 6], k="v")
    assert len(handle.refs) == 2
    assert handle.get() == [(0, ([5, 6],), {"k": "v"}), (1, ([5, 6],), {"k": "v"})]
    with pytest.raises(ValueError, match="per_rank_args has 1 entries but the group has 2"):
        train.execute_rank_split("echo", [()])
    with pytest.raises(TypeError, match="has no method 'no_such_method'"):
        train.execute_all("no_such_method")


def test_worker_exception_reaches_driver_with_rank_host_traceback(groups):
    train, _ = groups
    with pytest.raises(WorkerError) as info:
        train.execute_all("fail_on", 1, "boom from rank 1")
    err = info.value
    assert err.ranks == [1]
    text = str(err)
    host = f"{train.infos[1].hostname} ({train.infos[1].node_ip})"
    pid = train.execute_all("identity")[1]["pid"]
    assert f"train rank 1 (host {host}, pid {pid}) raised in 'fail_on'" in text
    assert "Traceback (most recent call last)" in text
    assert "in _inner_failure" in text and "raise ValueError(message)" in text
    assert text.rstrip().endswith("ValueError: boom from rank 1")
    assert train.execute_all("echo") == [(0, (), {}), (1, (), {})]  # the group still works


def test_hanging_call_times_out_naming_rank_and_phase(groups, tmp_path):
    train, _ = groups
    release = tmp_path / "release"
    start = time.monotonic()
    try:
        with pytest.raises(WorkerTimeoutError) as info:
            train.execute_all_async("stuck_on", 1, str(release)).get(timeout_s=1.0,
                                                                     phase="update_actor")
        elapsed = time.monotonic() - start
    finally:
        release.touch()  # rank 1 was stuck until here: its stacks were dumped while stuck
    err = info.value
    assert err.ranks == [1] and err.phase == "update_actor"
    text = str(err)
    assert "phase 'update_actor' of role train did not finish within 1 s on 1 of 2 ranks" in text
    assert "rank 1 (host" in text and "finished: ranks [0]" in text
    # Rank 1 dumped its stacks into its log: the stuck frame is named.
    assert "in stuck_on" in text and train.log_paths[1] in text
    assert 1.0 <= elapsed < 5.0
    assert train.execute_all("echo", 1) == [(0, (1,), {}), (1, (1,), {})]  # once released


def test_a_wait_ends_with_the_error_of_what_the_ranks_wait_for(groups, tmp_path):
    """``get(abort=...)``: while rank 1 waits for something that will not come (a broadcast an
    engine refused to join), the driver learns why at the first poll after the refusal, not
    at the call's timeout; the ranks are not waited for."""
    train, _ = groups
    release = tmp_path / "release"
    polls: list[float] = []
    refused = RuntimeError("POST http://engine/update_weights_from_distributed failed: no")

    def abort() -> BaseException | None:
        polls.append(time.monotonic())
        return refused if len(polls) >= 3 else None

    try:
        with pytest.raises(RuntimeError) as info:
            train.execute_all_async("stuck_on", 1, str(release)).get(
                timeout_s=60, phase="sync_weights", abort=abort)
    finally:
        release.touch()
    assert info.value is refused and len(polls) == 3  # raised at the refusal, not at 60 s
    assert train.execute_all("echo", 2) == [(0, (2,), {}), (1, (2,), {})]  # once released


def test_dead_worker_is_reported_with_log_tail(ray_runtime, tmp_path):
    from cluster_workers import EchoWorker

    pool = create_resource_pool("victim_pool", 1, 2, "cpu", cpus_per_bundle=0.25)
    # A worker whose __init__ raises: reported with rank and traceback.
    with pytest.raises(WorkerError, match=r"critic rank 1 \(host .*\) raised in 'EchoWorker"
                                          r".__init__'(.|\n)*cannot build critic rank 1"):
        RayWorkerGroup(EchoWorker, pool, "critic", log_dir=tmp_path, kwargs={"fail_rank": 1})
    # Its actors were stopped: their whole bundles are free again for the next group.
    group = RayWorkerGroup(EchoWorker, pool, "critic", log_dir=tmp_path, call_timeout_s=60,
                           start_timeout_s=30)
    pid0, pid1 = (i["pid"] for i in group.execute_all("identity"))
    start = time.monotonic()
    with pytest.raises(WorkerDiedError) as info:
        group.execute_all("exit_on", 1, 30.0)  # rank 0 keeps blocking: must not wait for it
    elapsed = time.monotonic() - start
    err = info.value
    text = str(err)
    assert err.ranks == [1] and elapsed < 10.0
    assert f"critic rank 1 (host {group.infos[1].hostname} ({group.infos[1].node_ip}), " \
           f"pid {pid1}) died during 'exit_on'" in text
    assert "last words of critic rank 1" in text and "stderr line before dying" in text
    assert f"full log: {tmp_path / 'critic_rank1.log'}" in text
    # Rank 0 killed from outside (as the OOM killer would): both ranks now reported dead.
    os.kill(pid0, signal.SIGKILL)
    with pytest.raises(WorkerDiedError) as info:
        group.execute_all("echo")
    assert info.value.ranks == [0, 1]
    assert "critic rank 0" in str(info.value) and "EchoWorker critic rank 0 init" in str(
        info.value)
    group.shutdown()
    pool.remove()


def test_unschedulable_pool_names_pool_bundles_and_resources(pools, groups, tmp_path):
    # Never fits (8 CPUs on a 3-CPU node): reported at once.
    start = time.monotonic()
    with pytest.raises(PoolSchedulingError) as info:
        create_resource_pool("rollout_pool", 1, 8, "cpu", cpus_per_bundle=1.0, timeout_s=60.0)
    assert time.monotonic() - start < 5.0
    text = str(info.value)
    assert "rollout_pool: no node of the Ray cluster can ever hold one node's share" in text
    assert "1 node(s) x 8 bundles of {CPU: 1}" in text and "{CPU: 3}" in text
    assert "resources.rollout_pool.gpus_per_node" in text
    # Fits the node but not what the module's pools leave free (3 - 1.5 CPUs): times out.
    with pytest.raises(PoolSchedulingError) as info:
        create_resource_pool("train_pool", 1, 2, "cpu", cpus_per_bundle=1.0, timeout_s=1.0)
    text = str(info.value)
    assert "train_pool: placement groups not scheduled within 1 s (0 of 1 ready)" in text
    assert "1 node(s) x 2 bundles of {CPU: 1}" in text
    assert "{CPU: 3}" in text and "available now: {CPU: 1.5}" in text
    # A second group on a pool whose bundles the first group holds whole: named, not a hang.
    from cluster_workers import EchoWorker

    with pytest.raises(PoolSchedulingError, match=r"rollout: 1 of 1 actors not placed on "
                                                  r"rollout_pool within 1 s(.|\n)*"
                                                  r"max_colocate_count"):
        RayWorkerGroup(EchoWorker, pools[1], "rollout", log_dir=tmp_path, start_timeout_s=1.0)


def test_create_pools_shared_when_colocated(ray_runtime):
    resources = ResourcesConfig(train_pool=PoolConfig(nnodes=1, gpus_per_node=2),
                                rollout_pool=PoolConfig(nnodes=1, gpus_per_node=1), device="auto")
    shared = create_pools(resources, colocate=True, cpus_per_bundle=0.1, max_colocate_count=2)
    assert shared["train_pool"] is shared["rollout_pool"]
    assert shared["train_pool"].device == "cpu" and shared["train_pool"].world_size == 2
    assert shared["train_pool"].worker_resources() == {"CPU": 0.05}
    shared["train_pool"].remove()
    separate = create_pools(resources, colocate=False, cpus_per_bundle=0.1)
    assert [separate[k].world_size for k in ("train_pool", "rollout_pool")] == [2, 1]
    for pool in separate.values():
        pool.remove()
    with pytest.raises(ValueError, match="resources.rollout_pool is null but rollout.colocate"):
        create_pools(ResourcesConfig(), colocate=False)


def test_existing_ray_is_detected_attached_or_reported(ray_runtime):
    ours = ray_runtime.gcs_address
    assert ours in {r.gcs_address for r in find_local_ray()}
    # A second driver: with on_existing="error" it names the running instance and `ray stop`;
    # then it attaches to ours (by address: other Ray instances may run on this machine).
    script = textwrap.dedent(f"""
        import json
        from megarl.cluster import RayStartError, init_ray
        try:
            init_ray(on_existing="error")
            out = {{"error": None}}
        except RayStartError as err:
            out = {{"error": str(err)}}
        runtime = init_ray({ours!r}, num_cpus=1)
        out["attached"], out["cpus"] = runtime.gcs_address, runtime.cpus
        import ray, sys
        ray.shutdown()
        print("JOINING WITH ITS OWN CPUS", file=sys.stderr, flush=True)
        init_ray({ours!r}, num_cpus=3)  # what the node offers (the Slurm script's case): quiet
        print("RESULT" + json.dumps(out))
    """)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=REPO, check=False)
    TIMINGS["attach_subprocess_s"] = time.monotonic() - start
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")]
    assert line, proc.stdout + proc.stderr
    out = json.loads(line[0][len("RESULT"):])
    assert out["error"] is not None and "already running on this node" in out["error"]
    assert ours in out["error"] and "`ray stop`" in out["error"]
    assert (out["attached"], out["cpus"]) == (ours, 3.0)  # num_cpus=1 cannot shrink it
    # `megarl doctor` finds it as the trainer does, by its raylet (not /tmp/ray's default)
    from megarl.doctor import check_ray

    found = check_ray()
    assert found.status == "WARN" and ours in found.detail and "ray.address=local" in found.line()
    first, second = proc.stderr.split("JOINING WITH ITS OWN CPUS")
    assert "ray.num_cpus=1 is ignored when joining" in first and "offers 3.0 CPUs" in first
    assert "ignored when joining" not in second
    with pytest.raises(RayStartError, match="could not join Ray at 127.0.0.1:1"):
        _join_in_subprocess("127.0.0.1:1")


def _join_in_subprocess(address: str) -> None:
    """init_ray(address) in a fresh process; re-raise its RayStartError message here."""
    script = ("from megarl.cluster import RayStartError, init_ray\n"
              f"try:\n    init_ray({address!r})\nexcept RayStartError as e:\n"
              "    print('ERR' + str(e).splitlines()[0])\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env={**os.environ, "RAY_ADDRESS": ""},
                          check=False)
    errors = [x for x in proc.stdout.splitlines() if x.startswith("ERR")]
    if errors:
        raise RayStartError(errors[0][3:])


def test_timeline_names_group_calls(groups, tmp_path):
    path = write_timeline(tmp_path / "timeline.json")
    events = json.loads(path.read_text())
    names = {e.get("name") for e in events}
    assert {"train.all_reduce", "train.echo", "rollout.identity"} <= names
