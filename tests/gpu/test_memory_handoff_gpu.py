"""The colocated memory hand-off on a GPU: the embedded engine's release frees its weights and
KV cache (``torch.cuda.memory_allocated`` drops by them) and resume restores a working decoder;
the actor's offload frees params, grad buffers and optimizer state and reload brings them back
for an update that runs as before."""

from __future__ import annotations

import pytest
import torch

from megarl.data.tiny_model import make_tiny_model

MB = 1024**2


def _tensor_bytes(model: torch.nn.Module) -> int:
    seen = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in seen.values())


def _decode_logits(runner, seqs: list[list[int]], steps: int = 4) -> torch.Tensor:
    out, kv = runner.prefill(seqs, routes=False)
    runner.append_rows(kv, list(range(len(seqs))))
    logits = out.logits
    for _ in range(steps):
        logits = runner.decode(logits.argmax(-1).tolist(), routes=False).logits
    runner.clear_rows()
    return logits.float().cpu()


@pytest.mark.parametrize("backup", [True, False])
def test_engine_release_frees_weights_and_kv_and_resume_restores(tmp_path, backup):
    """release kv_cache + weights drops allocated memory by at least the weights; resume brings
    the weights back (``backup``: from host memory; else dropped, and a load of the checkpoint,
    as a weight sync writes, refills them) and decoding (fused projections, static KV, CUDA
    graphs) gives the same logits as before."""
    from megarl.rollout.local.model_runner import ModelRunner
    from megarl.rollout.local.weights import iter_safetensors

    model_dir = make_tiny_model(tmp_path / "m", arch="qwen3", seed=0, head_dim=64,
                                hidden_size=512, num_attention_heads=8, num_hidden_layers=4,
                                with_tokenizer=False)
    runner = ModelRunner(model_dir, device="cuda", dtype="bfloat16", weights_cpu_backup=backup)
    seqs = [[5, 6, 7, 8] * 8, [9, 10, 11] * 20]
    _decode_logits(runner, seqs)  # the first decode captures the graphs
    weights = _tensor_bytes(runner.model)
    before = _decode_logits(runner, seqs)  # replayed from the graphs, like every later decode
    torch.cuda.synchronize()
    loaded = torch.cuda.memory_allocated()
    runner.release_kv_cache()
    runner.offload()
    released = torch.cuda.memory_allocated()
    assert loaded - released >= weights, (loaded, released, weights)
    if backup:
        assert all(p.device.type == "cpu" for p in runner.model.parameters())
    else:
        assert all(p.numel() == 0 for p in runner.model.parameters())
    runner.reload()
    assert torch.cuda.memory_allocated() - released >= weights
    if not backup:
        assert runner.weight_map.unwritten()
        runner.weight_map.load_many(iter_safetensors(model_dir))
        assert runner.weight_map.unwritten() == []
    after = _decode_logits(runner, seqs)
    torch.testing.assert_close(after, before, atol=0, rtol=0)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_a_dummy_start_on_the_gpu_decodes_as_the_checkpoint_once_written(tmp_path, arch):
    """``load_format="dummy"`` (``rollout.load_format``) builds the model on the GPU from its
    config alone, with no checkpoint read; once a load of the checkpoint (what the trainer's
    first sync writes) has written every tensor, the native decoder (fused projections, static
    KV, CUDA graphs) gives the logits of an engine that read the checkpoint, bit for bit."""
    import shutil

    from megarl.rollout.local.model_runner import ModelRunner
    from megarl.rollout.local.weights import iter_safetensors

    model_dir = make_tiny_model(tmp_path / "m", arch=arch, seed=0, head_dim=64,
                                hidden_size=512, num_attention_heads=8, num_hidden_layers=4,
                                with_tokenizer=False)
    seqs = [[5, 6, 7, 8] * 8, [9, 10, 11] * 20]
    loaded = ModelRunner(model_dir, device="cuda", dtype="bfloat16")
    _decode_logits(loaded, seqs)  # the first decode captures the graphs
    expected = _decode_logits(loaded, seqs)  # replayed, as below
    bare = tmp_path / "config_only"
    bare.mkdir()
    shutil.copy(model_dir / "config.json", bare / "config.json")
    runner = ModelRunner(bare, device="cuda", dtype="bfloat16", load_format="dummy")
    assert all(p.device.type == "cuda" for p in runner.model.parameters())
    assert runner.weight_map.unwritten()
    runner.weight_map.load_many(iter_safetensors(model_dir))
    assert runner.weight_map.unwritten() == []
    _decode_logits(runner, seqs)  # the first decode captures the graphs
    torch.testing.assert_close(_decode_logits(runner, seqs), expected, atol=0, rtol=0)


