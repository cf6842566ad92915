"""The persistent colocated sync (``ColocatedSender.send(persist=...)`` and the embedded engine's
``megarl_keep`` / ``megarl_replay`` programs) against a running embedded engine on the CPU.

The "actor" holds model B's tensors as views of one buffer (as megatron's DDP does), a few of
them transposed (views the sender must pack) and a few made afresh at every export (as mbridge's
QKV split is). The first sync registers the buffer's views with the engine; on the CPU that moves
the buffer to shared memory, so its storage pointer changes and the next sync registers again;
from then on a sync packs only the fresh tensors, into a buffer the engine kept too, and posts
one replay without payload; the engine reads both buffers where they lie. The buffer changes in
place between syncs (as an optimizer step does), and after every sync each tensor the engine
holds equals the actor's, bit for bit.
"""

from __future__ import annotations

import functools
from pathlib import Path

import httpx
import pytest
import torch
from weights_harness import engine_tensors

from megarl.rollout.local.launch import launch_local_engines
from megarl.rollout.local.weights import iter_safetensors
from megarl.weights.flattened import FLATTENED_BUCKET, serialize, view_payload
from megarl.weights.sglang_sender import (
    EMBEDDED_VERSION,
    KEEP_FIELD,
    REPLAY_FIELD,
    ColocatedSender,
    Persist,
    plan_buckets,
)

FRESH = ("self_attn.q_proj.weight", "self_attn.k_proj.weight")
"""Suffixes of the tensors this test's export makes afresh at every sync (a split QKV)."""


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    (started,) = launch_local_engines(str(models[0]), 1, num_threads=1,
                                      log_dir=tmp_path_factory.mktemp("logs"),
                                      ready_timeout_s=120)
    yield started
    started.stop()


class Actor:
    """Model B's tensors in one buffer (reverse order), every seventh matrix transposed; the
    :data:`FRESH` tensors are cloned from the buffer at every export."""

    def __init__(self, model_dir: Path) -> None:
        named = list(iter_safetensors(model_dir))
        self.names = [n for n, _ in named]
        self.buffer = torch.empty(sum(t.numel() for _, t in named), dtype=torch.float32)
        self.views: dict[str, torch.Tensor] = {}
        end = self.buffer.numel()
        for index, (name, tensor) in reversed(list(enumerate(named))):
            end -= tensor.numel()
            piece = self.buffer[end:end + tensor.numel()]
            if tensor.dim() == 2 and index % 7 == 0:
                piece.view(tensor.shape[1], tensor.shape[0]).copy_(tensor.t())
                self.views[name] = piece.view(tensor.shape[1], tensor.shape[0]).t()
            else:
                self.views[name] = piece.view(tensor.shape).copy_(tensor)
        self.fresh = [n for n in self.names if n.endswith(FRESH)]
        assert self.fresh and any(not t.is_contiguous() for t in self.views.values())
        self.exports = 0

    def export(self, copies_only: bool = False):
        self.exports += 1
        for name in self.names:
            if name in self.fresh:
                yield name, self.views[name].clone()
            elif not copies_only:
                yield name, self.views[name]

    def copies(self) -> tuple[str, ...]:
        """What the sender must pack: the fresh tensors and the transposed views."""
        return tuple(n for n in self.names
                     if n in self.fresh or not self.views[n].is_contiguous())

    def persist(self) -> Persist:
        storage = self.buffer.untyped_storage()
        token = (storage.data_ptr(), storage.nbytes())
        return Persist(token, frozenset([token]), self.copies(),
                       lambda: ((n, t) for n, t in self.export() if n in self.copies()))

    def expected(self) -> dict[str, torch.Tensor]:
        return {n: self.views[n].clone() for n in self.names}


def assert_engine_holds(url: str, actor: Actor, version: str) -> None:
    values, got = engine_tensors(url, actor.names)
    assert got == version
    for name, tensor in actor.expected().items():
        assert torch.equal(values[name], tensor), name


def test_a_persistent_sync_replays_the_kept_views_and_packs_only_fresh_tensors(models, server):
    actor = Actor(models[1])
    assert httpx.get(f"{server.url}/get_server_info").json()["version"] == EMBEDDED_VERSION
    nbytes = sum(t.numel() * 4 for t in actor.views.values())
    plan = plan_buckets([(n, list(actor.views[n].shape)) for n in actor.names], "float32",
                        nbytes / 3 / 2**20)
    sender = ColocatedSender(0, 1, [server.url], 1)
    assert sender.persistent_engine()
    posts = []
    try:
        for step in range(5):
            actor.buffer.mul_(0.5).add_(0.25)  # the optimizer's in-place step
            sent = sender.send(actor.export(), plan, torch.device("cpu"), f"v{step}",
                               persist=actor.persist())
            assert sent == nbytes
            posts.append(dict(sender.posts))
            assert_engine_holds(server.url, actor, f"v{step}")
        # step 0 registers (and moves the buffer to shared memory: its pointer changes), step 1
        # registers that memory, then each sync is one replay post with the packed tensors
        assert actor.buffer.untyped_storage().is_shared()
        assert [p["replayed"] for p in posts] == [0, 0, 1, 1, 1], posts
        assert all(p["zero_copy"] >= 1 for p in posts[:2]), posts
        assert all(p["zero_copy"] == 0 and p["packed"] == 0 for p in posts[2:]), posts

        # another program's registration drops this one (a restarted sender, say): the next
        # replay is refused as not held, and the sender registers again in the same sync
        group = [(n, actor.views[n]) for n in actor.names[:3]
                 if actor.views[n].is_contiguous()]
        body = {"serialized_named_tensors": [serialize(view_payload(group), share_cpu=True)],
                "load_format": FLATTENED_BUCKET, KEEP_FIELD: {"program": "other", "part": 0}}
        assert httpx.post(f"{server.url}/update_weights_from_tensor", json=body).json()["success"]
        actor.buffer.mul_(0.5)
        sender.send(actor.export(), plan, torch.device("cpu"), "v9", persist=actor.persist())
        assert sender.posts["zero_copy"] >= 1 and sender.posts["replayed"] == 0, sender.posts
        assert_engine_holds(server.url, actor, "v9")
        sender.send(actor.export(), plan, torch.device("cpu"), "v10", persist=actor.persist())
        assert sender.posts["replayed"] == 1, sender.posts
        assert_engine_holds(server.url, actor, "v10")
    finally:
        sender.close()


