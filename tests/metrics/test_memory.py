"""Per-phase memory peaks and the out-of-memory report (PITFALLS T1): an OOM raised inside a
phase of a worker (through the ``MEGARL_OOM_AT`` hook) reaches the driver through the worker
host's real error transport as one message naming the phase, the rank and the knobs."""

from __future__ import annotations

import asyncio
import pickle

import pytest
import torch

from megarl.cluster.actor_host import WorkerHost
from megarl.cluster.worker import WorkerInfo
from megarl.memory import (
    PHASE_KNOBS,
    PhaseOutOfMemory,
    free_cached_memory,
    memory_metrics,
    phase_memory,
)
from megarl.trainer import Trainer


def _host(rank: int) -> WorkerHost:
    """A worker host with its identity set (no Ray, no environment changes)."""
    host = WorkerHost.__new__(WorkerHost)
    host._role, host._worker = "actor", None
    host._info = WorkerInfo(role="actor", rank=rank, world_size=4, local_rank=rank,
                            local_world_size=4, master_addr="127.0.0.1", master_port=1,
                            node_ip="10.0.0.7", hostname="node7", device="cpu")
    return host


@pytest.mark.parametrize("phase", ["old_log_prob", "ref", "update_actor", "sync_weights"])
def test_oom_in_a_worker_phase_reaches_the_driver_as_one_message(monkeypatch, phase):
    """MEGARL_OOM_AT raises torch.OutOfMemoryError inside the phase on rank 2 only; the
    driver's error names the phase, the rank and every knob of that phase."""
    monkeypatch.setenv("MEGARL_OOM_AT", f"{phase}:2")
    monkeypatch.setenv("RANK", "2")

    def work() -> None:
        with phase_memory(phase, "actor rank 2 (host node7)", {}):
            pass

    with pytest.raises(PhaseOutOfMemory) as caught:
        Trainer.reporting_oom(lambda: _host(2)._run("update", work))
    message = str(caught.value)
    assert "\n" not in message
    assert f"out of memory in phase {phase!r} on actor rank 2 (host node7)" in message
    for knob in PHASE_KNOBS[phase]:
        assert knob in message
    monkeypatch.setenv("RANK", "1")  # another rank passes the same phase
    with phase_memory(phase, "actor rank 1", {}):
        pass


def test_an_engine_that_cannot_resume_names_the_knobs_of_the_hand_off():
    """resume_rollout's knobs: what the train side keeps, the engines' share, the sync's
    bucket (its cached blocks are what the engine resumes into)."""
    text = str(PhaseOutOfMemory("resume_rollout", "rollout engine http://h:1", "asked 1 bytes"))
    for knob in ("actor.offload.optimizer_offload", "actor.offload.grad_offload",
                 "actor.offload.param_offload", "rollout.gpu_memory_utilization",
                 "checkpoint_engine.bucket_size_mb"):
        assert knob in text


def test_update_knobs_and_pickling():
    """The update's message lists micro-batch, recompute and offload; the error pickles."""
    err = PhaseOutOfMemory("update_actor", "actor rank 0", "CUDA out of memory")
    text = str(pickle.loads(pickle.dumps(err)))
    for knob in ("actor.ppo_micro_batch_size_per_gpu", "actor.ppo_max_token_len_per_gpu",
                 "actor.recompute.granularity", "actor.offload.optimizer_offload"):
        assert knob in text
    assert "checkpoint_engine.bucket_size_mb" in str(
        PhaseOutOfMemory("sync_weights", "actor rank 0", "x"))


def test_an_engine_oom_in_generation_names_the_generation_knobs():
    """An engine's out-of-memory answer during generation is reported as phase gen."""

    class Client:
        async def generate(self, *args, **kwargs):
            raise RuntimeError("engine 0 answered 500: torch.OutOfMemoryError: CUDA out of "
                               "memory. Tried to allocate 2.00 GiB")

    trainer = Trainer.__new__(Trainer)
    trainer.sampling_params = lambda: None
    trainer.prompt_seeds = lambda step, count: [0] * count
    trainer.generation_options = dict
    trainer.agent = None  # single-turn generation (no rollout.multi_turn)
    with pytest.raises(PhaseOutOfMemory) as caught:
        asyncio.run(trainer.rollout(Client(), [{"input_ids": [1, 2]}], 0))
    assert "phase 'gen'" in str(caught.value)
    assert "rollout.gpu_memory_utilization" in str(caught.value)
    assert "rollout.max_num_seqs" in str(caught.value)


