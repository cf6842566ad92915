"""Read regions of the tensors of a megatron dist checkpoint in one process, chunk by chunk.

A ``torch_dist`` checkpoint is a PyTorch distributed checkpoint: ``.metadata`` lists, for every
tensor key, its global shape and the chunks (offset + size boxes) that the saving ranks wrote,
and where each chunk lies in the ``__<rank>_<i>.distcp`` files. :class:`CheckpointTensors`
reads any box of a tensor by asking the checkpoint's own ``FileSystemReader`` for exactly the
chunks that overlap it, so memory holds the box plus one chunk at a time: no process group, no
model, and never the whole checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from bridge.checks import ConversionError


@dataclass(frozen=True)
class StoredTensor:
    """One tensor key of the checkpoint: global shape and dtype."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype


class _CopyInto:
    """The part of a LoadPlanner that ``FileSystemReader.read_data`` calls: where each read
    chunk is copied (a narrowed view of one destination tensor)."""

    def __init__(self, dest: torch.Tensor) -> None:
        self.dest = dest

    def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
        """The part of the destination that ``item`` fills."""
        view = self.dest
        for dim, (start, length) in enumerate(zip(item.dest_offsets, item.lengths)):
            view = view.narrow(dim, start, length)
        return view

    def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
        """Nothing to do: the data was copied into the destination view."""

    def load_bytes(self, item: ReadItem, value: object) -> None:
        """Model tensors are never stored as bytes; a key that is must not be read."""
        raise ConversionError(f"{item.storage_index.fqn}: expected tensor data, found bytes")


class CheckpointTensors:
    """The tensors of one dist checkpoint directory, readable box by box."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._reader = FileSystemReader(str(directory))
        try:
            self._metadata = self._reader.read_metadata()
        except Exception as err:  # any unreadable .metadata is one user error
            raise ConversionError(f"{directory}/.metadata: not a readable dist checkpoint "
                                  f"({type(err).__name__}: {err})") from err
        self._reader.set_up_storage_reader(self._metadata, is_coordinator=True)

    def tensors(self) -> list[StoredTensor]:
        """Every tensor key in the checkpoint (objects such as ``_extra_state`` are left out)."""
        return [StoredTensor(key, tuple(md.size), md.properties.dtype)
                for key, md in self._metadata.state_dict_metadata.items()
                if isinstance(md, TensorStorageMetadata)]

    def read(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        """The box ``[offsets, offsets + sizes)`` of tensor ``key``, assembled from its chunks."""
        md = self._metadata.state_dict_metadata[key]
        dest = torch.empty(sizes, dtype=md.properties.dtype)
        items, covered = [], 0
        for index, chunk in enumerate(md.chunks):
            low = [max(o, c) for o, c in zip(offsets, chunk.offsets)]
            high = [min(o + s, c + n) for o, s, c, n in
                    zip(offsets, sizes, chunk.offsets, chunk.sizes)]
            if any(lo >= hi for lo, hi in zip(low, high)):
                continue
            lengths = [hi - lo for lo, hi in zip(low, high)]
            covered += _volume(lengths)
            items.append(ReadItem(
                type=LoadItemType.TENSOR,
                dest_index=MetadataIndex(key, offsets),
                dest_offsets=torch.Size(lo - o for lo, o in zip(low, offsets)),
                storage_index=MetadataIndex(key, chunk.offsets, index),
                storage_offsets=torch.Size(lo - c for lo, c in zip(low, chunk.offsets)),
                lengths=torch.Size(lengths),
            ))
        if covered != _volume(sizes):
            raise ConversionError(
                f"{self.directory}: tensor {key} is incomplete in the checkpoint ({covered} of "
                f"{_volume(sizes)} elements of the requested part are stored); was the save "
                "interrupted?")
        self._reader.read_data(LoadPlan(items), _CopyInto(dest)).wait()
        return dest


def _volume(sizes: list[int] | tuple[int, ...]) -> int:
    count = 1
    for size in sizes:
        count *= size
    return count
