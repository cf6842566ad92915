"""Per-tensor checksums that the sender and every receiver compute the same way.

A checksum is the SHA-256 of the tensor's bytes in its own dtype, prefixed with the dtype and
shape (``"bfloat16[4,8]:<hex>"``), so a value, layout or dtype difference all show. Device
tensors are hashed in chunks copied to host memory, so the result does not depend on where the
tensor lives.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

import torch

from megarl.weights.buckets import dtype_name

_CHUNK_BYTES = 64 << 20


def tensor_checksum(tensor: torch.Tensor) -> str:
    """``"<dtype>[<shape>]:<sha256 hex>"`` of a tensor's bytes (contiguous, row-major)."""
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    digest = hashlib.sha256()
    for start in range(0, raw.numel(), _CHUNK_BYTES):
        digest.update(raw[start: start + _CHUNK_BYTES].cpu().numpy().data)
    shape = ",".join(str(s) for s in tensor.shape)
    return f"{dtype_name(tensor.dtype)}[{shape}]:{digest.hexdigest()}"


def checksums(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """``{name: tensor_checksum}`` for (name, tensor) pairs."""
    return {name: tensor_checksum(tensor) for name, tensor in named}


def verify(sender: Mapping[str, str], receiver: Mapping[str, str]) -> list[str]:
    """One line per tensor that is missing on either side or whose checksums differ.

    An empty list means the receiver holds exactly what the sender sent.
    """
    problems = []
    for name, expected in sender.items():
        got = receiver.get(name)
        if got is None:
            problems.append(f"{name}: sent but the receiver reports no checksum for it")
        elif got != expected:
            problems.append(f"{name}: receiver has {got}, sender sent {expected}")
    problems.extend(f"{name}: the receiver reports it but it was not sent"
                    for name in receiver if name not in sender)
    return problems