def test_an_export_whose_fresh_tensors_differ_is_sent_without_a_program(models, server):
    """Persist naming fewer fresh tensors than the export makes: the registered program would
    hold a tensor the export makes afresh, so the sender keeps none and packs every sync."""
    actor = Actor(models[1])
    plan = plan_buckets([(n, list(actor.views[n].shape)) for n in actor.names], "float32", 1)
    sender = ColocatedSender(0, 1, [server.url], 1)
    wrong = Persist(("t",), frozenset([(actor.buffer.untyped_storage().data_ptr(),
                                        actor.buffer.untyped_storage().nbytes())]),
                    actor.copies()[1:], lambda: iter(()))
    try:
        for step in range(3):
            actor.buffer.add_(1.0)
            sender.send(actor.export(), plan, torch.device("cpu"), f"w{step}", persist=wrong)
            assert sender.posts["replayed"] == 0
            assert_engine_holds(server.url, actor, f"w{step}")
        assert sender._program is None
    finally:
        sender.close()


@pytest.mark.parametrize("case", ["inline", "gap", "format", "mark", "unknown"])
def test_the_engine_refuses_what_it_cannot_keep_or_replay(models, server, case):
    actor = Actor(models[1])
    group = [(n, actor.views[n]) for n in actor.names[:3] if actor.views[n].is_contiguous()]
    payload = view_payload(group)
    body = {"serialized_named_tensors": [serialize(payload, share_cpu=case != "inline")],
            "load_format": FLATTENED_BUCKET, KEEP_FIELD: {"program": "p", "part": 0}}
    expected = {"inline": "only a payload in the sender's memory",
                "gap": "part 3 of 'p' follows 0 kept parts",
                "format": "need load_format flattened_bucket",
                "mark": "must be {'program': str, 'part': int}",
                "unknown": "program 'nope' is not held"}[case]
    if case == "gap":
        body[KEEP_FIELD] = {"program": "p", "part": 3}
    elif case == "format":
        body["load_format"] = None
    elif case == "mark":
        body[KEEP_FIELD] = {"program": "p", "part": True}
    elif case == "unknown":
        body = {"serialized_named_tensors": [], "load_format": FLATTENED_BUCKET,
                REPLAY_FIELD: "nope"}
    reply = httpx.post(f"{server.url}/update_weights_from_tensor", json=body).json()
    assert reply["success"] is False and expected in reply["message"], reply


def test_a_shared_storage_is_rebuilt_again_when_the_shm_manager_times_out(monkeypatch):
    """torch's shared-memory manager answers a rebuild within 1 s or the connection "has timed
    out": on a loaded machine the engine tries again (it failed CI once this way); any other
    error is raised at once."""
    from torch.multiprocessing import reductions

    from megarl.weights.flattened import SHM_MANAGER_ATTEMPTS, deserialize

    original, calls = reductions.rebuild_storage_filename, []

    def flaky(*args, fail: int, error: str = "Shared memory manager connection has timed out"):
        calls.append(1)
        if len(calls) <= fail:
            raise RuntimeError(error)
        return original(*args)

    data = torch.arange(64, dtype=torch.uint8)
    sent = [serialize(data.clone(), share_cpu=True) for _ in range(3)]  # before the patches
    monkeypatch.setattr(reductions, "rebuild_storage_filename", functools.partial(flaky, fail=2))
    assert torch.equal(deserialize(sent[0]), data)
    assert len(calls) == 3
    calls.clear()
    monkeypatch.setattr(reductions, "rebuild_storage_filename",
                        functools.partial(flaky, fail=SHM_MANAGER_ATTEMPTS))
    with pytest.raises(RuntimeError, match="timed out"):
        deserialize(sent[1])
    assert len(calls) == SHM_MANAGER_ATTEMPTS
    calls.clear()
    monkeypatch.setattr(reductions, "rebuild_storage_filename",
                        functools.partial(flaky, fail=1, error="another failure"))
    with pytest.raises(RuntimeError, match="another failure"):
        deserialize(sent[2])
    assert len(calls) == 1
