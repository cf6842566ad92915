"""megarl's checkpoint-engine protocol in the embedded server (``POST /megarl/weights``).

The trainer's :class:`~megarl.weights.WeightSender` posts one control message per request
(``connect`` / ``begin`` / ``bucket`` / ``load`` / ``end`` / ``abort`` / ``close``, see
:mod:`megarl.weights.update`) and the bytes follow over the chosen transport (``nccl``: gloo on
CPU, ``nixl``, ``ipc``, ``disk``). The server answers every message with ``{"ok": ...}``.

- ``begin`` checks every announced tensor against the live model (the name exists under its
  checkpoint name, shape and dtype match) before any byte moves; a rejected plan leaves the old
  weights serving. An accepted plan pauses generation in place (unless the trainer already
  paused it), so no forward runs on a mix of old and new weights; ``end`` and ``abort`` resume it.
- Each bucket is copied into the model on the engine thread (:meth:`LocalEngine.call`), between
  generation steps, through the :class:`~megarl.rollout.local.weights.WeightMap` views (per-expert
  checkpoint names land in the fused expert parameters).
- ``end`` stamps the engine's ``weight_version`` (what ``/model_info`` and every later
  sample report) and, when asked, returns a checksum of every received tensor.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import torch

from megarl.rollout.local.engine import LocalEngine
from megarl.rollout.local.weight_updates import WeightReceiver as WeightLoader
from megarl.rollout.local.weights import UnknownWeight
from megarl.weights import BucketMeta, WeightMismatch, WeightUpdateEndpoint, dtype_name
from megarl.weights.checksums import tensor_checksum


class EngineWeightReceiver:
    """A :class:`megarl.weights.WeightReceiver` over the embedded engine's live model."""

    def __init__(self, loader: WeightLoader) -> None:
        self.loader = loader

    def check(self, meta: BucketMeta) -> None:
        """Raise :class:`WeightMismatch` for the first tensor of ``meta`` that does not fit."""
        weights = self.loader.weights
        for slot in meta.tensors:
            try:
                target = weights.view(slot.name)
            except UnknownWeight:
                raise WeightMismatch(
                    f"weight {slot.name}: the engine's model has no tensor of that name (it has "
                    f"e.g. {weights.checkpoint_names()[:3]}); check the exporter's HF name "
                    "mapping and that trainer and engine serve the same architecture") from None
            if tuple(target.shape) != slot.shape:
                raise WeightMismatch(
                    f"weight {slot.name}: sent with shape {list(slot.shape)}, the engine's model "
                    f"has {list(target.shape)}; the trainer and the rollout engine were built "
                    "from different model configs")
            if target.dtype != slot.dtype:
                raise WeightMismatch(
                    f"weight {slot.name}: sent as {dtype_name(slot.dtype)}, the engine holds "
                    f"{dtype_name(target.dtype)}; set the sender's dtype (rollout.dtype) to "
                    f"{dtype_name(target.dtype)}")

    def apply(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy a bucket into the model on the engine thread; returns once it is in place."""
        named = list(named_tensors)
        self.loader.engine.call(lambda: self.loader.weights.load_many(named)).result()

    def checksums(self, names: Iterable[str] | None = None) -> dict[str, str]:
        """``{checkpoint name: tensor_checksum}`` of the live weights (all when ``names`` is
        None), read on the engine thread."""
        weights = self.loader.weights
        selected = list(weights.checkpoint_names() if names is None else names)
        return self.loader.engine.call(
            lambda: {name: tensor_checksum(weights.view(name)) for name in selected}).result()


class CheckpointEndpoint:
    """The embedded engine's half of a megarl weight update: one control message, one reply."""

    def __init__(self, engine: LocalEngine, loader: WeightLoader) -> None:
        self.engine = engine
        self.protocol = WeightUpdateEndpoint(EngineWeightReceiver(loader), engine.runner.device)
        self._lock = threading.Lock()
        self._paused_here = False

    def handle(self, message: dict[str, Any]) -> dict[str, Any]:
        """Run one control message (blocking: transfers happen here); never raises."""
        op = message.get("op")
        with self._lock:
            reply = self.protocol.handle(message)
            if op == "begin" and reply["ok"]:
                self._pause()
            elif op == "end" and reply["ok"]:
                self._finish(str(message["version"]))
            elif op in ("end", "abort") or (op == "begin" and not reply["ok"]):
                self._resume()
        return reply

    def _pause(self) -> None:
        """Hold generation in place for the update, unless someone else already paused it."""
        if not self._paused_here and not self.engine.paused:
            self.engine.pause("in_place").result()
            self._paused_here = True

    def _finish(self, version: str) -> None:
        """Stamp the new weight version while generation is still held, then resume."""
        def stamp() -> None:
            self.engine.weight_version = version

        self.engine.call(stamp).result()
        self._resume()

    def _resume(self) -> None:
        if self._paused_here:
            self.engine.resume().result()
            self._paused_here = False
