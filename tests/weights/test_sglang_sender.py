"""The trainer's half of SGLang's colocated update (``ColocatedSender``) against running
embedded engines, from two real train ranks over gloo.

The engines serve model A; the ranks send model B's tensors as if exported, in several
buckets. With one engine per rank each rank feeds its own engine; with one engine of two TP
ranks both ranks pack the bucket and the engine's first rank posts both entries (the engine,
TP rank 0, loads entry 0: rank 0's). Afterwards every tensor the engines hold equals what was
sent to them, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_on_ranks
from weights_harness import engine_tensors

from megarl.rollout.local.launch import launch_local_engines
from megarl.rollout.local.weights import iter_safetensors


def one_buffer(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The tensors as views of one contiguous buffer, laid out in reverse order as megatron's
    DDP lays out parameters; every fifth matrix is stored transposed and handed out as a
    non-contiguous view (a tensor the sender must pack)."""
    buffer = torch.empty(sum(t.numel() for _, t in named), dtype=named[0][1].dtype)
    out, end = {}, buffer.numel()
    for index, (name, tensor) in reversed(list(enumerate(named))):
        end -= tensor.numel()
        piece = buffer[end:end + tensor.numel()]
        if tensor.dim() == 2 and index % 5 == 0:
            piece.view(tensor.shape[1], tensor.shape[0]).copy_(tensor.t())
            out[name] = piece.view(tensor.shape[1], tensor.shape[0]).t()
        else:
            out[name] = piece.view(tensor.shape).copy_(tensor)
    return [(name, out[name]) for name, _ in named]


def send_on_rank(model_dir: str, urls: list[str], gpus_per_engine: int, scale: float,
                 bucket_mb: float | None, in_one_buffer: bool = False) -> tuple[int, dict]:
    """Rank r sends model ``model_dir``'s tensors times ``scale ** r`` to its engine (from one
    shared buffer: ``in_one_buffer``; ``bucket_mb`` None: a third of the model)."""
    import torch.distributed as dist

    from megarl.weights.sglang_sender import ColocatedSender, plan_buckets

    rank = dist.get_rank()
    named = [(n, t * scale ** rank) for n, t in iter_safetensors(model_dir)]
    if in_one_buffer:
        named = one_buffer(named)
    if bucket_mb is None:
        bucket_mb = sum(t.numel() * t.element_size() for _, t in named) / 3 / 2**20
    plan = plan_buckets([(n, list(t.shape)) for n, t in named], "float32", bucket_mb)
    assert len(plan) >= 3  # several buckets, so two buffers take turns
    sender = ColocatedSender(rank, dist.get_world_size(), urls, gpus_per_engine, zero_copy=True)
    try:
        return sender.send(iter(named), plan, torch.device("cpu"), "v7"), sender.posts
    finally:
        sender.close()


@pytest.fixture(scope="module")
def servers(models, tmp_path_factory):
    started = launch_local_engines(str(models[0]), 2, num_threads=1,
                                   log_dir=tmp_path_factory.mktemp("logs"), ready_timeout_s=120)
    yield started
    for server in started:
        server.stop()


@pytest.mark.parametrize("gpus_per_engine,in_one_buffer", [(1, False), (2, False), (1, True),
                                                            (2, True)])
