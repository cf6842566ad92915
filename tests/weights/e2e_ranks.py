"""What the train ranks run in the end-to-end weight-sync tests (picklable, for ``RankPool``).

Every function builds the tiny Megatron model from the HF directory under the given layout,
changes its weights the same way on every layout (``p * scale + shift``, elementwise, so the
result does not depend on how the parameter is sharded), and then exports or syncs them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from megarl.megatron.parallel import ParallelSizes

BUCKET_MB = 0.05


def build_changed_model(model_dir: str, sizes: ParallelSizes, scale: float, shift: float) -> Any:
    """The actor model for ``sizes`` with every parameter replaced by ``p * scale + shift``."""
    from megarl.megatron.model import build_actor_model

    model = build_actor_model(model_dir, sizes, torch.float32)
    with torch.no_grad():
        for chunk in model.chunks:
            for param in chunk.parameters():
                param.mul_(scale).add_(shift)
    return model


def export_on_rank(model_dir: str, sizes: ParallelSizes, scale: float,
                   shift: float) -> tuple[dict[str, torch.Tensor], list[tuple[str, list[int]]]]:
    """Every rank's export (name -> tensor copy) and its ``specs()`` (name, shape)."""
    from megarl.weights import MegatronExporter

    exporter = MegatronExporter(build_changed_model(model_dir, sizes, scale, shift))
    specs = [(s.name, list(s.shape)) for s in exporter.specs()]
    exported = {name: tensor.clone() for name, tensor in exporter.named_tensors()}
    return exported, specs


def make_transport(kind: str, disk_root: str) -> Any:
    """The sender half of transport ``kind`` on CPU (a stuck broadcast fails after 60 s)."""
    from megarl.weights.transports import SENDERS

    options: dict[str, dict[str, Any]] = {"disk": {"root": Path(disk_root)},
                                          "nccl": {"timeout_s": 60.0}}
    return SENDERS[kind](**options.get(kind, {}))


def sync_on_rank(model_dir: str, sizes: ParallelSizes, scale: float, shift: float, kind: str,
                 urls: list[str], version: str, disk_root: str) -> dict[str, Any] | None:
    """Build, change and stream the model to the engines at ``urls`` (rank 0 sends); rank 0
    returns what the update reported."""
    from megarl.weights import MegatronExporter, WeightSender, sync_weights
    from megarl.weights.links import HttpLink

    exporter = MegatronExporter(build_changed_model(model_dir, sizes, scale, shift))
    sender = link = None
    if exporter.is_sender:
        link = HttpLink(urls, timeout_s=120)
        sender = WeightSender(make_transport(kind, disk_root), link, bucket_size_mb=BUCKET_MB)
        sender.connect()
    try:
        report = sync_weights(exporter, sender, version, verify_checksums=True)
    finally:
        if sender is not None and link is not None:
            sender.close()
            link.close()
    if report is None:
        return None
    return {"num_tensors": report.num_tensors, "num_buckets": report.num_buckets,
            "bytes": report.bytes, "peak_buffer_bytes": report.peak_buffer_bytes,
            "mismatches": report.mismatches, "sender_checksums": report.sender_checksums}


def rejected_sync_on_rank(*args: Any) -> str | None:
    """:func:`sync_on_rank` for an update the engines must refuse: rank 0 returns the
    rejection's message (every rank must still return: the sender drains the export)."""
    from megarl.weights import UpdateRejected

    try:
        sync_on_rank(*args)
    except UpdateRejected as err:
        return str(err)
    return None
