"""The train side of a weight update: HF-named tensors streamed out of a sharded Megatron model.

:class:`MegatronExporter` wraps mbridge's ``export_weights`` on an
:class:`~megarl.megatron.model.ActorModel` under any TP / PP / VPP / EP / ETP layout (on a
model-parallel group of one rank, :func:`~megarl.megatron.hf_export.export_hf_weights` reads the
parameters directly: the same tensors without the collectives). What the export does on every
rank, for one HF tensor at a time (mbridge 0.15.1):

- **PP**: the stage that owns the parameter broadcasts it (name and data) over the pipeline
  group, so every stage holds it for that moment;
- **TP**: a tensor-parallel parameter is all-gathered over the TP group and merged (fused QKV
  and gate/up are split back into HF's q/k/v and gate/up);
- **EP**: an expert weight is all-gathered over the EP group, which yields the ``ep`` experts
  sharing that local index at once (each then gathered over ETP when ``etp > 1``).

So every rank of the train pool ends up with every HF tensor, in the same order (under EP not
the one-rank order: experts 0, 2, 1, 3 for 4 experts on 2 ranks; plans follow the stream), and
all of them must run the export (the gathers are collectives over the TP, PP, EP, ETP groups);
:func:`sync_weights` lets exactly one rank (``sender_rank``, global rank 0 by default) pack and
send while the others drain the stream. Peak extra memory on a rank: one HF tensor plus its
gather buffers (TP: ``tp`` shards and the merged copy, about twice the full tensor; EP: ``ep``
copies of one expert's weight); the sender additionally holds at most two bucket buffers
(:class:`~megarl.weights.WeightSender`'s double buffering, one larger when a single tensor
exceeds the bucket). Nothing ever holds the whole model.

The plan of an update needs every tensor's name, shape and dtype in export order before the
first byte moves. :meth:`MegatronExporter.specs` obtains them from one export pass (each tensor
dropped as soon as it is seen; same cost and memory as a sync without the transfer) on the
first call and keeps them: shapes and names do not change while training.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megarl.weights.buckets import TensorSpec
from megarl.weights.update import UpdateReport, WeightSender

if TYPE_CHECKING:
    from megarl.megatron.model import ActorModel


class MegatronExporter:
    """HF-named tensors of an :class:`ActorModel`, one at a time, in mbridge's export order."""

    def __init__(self, model: ActorModel, sender_rank: int = 0) -> None:
        self.model = model
        self.sender_rank = sender_rank
        self._specs: list[TensorSpec] | None = None

    @property
    def is_sender(self) -> bool:
        """Whether this rank packs and sends the weights (the others only take part in the
        export's collectives)."""
        return dist.get_rank() == self.sender_rank

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, tensor)`` for every HF tensor (collective: every rank must consume it
        to the end, in step)."""
        from megarl.megatron import cpu_compat
        from megarl.megatron.hf_export import export_hf_weights
        from megarl.megatron.lora import export_merged_weights

        cpu_compat.enable()
        export = export_merged_weights if self.model.lora else export_hf_weights
        with torch.no_grad():  # with LoRA adapters: W + scale * B @ A under the base names
            for name, tensor in export(self.model):
                yield name, tensor.detach()

    def specs(self) -> list[TensorSpec]:
        """Name, shape and dtype of every exported tensor, in export order (collective on the
        first call, cached afterwards)."""
        if self._specs is None:
            self._specs = [TensorSpec(name, tuple(t.shape), t.dtype)
                           for name, t in self.named_tensors()]
        return list(self._specs)


def sync_weights(exporter: MegatronExporter, sender: WeightSender | None, version: str, *,
                 verify_checksums: bool = False) -> UpdateReport | None:
    """Export and send one weight update (collective: every rank of the train pool calls it).

    The sending rank passes its connected :class:`WeightSender` and gets the
    :class:`UpdateReport`; the other ranks pass None, drain the export and get None. When the
    update fails on the sender (an engine rejected the plan, a transport error), the sender
    still drains the export so the other ranks leave its collectives, then raises.
    """
    specs = exporter.specs()
    stream = exporter.named_tensors()
    if not exporter.is_sender:
        for _ in stream:
            pass
        return None
    if sender is None:
        raise ValueError(f"rank {exporter.sender_rank} sends the weights: pass its connected "
                         "WeightSender (the other ranks pass None)")
    try:
        return sender.update(stream, version=version, specs=specs,
                             verify_checksums=verify_checksums)
    finally:
        for _ in stream:
            pass