def test_colocated_sender_feeds_each_engine_its_ranks_tensors(models, servers, gpus_per_engine,
                                                              in_one_buffer):
    _, b_dir = models
    urls = [s.url for s in servers][:2 // gpus_per_engine]
    bucket_mb = None if in_one_buffer else 0.002
    results = run_on_ranks(2, send_on_rank, str(b_dir), urls, gpus_per_engine, 0.5, bucket_mb,
                           in_one_buffer)
    expected = list(iter_safetensors(b_dir))
    total = sum(t.numel() * 4 for _, t in expected)
    assert [sent for sent, _ in results] == [total, total]
    for _, posts in results:
        # tensors sharing one buffer go as views of it, the transposed ones packed beside;
        # an engine of two TP ranks gets packed buckets only (the ranks' posts must match)
        zero_copy = in_one_buffer and gpus_per_engine == 1
        assert (posts["zero_copy"] >= 2) == zero_copy and posts["packed"] >= 3, posts
    for engine, url in enumerate(urls):
        # engine e is fed by rank e (one GPU each) or by rank 0 (entry 0 of two TP ranks)
        scale = 0.5 ** (engine if gpus_per_engine == 1 else 0)
        held, version = engine_tensors(url, [n for n, _ in expected])
        assert version == "v7"
        for name, tensor in expected:
            assert torch.equal(held[name], tensor * scale), name


def test_a_stale_plan_fails_on_every_rank(models, servers):
    _, b_dir = models

    with pytest.raises(RuntimeError, match="the plan is stale"):
        run_on_ranks(2, send_stale_plan, str(b_dir), [servers[0].url, servers[1].url])


def send_stale_plan(model_dir: str, urls: list[str]) -> int:
    """A plan that lists one tensor more than the export yields."""
    import torch.distributed as dist

    from megarl.weights.sglang_sender import ColocatedSender, plan_buckets

    named = list(iter_safetensors(model_dir))
    plan = plan_buckets([(n, list(t.shape)) for n, t in named] + [("extra.weight", [2])],
                        "float32", 1)
    sender = ColocatedSender(dist.get_rank(), 2, urls, 1)
    try:
        return sender.send(iter(named), plan, torch.device("cpu"), "stale")
    finally:
        sender.close()


def send_fp8_on_rank(model_dir: str, urls: list[str]) -> int:
    """One rank sends model ``model_dir``'s tensors to an FP8 engine, quantized by the plan."""
    import torch.distributed as dist

    from megarl.weights.sglang_sender import ColocatedSender, plan_buckets

    named = list(iter_safetensors(model_dir))
    plan = plan_buckets([(n, list(t.shape)) for n, t in named], "float32", 0.002,
                        quantization="fp8")
    assert len(plan) >= 3
    sender = ColocatedSender(dist.get_rank(), 1, urls, 1)
    try:
        return sender.send(iter(named), plan, torch.device("cpu"), "fp8-1")
    finally:
        sender.close()


def test_an_fp8_engine_receives_the_blockwise_quantization_of_what_was_sent(
        models, tmp_path_factory):
    """rollout.quantization=fp8 over the colocated path: the engine (``--quantization fp8``)
    then holds, bit for bit, ``quantize_blockwise`` of every projection the plan quantizes,
    with its scale, and every other tensor in fp32; the bytes sent are those fp8 + fp32 ones."""
    from megarl.weights.fp8 import is_quantized_weight, quantize_blockwise, scale_name

    a_dir, b_dir = models
    engine = launch_local_engines(str(a_dir), 1, num_threads=1, extra_args=[
        "--quantization", "fp8"], log_dir=tmp_path_factory.mktemp("fp8_logs"),
        ready_timeout_s=120)[0]
    try:
        sent = run_on_ranks(1, send_fp8_on_rank, str(b_dir), [engine.url])[0]
        expected = {}
        for name, tensor in iter_safetensors(b_dir):
            if is_quantized_weight(name, tensor):
                weight, scale = quantize_blockwise(tensor)
                expected[name], expected[scale_name(name)] = weight.float(), scale
            else:
                expected[name] = tensor
        held, version = engine_tensors(engine.url, list(expected))
    finally:
        engine.stop()
    assert version == "fp8-1"
    quantized = [n for n in expected if n.endswith("_scale_inv")]
    assert any(".experts." in n for n in quantized) and any("q_proj" in n for n in quantized)
    assert sent == sum(t.numel() * (1 if n in {q.removesuffix("_scale_inv") for q in quantized}
                                    else 4) for n, t in expected.items())
    for name, tensor in expected.items():
        assert torch.equal(held[name], tensor), name


def send_packed_three_times(model_dir: str, urls: list[str]) -> list[int]:
    """One packing sender, three syncs of model ``model_dir``'s tensors (x1, x2, x3): the
    second changes the plan (other buckets), the third repeats it; the layouts built each."""
    import torch.distributed as dist

    from megarl.weights.sglang_sender import ColocatedSender, plan_buckets

    named = list(iter_safetensors(model_dir))
    specs = [(n, list(t.shape)) for n, t in named]
    sender = ColocatedSender(dist.get_rank(), 1, urls, 1)
    builds = []
    try:
        for scale, bucket_mb in ((1.0, 0.002), (2.0, 1.0), (3.0, 1.0)):
            plan = plan_buckets(specs, "float32", bucket_mb)
            sender.send(iter([(n, t * scale) for n, t in named]), plan, torch.device("cpu"),
                        f"x{scale:g}")
            builds.append(sender.layouts.builds)
    finally:
        sender.close()
    return builds


def test_the_packing_sender_reuses_its_layouts_only_for_an_unchanged_plan(models, servers):
    """Packed buckets (the default): every sync leaves the engine holding exactly what was
    sent, after a plan change as before it."""
    _, b_dir = models
    builds = run_on_ranks(1, send_packed_three_times, str(b_dir), [servers[0].url])[0]
    assert builds == [1, 2, 2]
    expected = list(iter_safetensors(b_dir))
    held, version = engine_tensors(servers[0].url, [n for n, _ in expected])
    assert version == "x3"
    for name, tensor in expected:
        assert torch.equal(held[name], tensor * 3.0), name
