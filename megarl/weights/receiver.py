"""The engine side of a weight update: what a rollout engine must offer to receive weights.

Validation happens before any weight is written. The sender announces the whole update (every
bucket's names, dtypes and shapes: the :class:`~megarl.weights.buckets.BucketPlan`) before the
first byte moves; the engine calls :meth:`WeightReceiver.check` on every bucket of it and rejects
the update if any raises, so a mismatch leaves all old weights in place. Only then do buckets
arrive, each applied in place as it lands, so the engine never holds more than one extra bucket
(no staging copy of the model). What this cannot guard against is a transport failure in the
middle of an update (a sender crash, a timeout): the weights are then partly new, the update is
reported as failed and the engine keeps its old ``weight_version`` until a full update succeeds.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from megarl.weights.buckets import BucketMeta, dtype_name
from megarl.weights.checksums import tensor_checksum


class WeightMismatch(ValueError):
    """An announced tensor does not fit the receiving model (unknown name, shape or dtype)."""


@runtime_checkable
class WeightReceiver(Protocol):
    """Where an engine's weights live, by HF (checkpoint) name."""

    def check(self, meta: BucketMeta) -> None:
        """Raise :class:`WeightMismatch` naming the first tensor of ``meta`` that does not fit."""
        ...

    def apply(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy every (name, tensor) into the model in place (already checked)."""
        ...

    def checksums(self, names: Iterable[str] | None = None) -> dict[str, str]:
        """``{name: tensor_checksum}`` of the live weights (all of them when ``names`` is None)."""
        ...


class StateDictReceiver:
    """A :class:`WeightReceiver` over a dict of tensors or a module's parameters and buffers.

    Tensors are written in place (``copy_``), so a module's parameters keep their identity and
    anything holding views of them (CUDA graphs, optimizers) sees the new values.
    """

    def __init__(self, target: nn.Module | Mapping[str, torch.Tensor]) -> None:
        if isinstance(target, nn.Module):
            tensors = target.state_dict(keep_vars=True)
        else:
            tensors = dict(target)
        self._tensors: dict[str, torch.Tensor] = {
            name: t.data if isinstance(t, nn.Parameter) else t for name, t in tensors.items()
        }

    def names(self) -> list[str]:
        """Every weight name this receiver accepts."""
        return list(self._tensors)

    def check(self, meta: BucketMeta) -> None:
        """Raise :class:`WeightMismatch` for the first tensor of ``meta`` that does not fit."""
        for slot in meta.tensors:
            target = self._tensors.get(slot.name)
            if target is None:
                examples = list(self._tensors)[:3]
                raise WeightMismatch(
                    f"weight {slot.name}: the receiving model has no tensor of that name "
                    f"(it has e.g. {examples}); check the exporter's HF name mapping")
            if tuple(target.shape) != slot.shape:
                raise WeightMismatch(
                    f"weight {slot.name}: sent with shape {list(slot.shape)}, the receiving "
                    f"model has {list(target.shape)}; the trainer and the rollout engine were "
                    "built from different model configs")
            if target.dtype != slot.dtype:
                raise WeightMismatch(
                    f"weight {slot.name}: sent as {dtype_name(slot.dtype)}, the receiving model "
                    f"holds {dtype_name(target.dtype)}; set the checkpoint engine's dtype to "
                    f"{dtype_name(target.dtype)}")

    @torch.no_grad()
    def apply(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy every (name, tensor) into the live tensor of that name."""
        for name, tensor in named_tensors:
            self._tensors[name].copy_(tensor)

    def checksums(self, names: Iterable[str] | None = None) -> dict[str, str]:
        """``{name: tensor_checksum}`` of the live tensors."""
        selected = self._tensors if names is None else names
        return {name: tensor_checksum(self._tensors[name]) for name in selected}
