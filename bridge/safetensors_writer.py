"""Write HF-style sharded safetensors files tensor by tensor, without holding a file in memory.

The names, dtypes and shapes of every tensor are known before any data is read (they follow
from the checkpoint's metadata), so each file's header is written first and each tensor's bytes
are appended as soon as it is converted. :func:`assign_files` splits the tensors into
``model-0000x-of-0000y.safetensors`` files of at most ``max_bytes`` each (a tensor larger than
that gets a file of its own), and :func:`write_index` writes ``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import torch

# torch dtype -> safetensors dtype code
DTYPE_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorSpec:
    """One output tensor: name, dtype, shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Size of its data in bytes."""
        count = 1
        for dim in self.shape:
            count *= dim
        return count * torch.empty((), dtype=self.dtype).element_size()


def shard_file_name(index: int, count: int) -> str:
    """``model-00001-of-00003.safetensors`` for the first of three files."""
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def assign_files(groups: list[list[TensorSpec]], max_bytes: int) -> list[int]:
    """The file index of each group of tensors (a group never spans two files)."""
    assignment, file_index, used = [], 0, 0
    for group in groups:
        size = sum(t.nbytes for t in group)
        if used and used + size > max_bytes:
            file_index, used = file_index + 1, 0
        assignment.append(file_index)
        used += size
    return assignment


class SafetensorsFile:
    """One safetensors file being written: header first, then tensors in the planned order."""

    def __init__(self, path: Path, specs: list[TensorSpec]) -> None:
        self.path = path
        self._pending = list(specs)
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for spec in specs:
            header[spec.name] = {"dtype": DTYPE_CODES[spec.dtype], "shape": list(spec.shape),
                                 "data_offsets": [offset, offset + spec.nbytes]}
            offset += spec.nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # data starts 8-byte aligned, as safetensors does
        self._file = open(path, "wb")  # noqa: SIM115 - closed by close() or the with block
        self._file.write(len(encoded).to_bytes(8, "little"))
        self._file.write(encoded)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append the next planned tensor (its name, dtype and shape must match the plan)."""
        spec = self._pending.pop(0) if self._pending else None
        if spec is None or spec.name != name:
            raise RuntimeError(f"{self.path}: got {name}, expected {spec and spec.name}")
        if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
            raise RuntimeError(f"{self.path}: {name} is {tensor.dtype} {tuple(tensor.shape)}, "
                               f"planned {spec.dtype} {spec.shape}")
        data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
        self._file.write(memoryview(data.numpy()))

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self._file.close()

    def close(self) -> None:
        """Finish the file; every planned tensor must have been written."""
        self._file.close()
        if self._pending:
            raise RuntimeError(f"{self.path}: {len(self._pending)} planned tensors not written, "
                               f"first {self._pending[0].name}")


def write_index(directory: Path, weight_map: dict[str, str], total_size: int) -> None:
    """``model.safetensors.index.json`` mapping each tensor to its file."""
    index = {"metadata": {"total_size": total_size},
             "weight_map": dict(sorted(weight_map.items()))}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
