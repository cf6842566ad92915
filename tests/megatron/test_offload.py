"""Host-memory offload of the actor's state (``actor.offload.*``) on a real megatron-core model
with megatron DDP and the distributed optimizer (Adam states sharded over two gloo ranks).

Two steps are taken with offload round trips in between and compared, bit for bit, with the
same two steps without them; while offloaded the storages are empty (0 bytes). The round trips:
every part at once, then the colocated step's order (grads and optimizer state after the update,
the parameters after the weight sync, the parameters back for the old-log-prob forward, the rest
for the next update).
"""

from __future__ import annotations

import pytest
import torch

from megarl.megatron.parallel import ParallelSizes

LENGTHS = (9, 14, 6, 11)


def _batch(seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    batch = []
    for n in LENGTHS:
        mask = torch.zeros(n)
        mask[3:] = 1
        batch.append({"tokens": torch.randint(0, 128, (n,), generator=g), "loss_mask": mask,
                      "old_log_probs": -5 + 0.3 * torch.randn(n, generator=g),
                      "advantages": torch.randn(n, generator=g)})
    return batch


def _state(actor) -> dict[str, torch.Tensor]:
    """Every model parameter and optimizer tensor of this rank, cloned, by a stable key."""
    from megarl.megatron.offload import _inner_optimizers

    out = {f"param/{n}": p.detach().clone() for n, p in actor.model.chunks[0].named_parameters()}
    for i, inner in enumerate(_inner_optimizers(actor.optimizer)):
        for j, group in enumerate(inner.param_groups):
            for k, p in enumerate(group["params"]):
                out[f"main/{i}/{j}/{k}"] = p.detach().clone()
                for name, v in inner.state.get(p, {}).items():
                    if isinstance(v, torch.Tensor):
                        out[f"state/{i}/{j}/{k}/{name}"] = v.detach().clone()
    return out


def _steps_on_rank(model_dir: str, round_trip: bool) -> dict:
    """Two Adam steps (with an offload round trip of every part between them, or none)."""
    from megatron.core import parallel_state as mpu

    from megarl.megatron.model import build_actor_model
    from megarl.megatron.offload import PARTS, StateOffloader
    from megarl.megatron.optimizer import OptimizerSettings, TrainableActor
    from megarl.megatron.update import LossSettings, TrainSequence, train_step

    torch.manual_seed(0)
    model = build_actor_model(model_dir, ParallelSizes(), torch.float32)
    actor = TrainableActor(model, OptimizerSettings(lr=1e-3, weight_decay=0.0))
    dp, size = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()

    def step(seed: int) -> dict[str, float]:
        seqs = [TrainSequence(**s) for s in _batch(seed)[dp::size]]
        return train_step(actor, seqs, LossSettings(entropy_coeff=0.01))

    first = step(1)
    out: dict = {"first": first, "before": _state(actor)}
    if round_trip:
        # 4 KiB slabs: storages span several (the default is 1 GiB, one slab for a tiny model)
        offloader = StateOffloader(model.chunks, actor.optimizer, slab_bytes=4096)
        freed = offloader.offload(PARTS)
        out["host_bytes"] = offloader.host_bytes
        out["spanning"] = max(len(s.host.segments) for stashes in offloader.stashes.values()
                              for s in stashes if s.host is not None)
        empty = [int(p.untyped_storage().nbytes()) for p in model.chunks[0].parameters()]
        grads = [int(p.main_grad.untyped_storage().nbytes())
                 for p in model.chunks[0].parameters()]
        states = [int(v.untyped_storage().nbytes()) for inner in
                  __import__("megarl.megatron.offload", fromlist=["x"])._inner_optimizers(
                      actor.optimizer) for st in inner.state.values() for v in st.values()
                  if isinstance(v, torch.Tensor)]
        out.update(freed=freed, empty=empty + grads + states, offloaded=sorted(
            offloader.offloaded), restored=offloader.reload())
        out["after"] = _state(actor)
        staged = offloader.offload(["grad", "optimizer"])  # after the update
        exported = {n: p.detach().clone() for n, p in model.chunks[0].named_parameters()}
        staged += offloader.offload(["param"])  # after the weight sync
        out["staged_offloaded"] = sorted(offloader.offloaded)
        back = offloader.reload(["param"])  # the old-log-prob forward
        out["params_back_alone"] = sorted(offloader.offloaded) == ["grad", "optimizer"] and all(
            torch.equal(p, exported[n]) for n, p in model.chunks[0].named_parameters())
        out["staged"], out["staged_back"] = staged, back + offloader.reload(PARTS)
        out["host_bytes_again"] = offloader.host_bytes  # the second cycle re-used the slabs
        out["after_staged"] = _state(actor)
    out["second"] = step(2)
    out["final"] = _state(actor)
    return out


def test_offload_round_trip_is_exact(pool2, tiny_models):
    """Offload + reload of params, grads and optimizer, at once and in the colocated step's
    order, leaves every tensor bit-identical, empties every storage meanwhile, and the next step
    equals the step without offload."""
    plain = pool2.run(_steps_on_rank, tiny_models["qwen3"], False)
    moved = pool2.run(_steps_on_rank, tiny_models["qwen3"], True)
    for rank in range(2):
        ref, got = plain[rank], moved[rank]
        assert got["offloaded"] == ["grad", "optimizer", "param"]
        assert got["freed"] > 0 and got["restored"] == got["freed"]
        assert got["empty"] and all(n == 0 for n in got["empty"]), got["empty"]
        # params and optimizer copied (grads only freed), in slabs: at most a slab and the
        # 512-byte alignment of each storage more than the bytes
        assert got["spanning"] > 1
        assert got["host_bytes_again"] == got["host_bytes"] < got["freed"]
        assert any(k.startswith("state/") for k in got["before"]), "no Adam state to move"
        assert got["before"].keys() == got["after"].keys()
        for key, value in got["before"].items():
            assert torch.equal(value, got["after"][key]), key
            assert torch.equal(value, got["after_staged"][key]), key
        assert got["staged_offloaded"] == ["grad", "optimizer", "param"]
        assert got["params_back_alone"]
        assert got["staged"] == got["freed"] and got["staged_back"] == got["freed"]
        assert got["first"] == ref["first"] and got["second"] == ref["second"]
        for key, value in ref["final"].items():
            assert torch.equal(value, got["final"][key]), key


def _optimizer_state_bytes(actor) -> list[int]:
    """The bytes of every Adam state tensor's storage on this rank (0: offloaded)."""
    from megarl.megatron.offload import _inner_optimizers

    return [int(v.untyped_storage().nbytes()) for inner in _inner_optimizers(actor.optimizer)
            for state in inner.state.values() for v in state.values()
            if isinstance(v, torch.Tensor)]


def _worker_updates(model_dir: str, offload: bool) -> dict:
    """The ActorWorker as the trainer drives it: an update of two mini-batches, the offload
    after it, an update of one; what the Adam state's storages held at every forward."""
    from megatron.core import parallel_state as mpu

    from megarl.megatron.offload import OffloadSettings
    from megarl.megatron.optimizer import OptimizerSettings
    from megarl.megatron.update import LossSettings
    from megarl.megatron.worker import ActorSpec, ActorWorker

    spec = ActorSpec(
        model_path=model_dir, dtype="float32", sizes=ParallelSizes(),
        optim=OptimizerSettings(lr=1e-3, weight_decay=0.0), loss=LossSettings(entropy_coeff=0.01),
        with_ref=False, temperature=1.0, max_tokens_per_micro_batch=24, seed=1,
        offload=OffloadSettings(grad_offload=offload, optimizer_offload=offload))
    worker = ActorWorker(spec)
    dp, size = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
    seen: list[list[int]] = []
    worker.actor.model.chunks[0].register_forward_pre_hook(
        lambda *_: seen.append(_optimizer_state_bytes(worker.actor)))

    def mini_batch(seed: int) -> list[dict]:
        return [{k: v.tolist() for k, v in s.items()} for s in _batch(seed)[dp::size]]

    metrics = worker.update([mini_batch(1), mini_batch(2)])
    stepped = _optimizer_state_bytes(worker.actor)
    worker.offload()  # what actor.offload switches on, as the trainer does after the update
    metrics += worker.update([mini_batch(3)])
    return {"metrics": metrics, "seen": seen, "stepped": stepped, "final": _state(worker.actor),
            "moved": worker.memory_stats()["seconds"]}


def test_an_offloaded_optimizer_state_comes_back_for_the_steps_only(pool2, tiny_models):
    """With ``optimizer_offload`` the Adam state stays in host memory through every forward and
    backward of an update (the second mini-batch's too: it leaves again after the first step)
    and is on the device for the steps: the three steps equal, bit for bit, those of a worker
    that never offloads."""
    kept = pool2.run(_worker_updates, tiny_models["qwen3"], False)
    moved = pool2.run(_worker_updates, tiny_models["qwen3"], True)
    for rank in range(2):
        ref, got = kept[rank], moved[rank]
        assert len(ref["seen"]) == len(got["seen"]) >= 3, "a forward per micro-batch at least"
        assert got["stepped"] and all(n > 0 for n in got["stepped"])  # the step had it back
        assert got["stepped"] == ref["stepped"]
        first = [s for s in got["seen"] if s]  # the first mini-batch's forwards: no state yet
        assert first and all(n == 0 for s in first for n in s), got["seen"]
        assert all(n > 0 for s in ref["seen"] if s for n in s)
        assert len(first) == len([s for s in ref["seen"] if s])
        assert got["moved"]["reload_actor"] > 0 and got["moved"]["offload_actor"] > 0
        assert got["metrics"] == ref["metrics"]
        assert ref["final"].keys() == got["final"].keys()
        for key, value in ref["final"].items():
            assert torch.equal(value, got["final"][key]), key


def _worker_streamed_updates(model_dir: str, chunk_bytes: int) -> dict:
    """As :func:`_worker_updates` with an offloaded optimizer state whose steps stream the Adam
    moments ``chunk_bytes`` at a time; what the device held of them during and after each step."""
    from megatron.core import parallel_state as mpu

    from megarl.megatron.offload import OffloadSettings, _inner_optimizers, _moments
    from megarl.megatron.optimizer import OptimizerSettings
    from megarl.megatron.update import LossSettings
    from megarl.megatron.worker import ActorSpec, ActorWorker

    spec = ActorSpec(
        model_path=model_dir, dtype="float32", sizes=ParallelSizes(),
        optim=OptimizerSettings(lr=1e-3, weight_decay=0.0), loss=LossSettings(entropy_coeff=0.01),
        with_ref=False, temperature=1.0, max_tokens_per_micro_batch=24, seed=1,
        offload=OffloadSettings(grad_offload=True, optimizer_offload=True,
                                optimizer_step_chunk_mb=1))
    worker = ActorWorker(spec)
    assert worker.offloader.stream_bytes == 1 << 20
    worker.offloader.stream_bytes = chunk_bytes  # the tiny model's moments are a few hundred KiB
    dp, size = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
    inners = _inner_optimizers(worker.actor.optimizer)
    out: dict = {"inner_optimizers": len(inners)}

    def moments() -> list[torch.Tensor]:
        return [m for inner in inners for group in inner.param_groups
                for p in group["params"] for m in _moments(inner, p)]

    def mini_batch(seed: int) -> list[dict]:
        return [{k: v.tolist() for k, v in s.items()} for s in _batch(seed)[dp::size]]

    out["metrics"] = worker.update([mini_batch(1), mini_batch(2)])
    out["peaks"] = [worker.offloader.stream_peak_bytes]
    out["chunks"] = [worker.offloader.stream_chunks]
    out["moment_slabs"] = [worker.offloader.arenas["moments"].allocated_bytes]
    out["left_on_device"] = [int(m.untyped_storage().nbytes()) for m in moments()]
    out["masters_on_device"] = sorted(worker.offloader.offloaded) == ["optimizer"] and all(
        p.untyped_storage().nbytes() > 0 for inner in inners for g in inner.param_groups
        for p in g["params"])
    worker.offload()
    out["metrics"] += worker.update([mini_batch(3)])
    out["peaks"].append(worker.offloader.stream_peak_bytes)
    out["chunks"].append(worker.offloader.stream_chunks)
    out["moment_slabs"].append(worker.offloader.arenas["moments"].allocated_bytes)
    stashed = worker.offloader.stashes["moments"]
    out["moment_bytes"] = sum(s.nbytes for s in stashed)
    out["moment_count"], out["params"] = len(stashed), len(
        [p for inner in inners for g in inner.param_groups for p in g["params"]])
    out["largest"] = max(2 * p.numel() * p.element_size() for inner in inners
                         for g in inner.param_groups for p in g["params"])
    worker.reload()
    out["final"] = _state(worker.actor)
    return out


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_a_streamed_optimizer_step_equals_the_whole_one_and_holds_three_chunks(pool2, tiny_models,
                                                                             arch):
    """``offload.optimizer_step_chunk_mb``: each step brings the Adam moments to the device a
    chunk at a time and sends them back (on a CPU the copies are plain): the three steps (the
    first makes the moments, the second and third stream them) equal, bit for bit, those of a
    worker that never offloads; after a step no moment is on the device while the fp32 main
    params are; at no time did a step hold more than three chunks of moments. The MoE model's
    optimizer is megatron's chained one (dense and expert parameters): both stream."""
    kept = pool2.run(_worker_updates, tiny_models[arch], False)
    chunk = 16 << 10
    streamed = pool2.run(_worker_streamed_updates, tiny_models[arch], chunk)
    for rank in range(2):
        ref, got = kept[rank], streamed[rank]
        assert got["inner_optimizers"] == (2 if arch == "qwen3_moe" else 1)
        assert got["metrics"] == ref["metrics"]
        for key, value in ref["final"].items():
            assert torch.equal(value, got["final"][key]), key
        assert got["left_on_device"] and not any(got["left_on_device"])
        assert got["masters_on_device"]
        # every parameter has its two moments in host memory, once
        assert got["moment_count"] == 2 * got["params"]
        window = 3 * max(chunk, got["largest"])
        for peak in got["peaks"]:
            assert 0 < peak <= window, (peak, window)
            assert peak < got["moment_bytes"], (peak, got["moment_bytes"])
        assert min(got["chunks"]) >= 3, got["chunks"]
        # the second cycle streamed into the first one's ranges: no slab added
        assert got["moment_slabs"][0] == got["moment_slabs"][1] >= got["moment_bytes"]
