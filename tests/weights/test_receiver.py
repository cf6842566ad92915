"""Checksums, the state-dict receiver, and the engine endpoint's protocol checks (in process)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from torch import nn

from megarl.weights import (
    BucketPlan,
    StateDictReceiver,
    WeightMismatch,
    WeightUpdateEndpoint,
    checksums,
    pack,
    specs_of,
    tensor_checksum,
    verify,
)
from megarl.weights.transports import IpcSender


def test_checksum_is_sha256_of_the_raw_bytes() -> None:
    t = torch.randn(3, 4).to(torch.bfloat16)
    expected = hashlib.sha256(t.view(torch.int16).numpy().tobytes()).hexdigest()
    assert tensor_checksum(t) == f"bfloat16[3,4]:{expected}"
    scalar = torch.tensor(7, dtype=torch.int64)
    assert tensor_checksum(scalar).endswith(hashlib.sha256((7).to_bytes(8, "little")).hexdigest())
    # Same bytes as a non-contiguous view and as a copy; dtype or shape changes the checksum.
    assert tensor_checksum(t.t().contiguous().t()) == tensor_checksum(t)
    assert tensor_checksum(t.view(torch.float16)) != tensor_checksum(t)
    assert tensor_checksum(t.reshape(4, 3)) != tensor_checksum(t)


def test_verify_lists_differences_and_missing_tensors() -> None:
    a, b = torch.zeros(3), torch.ones(3)
    sent = checksums([("x", a), ("y", a), ("z", a)])
    got = checksums([("x", a), ("y", b), ("extra", a)])
    problems = verify(sent, got)
    assert len(problems) == 3
    assert problems[0].startswith("y: receiver has") and "z: sent but" in problems[1]
    assert "extra: the receiver reports it" in problems[2]
    assert verify(sent, sent) == []


@pytest.mark.parametrize(("sent", "message"), [
    ({"q": torch.ones(1)}, "weight q: the receiving model has no tensor"),
    ({"w": torch.ones(3, 2)},
     r"weight w: sent with shape \[3, 2\], the receiving model has \[2, 3\]"),
    ({"w": torch.ones(2, 3, dtype=torch.float64)},
     "weight w: sent as float64, the receiving model holds float32"),
], ids=["name", "shape", "dtype"])
def test_state_dict_receiver_checks_names_shapes_and_dtypes(sent: dict[str, torch.Tensor],
                                                            message: str) -> None:
    receiver = StateDictReceiver({"w": torch.zeros(2, 3), "n": torch.zeros(4, dtype=torch.int64)})
    receiver.check(BucketPlan.from_specs(specs_of({"w": torch.ones(2, 3)}), 1 << 10).buckets[0])
    meta = BucketPlan.from_specs(specs_of(sent), 1 << 10).buckets[0]
    with pytest.raises(WeightMismatch, match=message):
        receiver.check(meta)


def test_module_receiver_writes_parameters_in_place() -> None:
    model = nn.Linear(3, 2)
    weight = model.weight
    receiver = StateDictReceiver(model)
    assert receiver.names() == ["weight", "bias"]
    new = {"weight": torch.arange(6.0).view(2, 3), "bias": torch.tensor([5.0, 6.0])}
    receiver.apply(new.items())
    assert model.weight is weight and torch.equal(model.weight.detach(), new["weight"])
    assert receiver.checksums(["bias"]) == {"bias": tensor_checksum(new["bias"])}


def _endpoint_with_ipc(tmp_path: Path, state: dict[str, torch.Tensor]
                       ) -> tuple[WeightUpdateEndpoint, IpcSender]:
    target = {n: torch.zeros_like(t) for n, t in state.items()}
    endpoint = WeightUpdateEndpoint(StateDictReceiver(target))
    sender = IpcSender(shm_dir=tmp_path)
    assert endpoint.handle({"op": "connect", "transport": "ipc"})["ok"]
    return endpoint, sender


def test_endpoint_rejects_out_of_order_and_incomplete_updates(tmp_path: Path) -> None:
    state = {"a": torch.randn(8), "b": torch.randn(8)}
    endpoint, sender = _endpoint_with_ipc(tmp_path, state)
    plan = BucketPlan.from_specs(specs_of(state), 32)
    assert len(plan.buckets) == 2
    buffers = [sender.allocate(32) for _ in plan.buckets]
    items = iter(state.items())
    buckets = [pack(buf, meta, items) for buf, meta in zip(buffers, plan.buckets)]

    def bucket_message(i: int) -> dict:
        return {"op": "bucket", "meta": plan.buckets[i].to_json(),
                **sender.bucket_request(buckets[i])}

    assert "send 'begin' first" in endpoint.handle(bucket_message(0))["error"]
    assert endpoint.handle({"op": "begin", "plan": plan.to_json(), "version": "1"})["ok"]
    reply = endpoint.handle(bucket_message(1))
    assert not reply["ok"] and "bucket 1 arrived, the plan expects 0" in reply["error"]
    assert endpoint.handle({"op": "begin", "plan": plan.to_json(), "version": "1"})["ok"]
    assert endpoint.handle(bucket_message(0))["ok"]
    reply = endpoint.handle({"op": "end", "version": "1"})
    assert not reply["ok"] and "incomplete: 1 of 2 buckets" in reply["error"]
    assert endpoint.weight_version is None
    assert endpoint.handle({"op": "nope"})["error"].startswith("op 'nope' is not known")
    sender.close()
    assert list(tmp_path.iterdir()) == []


def test_ipc_buffers_are_shared_memory_not_copies(tmp_path: Path) -> None:
    from megarl.weights.transports import IpcReceiver

    sender = IpcSender(shm_dir=tmp_path)
    receiver = IpcReceiver({}, torch.device("cpu"))
    state = {"w": torch.zeros(4)}
    plan = BucketPlan.from_specs(specs_of(state), 1 << 10)
    buffer = sender.allocate(64)
    bucket = pack(buffer, plan.buckets[0], iter(state.items()))
    request = sender.bucket_request(bucket)
    assert Path(request["path"]).parent == tmp_path and set(request) == {"path", "size"}
    (name, view), = receiver.receive(plan.buckets[0], request)
    buffer[:16].view(torch.float32).fill_(3.0)  # written by the sender after the handover
    assert name == "w" and torch.equal(view, torch.full((4,), 3.0))
    receiver.close()
    sender.free(buffer)
    assert list(tmp_path.iterdir()) == []
