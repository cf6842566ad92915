"""The embedded engine's checkpoint endpoint in process: generation is held during an update.

A real :class:`LocalEngine` on a tiny Qwen3-MoE and the endpoint behind ``POST /megarl/weights``
receive updates over ``ipc`` from a :class:`WeightSender` in this process. Requests that arrive
during an update wait and finish on the new weights with the new ``weight_version``; a rejected
plan does not hold generation; a pause set by the trainer is left to the trainer.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from megarl.data.tiny_model import make_tiny_model
from megarl.rollout.interface import SamplingParams
from megarl.rollout.local.checkpoint_engine import CheckpointEndpoint
from megarl.rollout.local.engine import LocalEngine, Request
from megarl.rollout.local.model_runner import ModelRunner
from megarl.rollout.local.weight_updates import WeightReceiver
from megarl.rollout.local.weights import iter_safetensors
from megarl.weights import UpdateRejected, WeightSender
from megarl.weights.transports import IpcSender

GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)


class RecordingLink:
    """An in-process link to one endpoint that records whether generation was held when each
    message arrived, and can run a hook after a given op."""

    def __init__(self, endpoint: CheckpointEndpoint) -> None:
        self.endpoint = endpoint
        self.seen: list[tuple[str, bool]] = []
        self.after: dict[str, Any] = {}

    def __len__(self) -> int:
        """One engine."""
        return 1

    def post(self, messages: Sequence[dict[str, Any]]) -> Any:
        """Handle the message now; the result returns its reply."""
        op = messages[0]["op"]
        self.seen.append((op, self.endpoint.engine.paused))
        reply = self.endpoint.handle(dict(messages[0]))
        if op in self.after:
            self.after.pop(op)()
        return lambda: [reply]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalEngine, Path]]:
    """A running engine on a tiny Qwen3-MoE, and the model's directory."""
    model_dir = make_tiny_model(tmp_path_factory.mktemp("endpoint") / "moe", arch="qwen3_moe",
                                seed=2, with_tokenizer=False)
    local = LocalEngine(ModelRunner(model_dir), seed=0)
    local.start()
    yield local, model_dir
    local.shutdown()


def generate(engine: LocalEngine, prompt: list[int]) -> Any:
    """Submit one greedy request; its future."""
    return engine.submit(Request(rid=uuid.uuid4().hex, prompt_ids=prompt, params=GREEDY))


def test_update_holds_generation_and_requests_finish_on_the_new_weights(
        engine: tuple[LocalEngine, Path], tmp_path: Path) -> None:
    local, model_dir = engine
    endpoint = CheckpointEndpoint(local, WeightReceiver(local))
    link = RecordingLink(endpoint)
    sender = WeightSender(IpcSender(shm_dir=tmp_path), link, bucket_size_mb=0.05)
    sender.connect()
    state = {n: t.neg() for n, t in iter_safetensors(model_dir)}
    pending: list[Any] = []
    finished_early: list[bool] = []
    link.after["begin"] = lambda: pending.append(generate(local, [7, 8, 9]))
    link.after["bucket"] = lambda: finished_early.append(pending[0].done())
    try:
        report = sender.update(state, version="neg")
        done = pending[0].result(timeout=60)
        ops = [op for op, _ in link.seen]
        assert ops == ["connect", "begin"] + ["bucket"] * report.num_buckets + ["end"]
        assert all(held for op, held in link.seen if op in ("bucket", "end"))
        assert finished_early == [False]
        assert not local.paused and local.weight_version == "neg"
        assert done[0].weight_version == "neg"
        q_proj = "model.layers.0.self_attn.q_proj.weight"
        assert torch.equal(endpoint.protocol.receiver.loader.weights.view(q_proj), state[q_proj])

        bad = dict(state, **{q_proj: torch.zeros(2, 2)})
        with pytest.raises(UpdateRejected, match=r"q_proj.weight: sent with shape \[2, 2\]"):
            sender.update(bad, version="bad")
        assert not local.paused and local.weight_version == "neg"

        local.pause("in_place").result()
        sender.update(state, version="held-by-trainer")
        assert local.paused and local.weight_version == "held-by-trainer"
        local.resume().result()
        assert generate(local, [7, 8, 9]).result(timeout=60)[0].output_ids == done[0].output_ids
    finally:
        sender.close()