def test_other_errors_pass_unchanged():
    """Only allocation failures become PhaseOutOfMemory."""
    with pytest.raises(ValueError), phase_memory("update_actor", "actor rank 0"):
        raise ValueError("bad batch")


def test_peaks_are_recorded_per_phase_and_reduced_over_ranks():
    """Each phase's peaks and device use land in the dict (on CPU the resident set size, as the
    peaks); the metrics take the max over ranks and phases."""
    peaks: dict = {}
    with phase_memory("update_actor", "actor rank 0", peaks):
        torch.ones(1000)
    assert set(peaks) == {"update_actor"}
    allocated, reserved, used = peaks["update_actor"]
    assert allocated > 0 and used == allocated == reserved  # CPU: one reading for all three
    metrics = memory_metrics([{"gen": (1.0, 2.0, 7.0), "update_actor": (3.0, 4.0, 6.0)},
                              {"update_actor": (5.0, 1.0, 8.0)}])
    assert metrics["perf/max_memory_allocated_gb"] == 5.0
    assert metrics["perf/max_memory_reserved_gb"] == 4.0
    assert metrics["perf/max_memory_allocated_gb/gen"] == 1.0
    assert metrics["perf/max_memory_reserved_gb/update_actor"] == 4.0
    assert metrics["perf/device_used_gb/gen"] == 7.0
    assert metrics["perf/device_used_gb/update_actor"] == 8.0
    assert metrics["perf/device_used_gb"] == 8.0
    assert "perf/device_used_gb" not in memory_metrics([{"gen": (1.0, 2.0)}])


def test_freeing_the_cache_reports_what_the_process_held():
    """Before and after (CPU: resident bytes); garbage in cycles is collected."""
    import gc
    import weakref

    class Node:
        pass

    node = Node()
    node.self = node  # a cycle only the collector frees
    alive = weakref.ref(node)
    del node
    gc.disable()
    try:
        held = free_cached_memory()
    finally:
        gc.enable()
    assert alive() is None
    assert set(held) == {"before", "after"} and held["before"] > 0 and held["after"] > 0


def test_settled_objects_are_skipped_and_newer_cycles_still_freed():
    """``settle_long_lived_objects`` (end of a worker's setup) collects what is garbage then and
    sets the rest aside: a later ``free_cached_memory`` frees cycles made after it, holding
    tensors too, and scans only those; the checkpoint's optimizer collection then leaves the
    settled objects frozen."""
    import gc
    import weakref

    from megarl.megatron.checkpoint_state import _collections_see_only_new_objects
    from megarl.memory import settle_long_lived_objects

    class Node:
        pass

    def cycle(payload=None) -> weakref.ref:
        a, b = Node(), Node()
        a.other, b.other, a.payload = b, a, payload
        return weakref.ref(a)

    assert gc.get_freeze_count() == 0
    before = cycle()  # garbage at settle time: collected by the settle itself
    gc.disable()
    try:
        settled = settle_long_lived_objects()
        # (the count falls a little whenever a set-aside object is freed by its refcount)
        assert before() is None and settled > 10_000
        tensor = torch.zeros(1 << 20)
        held = weakref.ref(tensor)
        after = cycle(tensor)
        del tensor
        assert after() is not None and held() is not None
        free_cached_memory()
        assert after() is None and held() is None  # the phase's tensor is gone
        with _collections_see_only_new_objects():
            gc.collect()
        assert gc.get_freeze_count() > settled // 2  # still set aside (an unfreeze gives 0)
    finally:
        gc.enable()
        gc.unfreeze()
