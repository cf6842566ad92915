"""Every transport, end to end: one sender (this process) and two engine processes.

A state dict of mixed dtypes and shapes (0-d, empty, int, bool, one tensor larger than a bucket)
is cast to bfloat16 on the way; the engines must hold exactly ``t.to(bfloat16)`` (bit for bit)
and agree on checksums. A mismatching update is rejected whole and the old weights stay.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from weights_harness import EnginePair

from megarl.weights import TensorSpec, UpdateRejected, WeightSender
from megarl.weights.transports import SENDERS, SenderTransport

pytestmark = pytest.mark.timeout(180)

BUCKET_MB = 1.0
WIRE = torch.bfloat16


def mixed_state(seed: int) -> dict[str, torch.Tensor]:
    """A small "model": float32/float16/float64/bf16 weights, ints, bools, 0-d and empty."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(64, 96, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(96, 96, generator=g),
        "model.layers.0.mlp.experts.gate_up_proj": torch.randn(640, 1024, generator=g),
        "model.layers.0.input_layernorm.weight": torch.randn(96, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.gate.e_score_correction_bias":
            torch.randn(17, generator=g).to(torch.float16),
        "model.rotary_emb.inv_freq": torch.rand(48, generator=g, dtype=torch.float64),
        "model.layers.0.mlp.gate.temperature": torch.rand((), generator=g),
        "model.step": torch.randint(0, 1 << 40, (), generator=g),
        "model.token_ids": torch.randint(-(1 << 30), 1 << 30, (11,), generator=g,
                                         dtype=torch.int32),
        "model.attention_mask": torch.rand(5, 3, generator=g) > 0.5,
        "model.empty": torch.empty(0, 4),
        "lm_head.weight": torch.randn(96, 64, generator=g),
    }