def test_actor_offload_frees_state_and_reload_restores(tmp_path, megatron_rank):
    """Offloading param, grad and optimizer frees at least their bytes on the GPU; reload
    restores them bit-exactly and the next update runs."""
    from megarl.megatron.model import build_actor_model
    from megarl.megatron.offload import PARTS, StateOffloader
    from megarl.megatron.optimizer import OptimizerSettings, TrainableActor
    from megarl.megatron.parallel import ParallelSizes
    from megarl.megatron.update import LossSettings, TrainSequence, train_step

    model_dir = make_tiny_model(tmp_path / "actor", arch="qwen3", seed=0)
    model = build_actor_model(str(model_dir), ParallelSizes(), torch.bfloat16)
    actor = TrainableActor(model, OptimizerSettings(lr=1e-3))
    g = torch.Generator().manual_seed(0)
    seqs = [TrainSequence(tokens=torch.randint(0, 128, (n,), generator=g),
                          loss_mask=torch.ones(n), old_log_probs=torch.full((n,), -5.0),
                          advantages=torch.randn(n, generator=g)) for n in (12, 20)]
    train_step(actor, seqs, LossSettings())
    state = [p.detach().clone() for p in model.chunks[0].parameters()]
    torch.cuda.synchronize()
    resident = torch.cuda.memory_allocated()
    offloader = StateOffloader(model.chunks, actor.optimizer)
    freed = offloader.offload(PARTS)
    offloaded = torch.cuda.memory_allocated()
    assert freed > 0 and resident - offloaded >= freed, (resident, offloaded, freed)
    assert offloader.reload() == freed
    assert torch.cuda.memory_allocated() - offloaded >= freed
    for old, new in zip(state, model.chunks[0].parameters()):
        assert torch.equal(old, new)
    metrics = train_step(actor, seqs, LossSettings())
    assert metrics["actor/update_skipped"] == 0.0


def test_a_started_worker_keeps_no_cache_for_the_engines_to_miss(tmp_path, megatron_rank):
    """An ActorWorker with gradients and optimizer state offloaded (the colocated defaults)
    hands back what building the model and offloading freed before colocated engines start and
    size their KV cache to what is free: it reserves little beyond what it still holds (on the
    H200's dense e2e shape it kept 18 GB reserved through step 1's generation, which ran out of
    memory)."""
    from megarl.megatron.offload import OffloadSettings
    from megarl.megatron.optimizer import OptimizerSettings
    from megarl.megatron.parallel import ParallelSizes
    from megarl.megatron.update import LossSettings
    from megarl.megatron.worker import ActorSpec, ActorWorker

    model_dir = make_tiny_model(tmp_path / "actor", arch="qwen3", seed=0, hidden_size=512,
                                intermediate_size=2048, num_hidden_layers=4)
    spec = ActorSpec(model_path=str(model_dir), dtype="bfloat16", sizes=ParallelSizes(),
                     optim=OptimizerSettings(lr=1e-3), loss=LossSettings(), with_ref=False,
                     temperature=1.0, max_tokens_per_micro_batch=256, seed=0,
                     offload=OffloadSettings(grad_offload=True, optimizer_offload=True))
    worker = ActorWorker(spec)
    torch.cuda.synchronize()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    offloaded = worker.offloader.host_bytes
    assert offloaded > 0 and "grad" in worker.offloader.offloaded
    # without the hand-back the freed blocks stay reserved: the slack would be >= offloaded
    assert reserved - allocated < 0.25 * offloaded, (reserved, allocated, offloaded)


def _worker_two_updates(model_dir, offload: bool, stream_bytes: int = 0) -> dict:
    """An ActorWorker (bf16, the distributed optimizer) as the trainer drives it: an update of
    two mini-batches, the offload, another update; the Adam state's bytes at every forward
    (``stream_bytes``: the steps stream the moments in chunks of that size)."""
    from megarl.megatron.offload import OffloadSettings, _inner_optimizers
    from megarl.megatron.optimizer import OptimizerSettings
    from megarl.megatron.parallel import ParallelSizes
    from megarl.megatron.update import LossSettings
    from megarl.megatron.worker import ActorSpec, ActorWorker

    spec = ActorSpec(model_path=str(model_dir), dtype="bfloat16", sizes=ParallelSizes(),
                     optim=OptimizerSettings(lr=1e-3), loss=LossSettings(), with_ref=False,
                     temperature=1.0, max_tokens_per_micro_batch=64, seed=0,
                     offload=OffloadSettings(grad_offload=offload, optimizer_offload=offload,
                                             optimizer_step_chunk_mb=1 if stream_bytes else 0))
    worker = ActorWorker(spec)
    if stream_bytes:
        worker.offloader.stream_bytes = stream_bytes
    inner = _inner_optimizers(worker.actor.optimizer)

    def state_bytes() -> list[int]:
        return [v.untyped_storage().nbytes() for opt in inner for st in opt.state.values()
                for v in st.values() if isinstance(v, torch.Tensor) and v.is_cuda]

    seen: list[list[int]] = []
    worker.actor.model.chunks[0].register_forward_pre_hook(lambda *_: seen.append(state_bytes()))
    g = torch.Generator().manual_seed(0)

    def mini_batch() -> list[dict]:
        return [{"tokens": torch.randint(0, 128, (n,), generator=g).tolist(),
                 "loss_mask": [1.0] * n, "old_log_probs": [-5.0] * n,
                 "advantages": torch.randn(n, generator=g).tolist()} for n in (40, 30, 50)]

    metrics = worker.update([mini_batch(), mini_batch()])
    worker.offload()
    metrics += worker.update([mini_batch()])
    after_step = state_bytes()
    worker.reload()
    moments = [v.float().cpu() for opt in inner for st in opt.state.values()
               for k, v in st.items() if k != "step" and isinstance(v, torch.Tensor)]
    streamed = {"peak": worker.offloader.stream_peak_bytes, "moments": moments,
                "chunks": worker.offloader.stream_chunks, "after_step": after_step,
                "largest": max(2 * p.numel() * p.element_size() for opt in inner
                               for group in opt.param_groups for p in group["params"])}
    return {"metrics": metrics, "seen": seen, "streamed": streamed,
            "fused": [group.get("fused") for opt in inner for group in opt.param_groups],
            "params": [p.detach().float().cpu() for p in worker.actor.model.chunks[0].parameters()]}


