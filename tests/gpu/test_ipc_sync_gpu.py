"""The colocated transport alone on the GPU: a ~0.8 GB bf16 model streamed as CUDA IPC handles of
flattened buckets into an embedded engine on the same GPU, bit-exact.

SGLang's checker flow, as RL stacks use it: the engine loads the model from disk, snapshots
every tensor, overwrites them all with random values, receives the model from this process
(playing the one train rank) over ``/update_weights_from_tensor``, and compares every tensor
with the snapshot.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
import torch.distributed as dist

from megarl.data.tiny_model import make_tiny_model
from megarl.net import free_port
from megarl.rollout.local.launch import launch_local_engines
from megarl.rollout.local.weights import iter_safetensors
from megarl.rollout.sglang.client import SGLangClient
from megarl.weights.sglang_sender import ColocatedSender, plan_buckets

SIZE = {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
        "num_key_value_heads": 4, "head_dim": 64, "intermediate_size": 4096, "vocab_size": 32000}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("ipc") / "model", arch="qwen3",
                           with_tokenizer=False, **SIZE)


def checker(url: str, *actions: str) -> list[tuple[bool, str]]:
    async def run():
        client = SGLangClient([url])
        try:
            return [(await client.check_weights(a))[0] for a in actions]
        finally:
            await client.close()

    return asyncio.run(run())


def one_buffer(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The tensors as views of one contiguous buffer in reverse order (DDP's parameter layout),
    q/k/v as tensors of their own (mbridge's QKV split copies them)."""
    qkv = ("q_proj.weight", "k_proj.weight", "v_proj.weight")
    rest = [(n, t) for n, t in named if not n.endswith(qkv)]
    buffer = torch.empty(sum(t.numel() for _, t in rest), dtype=torch.bfloat16, device="cuda")
    views, end = {}, buffer.numel()
    for name, tensor in reversed(rest):
        end -= tensor.numel()
        views[name] = buffer[end:end + tensor.numel()].view(tensor.shape).copy_(tensor)
    return [(n, views.get(n, t)) for n, t in named]


@pytest.mark.parametrize("layout", ["separate", "one_buffer"])
def test_a_large_model_arrives_bit_exact_over_cuda_ipc(model_dir, tmp_path, layout):
    (server,) = launch_local_engines(str(model_dir), 1, device="cuda", log_dir=tmp_path,
                                     extra_args=["--dtype", "bfloat16"], ready_timeout_s=300)
    port = free_port()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        snapshot, reset = checker(server.url, "snapshot", "reset_tensors")
        assert snapshot[0] and reset[0]
        assert not checker(server.url, "compare")[0][0]  # the reset really changed them
        named = [(n, t.to("cuda", torch.bfloat16)) for n, t in iter_safetensors(model_dir)]
        if layout == "one_buffer":
            named = one_buffer(named)
        total = sum(t.numel() * 2 for _, t in named)
        assert total > 0.7e9
        plan = plan_buckets([(n, list(t.shape)) for n, t in named], "bfloat16", 256)
        sender = ColocatedSender(0, 1, [server.url], 1, zero_copy=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        sent = sender.send(iter(named), plan, torch.device("cuda"), "ipc-1")
        seconds = time.perf_counter() - start
        sender.close()
        assert sent == total
        # views of one buffer go without a copy, q/k/v packed beside them
        assert (sender.posts["zero_copy"] > 0) == (layout == "one_buffer"), sender.posts
        ok, message = checker(server.url, "compare")[0]
        assert ok, message
        print(f"{layout}: {total / 1e9:.2f} GB in {len(plan)} buckets: {seconds:.2f} s, "
              f"{total / seconds / 1e9:.1f} GB/s")
    finally:
        dist.destroy_process_group()
        server.stop()



def test_the_engine_replays_the_views_it_kept_over_cuda_ipc(model_dir, tmp_path):
    """The persistent colocated sync on the GPU: the first sync registers the buffer's views
    (the engine keeps the CUDA IPC mapping) and a buffer of the q/k/v; later syncs refill that
    buffer and post one replay.
    The model doubled in place reaches the engine (the checker's compare fails); halved again
    it compares equal to the snapshot, bit for bit."""
    from megarl.weights.sglang_sender import Persist

    (server,) = launch_local_engines(str(model_dir), 1, device="cuda", log_dir=tmp_path,
                                     extra_args=["--dtype", "bfloat16"], ready_timeout_s=300)
    try:
        snapshot, reset = checker(server.url, "snapshot", "reset_tensors")
        assert snapshot[0] and reset[0]
        named = one_buffer([(n, t.to("cuda", torch.bfloat16))
                            for n, t in iter_safetensors(model_dir)])
        qkv = [(n, t) for n, t in named
               if n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight"))]
        storage = next(t for n, t in named if n.endswith("norm.weight")).untyped_storage()
        buffer = torch.empty(0, dtype=torch.bfloat16, device="cuda").set_(
            storage, 0, (storage.nbytes() // 2,), (1,))
        token = (storage.data_ptr(), storage.nbytes())
        persist = Persist(token, frozenset([token]), tuple(n for n, _ in qkv), lambda: iter(qkv))
        plan = plan_buckets([(n, list(t.shape)) for n, t in named], "bfloat16", 256)
        sender = ColocatedSender(0, 1, [server.url], 1)
        assert sender.persistent_engine()
        outcomes, posts = [], []
        for version, scale in (("p-1", 1.0), ("p-2", 2.0), ("p-3", 0.5)):
            with torch.no_grad():  # an update: every tensor changes in place
                buffer.mul_(scale)
                for _, tensor in qkv:
                    tensor.mul_(scale)
            sender.send(iter(named), plan, torch.device("cuda"), version, persist=persist)
            posts.append(dict(sender.posts))
            outcomes.append(checker(server.url, "compare")[0][0])
        sender.close()
        assert outcomes == [True, False, True], (outcomes, posts)
        assert posts[0]["zero_copy"] > 0 and posts[0]["replayed"] == 0, posts
        assert [p["replayed"] for p in posts[1:]] == [1, 1], posts
        assert all(p["zero_copy"] == 0 and p["packed"] == 0 for p in posts[1:]), posts
    finally:
        server.stop()