def on_wire(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the engines must hold: floating tensors cast to bfloat16, the rest unchanged."""
    return {n: t.to(WIRE) if t.is_floating_point() else t for n, t in state.items()}


def wire_specs(state: dict[str, torch.Tensor]) -> list[TensorSpec]:
    """The engines' tensor specs."""
    return [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in on_wire(state).items()]


def make_sender(kind: str, tmp_path: Path) -> SenderTransport:
    """A sender transport of ``kind`` on CPU (a stuck broadcast fails after 60 s, not 300)."""
    options = {"disk": {"root": tmp_path / "weights"}, "nccl": {"timeout_s": 60.0}}
    return SENDERS[kind](**options.get(kind, {}))


def assert_engines_hold(engines: EnginePair, expected: dict[str, torch.Tensor],
                        version: str) -> None:
    """Every engine holds exactly ``expected`` (bitwise) at ``version``."""
    for i, dump in enumerate(engines.dump()):
        assert dump["weight_version"] == version, f"engine {i}"
        assert dump["default_group_size"] == 1
        assert dump["state"].keys() == expected.keys()
        for name, tensor in expected.items():
            got = dump["state"][name]
            assert got.dtype == tensor.dtype and got.shape == tensor.shape, (i, name)
            assert torch.equal(got.view(-1).view(torch.uint8) if got.numel() else got,
                               tensor.view(-1).view(torch.uint8) if tensor.numel() else tensor), \
                (i, name)


def as_iterator(state: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """A plain generator of (name, tensor), like the Megatron exporter."""
    yield from state.items()


@pytest.mark.parametrize("kind", ["nccl", "nixl", "ipc", "disk"])
def test_transport_round_trip(kind: str, engines: EnginePair, tmp_path: Path) -> None:
    v1, v2 = mixed_state(1), mixed_state(2)
    engines.setup(wire_specs(v1))
    sender = WeightSender(make_sender(kind, tmp_path), engines.link, bucket_size_mb=BUCKET_MB,
                          dtype=WIRE)
    sender.connect()
    try:
        report = sender.update(v1, version="1", verify_checksums=True)
        bucket_bytes = int(BUCKET_MB * (1 << 20))
        plan = sender.plan(wire_specs(v1))
        big = [b for b in plan.buckets if b.nbytes > bucket_bytes]
        assert len(big) == 1 and big[0].names() == ["model.layers.0.mlp.experts.gate_up_proj"]
        assert report.num_buckets == len(plan.buckets) >= 3
        assert report.mismatches == {0: [], 1: []}
        assert len(report.sender_checksums) == len(v1)
        assert report.peak_buffer_bytes <= big[0].nbytes + bucket_bytes
        assert_engines_hold(engines, on_wire(v1), "1")

        # Engine 1's model differs from engine 0's: the update is rejected before any bucket
        # moves, so engine 0 (which accepted the plan) keeps v1 too, not a part of v2.
        q_proj = "model.layers.0.self_attn.q_proj.weight"
        engines.setup([s._replace(shape=(48, 192)) if s.name == q_proj else s
                       for s in wire_specs(v1)], engine=1)
        with pytest.raises(UpdateRejected, match=r"failed on 1 of 2 engines: engine 1: .*q_proj"
                                                 r".weight: sent with shape \[96, 96\], the "
                                                 r"receiving model has \[48, 192\]"):
            sender.update(v2, version="2")
        dumps = engines.dump()
        assert all(torch.equal(dumps[0]["state"][n], t) for n, t in on_wire(v1).items())
        assert not dumps[1]["state"][q_proj].any()
        engines.setup(wire_specs(v1), engine=1)
        sender.update(v1, version="1")

        reshaped = dict(v2, **{q_proj: torch.randn(48, 192)})
        with pytest.raises(UpdateRejected, match=r"q_proj.weight: sent with shape \[48, 192\]"):
            sender.update(reshaped, version="2")
        unknown = dict(v2, **{"model.layers.9.mlp.up_proj.weight": torch.randn(4, 4)})
        with pytest.raises(UpdateRejected, match="layers.9.mlp.up_proj.weight: the receiving"):
            sender.update(unknown, version="2")
        assert_engines_hold(engines, on_wire(v1), "1")

        sender.update(v2, version="2", specs=[TensorSpec(n, tuple(t.shape), t.dtype)
                                              for n, t in v2.items()])
        assert_engines_hold(engines, on_wire(v2), "2")
        report = sender.update(as_iterator(v1), version="3", verify_checksums=True)
        assert report.mismatches == {0: [], 1: []}
        assert_engines_hold(engines, on_wire(v1), "3")
    finally:
        sender.close()


def test_disk_directory_is_published_atomically(engines: EnginePair, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    state = mixed_state(3)
    engines.setup(wire_specs(state))
    root = tmp_path / "weights"
    sender = WeightSender(SENDERS["disk"](root=root), engines.link, bucket_size_mb=BUCKET_MB,
                          dtype=WIRE)
    sender.connect()
    try:
        for version in ("a", "b", "c"):
            sender.update(state, version=version)
    finally:
        sender.close()
    published = sorted(p.name for p in root.iterdir())
    assert len(published) == 2 and published[0].startswith("b-") and published[1].startswith("c-")
    latest = root / published[1]
    loaded: dict[str, torch.Tensor] = {}
    for shard in sorted(latest.glob("*.safetensors")):
        loaded.update(load_file(shard))
    expected = on_wire(state)
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[n], expected[n]) for n in expected)


def test_exporter_diverging_from_the_plan_aborts_and_the_next_update_works(
        engines: EnginePair, tmp_path: Path) -> None:
    v1, v2 = mixed_state(4), mixed_state(5)
    engines.setup(wire_specs(v1))
    sender = WeightSender(make_sender("ipc", tmp_path), engines.link, bucket_size_mb=BUCKET_MB,
                          dtype=WIRE)
    sender.connect()
    try:
        with pytest.raises(ValueError, match="the first update from an iterator needs specs"):
            sender.update(as_iterator(v1), version="0")
        sender.update(v1, version="1")

        def diverging() -> Iterator[tuple[str, torch.Tensor]]:
            for i, (name, tensor) in enumerate(v2.items()):
                yield (name, tensor) if i < 8 else ("model.surprise", tensor)

        with pytest.raises(ValueError, match="model.surprise with shape .* arrived where the "
                                             "plan expects model.token_ids"):
            sender.update(diverging(), version="2")
        assert [d["weight_version"] for d in engines.dump(["-"])] == ["1", "1"]
        report = sender.update(as_iterator(v2), version="3", verify_checksums=True)
        assert report.mismatches == {0: [], 1: []}
        assert_engines_hold(engines, on_wire(v2), "3")
    finally:
        sender.close()