def test_an_offloaded_optimizer_state_is_off_the_gpu_through_forwards_and_backwards(
        tmp_path, megatron_rank):
    """On the GPU, the colocated default (optimizer_offload): torch's Adam runs fused (no
    temporary the size of the fp32 parameters), its state (step counts included) is off the
    device at every forward after the first step, and the three steps match a worker that
    keeps it (bf16 kernels: to 1e-2 of the metrics, to 1e-2 of each parameter)."""
    model_dir = make_tiny_model(tmp_path / "actor", arch="qwen3", seed=0, hidden_size=256,
                                intermediate_size=512, num_hidden_layers=2)
    kept = _worker_two_updates(model_dir, offload=False)
    from megarl.megatron.parallel import destroy_parallel

    destroy_parallel()
    moved = _worker_two_updates(model_dir, offload=True)
    assert kept["fused"] and all(kept["fused"]) and all(moved["fused"])
    after_first = [s for s in moved["seen"] if s]
    assert after_first and all(n == 0 for s in after_first for n in s), moved["seen"]
    assert all(n > 0 for s in kept["seen"] if s for n in s)
    for ref, got in zip(kept["metrics"], moved["metrics"]):
        assert got["actor/update_skipped"] == ref["actor/update_skipped"] == 0.0
        assert got["actor/grad_norm"] == pytest.approx(ref["actor/grad_norm"], rel=1e-2)
    for ref, got in zip(kept["params"], moved["params"]):
        torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2)


def test_a_streamed_optimizer_step_on_the_gpu_matches_the_whole_one(tmp_path, megatron_rank):
    """``offload.optimizer_step_chunk_mb`` on the GPU: the moments come in on one CUDA stream
    and go out on another while the chunks are updated; the three steps equal those of the
    unstreamed offload (to 1e-2, as the kept state above; bit for bit on the CPU), at most three
    chunks of moments were on the device, and after the step none is."""
    model_dir = make_tiny_model(tmp_path / "actor", arch="qwen3", seed=0, hidden_size=256,
                                intermediate_size=512, num_hidden_layers=2)
    whole = _worker_two_updates(model_dir, offload=True)
    from megarl.megatron.parallel import destroy_parallel

    destroy_parallel()
    chunk = 256 << 10
    streamed = _worker_two_updates(model_dir, offload=True, stream_bytes=chunk)
    info = streamed["streamed"]
    assert info["chunks"] >= 3 and 0 < info["peak"] <= 3 * max(chunk, info["largest"]), info
    moments = [n for n in info["after_step"] if n > 8]  # the step counts are 4-8 bytes
    assert not moments, info["after_step"]
    for ref, got in zip(whole["metrics"], streamed["metrics"]):
        assert got["actor/update_skipped"] == ref["actor/update_skipped"] == 0.0
        assert got["actor/grad_norm"] == pytest.approx(ref["actor/grad_norm"], rel=1e-2)
    for ref, got in zip(whole["params"], streamed["params"]):
        torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2)
    # Adam's moments after three steps carry all three gradients: a chunk that came in empty or
    # stale (a copy not waited for) would be off by far more than the kernels' noise
    ref_m, got_m = whole["streamed"]["moments"], info["moments"]
    assert len(ref_m) == len(got_m) > 0
    for ref, got in zip(ref_m, got_m):
        torch.testing.assert_close(got, ref, rtol=0.05, atol=1e-3 * float(ref.abs().max()))
