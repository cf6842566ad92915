"""Model-only megatron dist checkpoints: save and load model chunks, and find one in a directory.

A checkpoint written by ``megarl-convert hf-to-mcore`` is a megatron-core dist checkpoint
(``torch_dist`` backend) of the model's ``sharded_state_dict``, so it loads under any TP/PP/EP
layout, plus two things megarl adds next to it:

- ``megarl_convert.json``: what was converted (model type, dtype, the layout it was saved from);
- ``hf/``: the HF ``config.json`` and tokenizer files, so ``mcore-to-hf`` needs no other input.

The tensors are the model's own ``sharded_state_dict`` (the same keys as the model part of
megarl's training checkpoints, :mod:`megarl.megatron.checkpoint`), so ``mcore-to-hf`` reads both,
and :func:`find_model_checkpoint` also finds the newest step under a training checkpoint root.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from bridge.checks import ConversionError

CONVERT_INFO = "megarl_convert.json"
HF_SUBDIR = "hf"
FORMAT_NAME = "megarl.mcore_model"
FORMAT_VERSION = 1
DIST_METADATA = "metadata.json"  # megatron's marker of a dist checkpoint directory
TRAINING_MANIFEST = "megarl.json"  # written by megarl.megatron.checkpoint.save_checkpoint


def model_sharded_state_dict(chunks: list[torch.nn.Module]) -> dict[str, Any]:
    """The sharded state dict of this rank's model chunks (one entry per chunk with VPP)."""
    if len(chunks) == 1:
        return chunks[0].sharded_state_dict()
    return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}


def save_model(chunks: list[torch.nn.Module], directory: Path) -> None:
    """Save the model chunks of every rank as one dist checkpoint in ``directory`` (collective)."""
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(model_sharded_state_dict(chunks), str(directory))


def load_model(chunks: list[torch.nn.Module], directory: Path) -> None:
    """Load a dist checkpoint saved in any layout into this rank's chunks (collective)."""
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load(model_sharded_state_dict(chunks), str(directory))
    parts = [loaded] if len(chunks) == 1 else [loaded[f"model{i}"] for i in range(len(chunks))]
    for chunk, part in zip(chunks, parts):
        chunk.load_state_dict(part)


def is_dist_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a megatron dist checkpoint directory (torch_dist backend)."""
    return (path / DIST_METADATA).is_file() and (path / ".metadata").is_file()


def _pointed_to(path: Path) -> Path | None:
    """The checkpoint a pointer file names: megarl's ``latest`` (``step_00000012``) or
    Megatron-LM's ``latest_checkpointed_iteration.txt`` (``12`` -> ``iter_0000012``)."""
    megarl_pointer = path / "latest"
    if megarl_pointer.is_file():
        return path / megarl_pointer.read_text().strip()
    megatron_pointer = path / "latest_checkpointed_iteration.txt"
    if megatron_pointer.is_file():
        text = megatron_pointer.read_text().strip()
        return path / ("release" if text == "release" else f"iter_{int(text):07d}")
    return None


def find_model_checkpoint(path: str | Path) -> Path:
    """The dist checkpoint at ``path``: the directory itself, the one a ``latest`` pointer
    names, or the only (else the newest ``step_*``/``iter_*``) checkpoint subdirectory."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise ConversionError(f"--mcore {path}: no such directory")
    if is_dist_checkpoint(path):
        return path
    target = _pointed_to(path)
    if target is not None:
        if is_dist_checkpoint(target):
            return target
        raise ConversionError(f"--mcore {path}: its latest pointer names {target.name}, which "
                              "is not a complete dist checkpoint; pass a checkpoint directory")
    candidates = sorted(p for p in path.iterdir() if p.is_dir() and is_dist_checkpoint(p))
    steps = [p for p in candidates if p.name.startswith(("step_", "iter_"))]
    if len(candidates) == 1 or steps:
        return (steps or candidates)[-1]
    found = ", ".join(p.name for p in candidates[:4])
    raise ConversionError(
        f"--mcore {path}: " + (f"several checkpoints ({found}); pass one of them"
                               if candidates else
                               "no megatron dist checkpoint (metadata.json + .metadata) found")
    )


def read_convert_info(checkpoint: Path) -> dict[str, Any]:
    """megarl's note about a converted checkpoint, or {} for checkpoints written elsewhere."""
    info_file = checkpoint / CONVERT_INFO
    if not info_file.is_file():
        return {}
    return json.loads(info_file.read_text())


def write_convert_info(checkpoint: Path, info: dict[str, Any]) -> None:
    """Write megarl's note next to a converted checkpoint."""
    note = {"format": FORMAT_NAME, "version": FORMAT_VERSION, **info}
    (checkpoint / CONVERT_INFO).write_text(json.dumps(note, indent=2) + "\n")


def check_training_manifest(checkpoint: Path, config: dict[str, Any], config_file: Path) -> None:
    """A training checkpoint records its model's architecture fields; ``config`` must agree."""
    manifest = checkpoint / TRAINING_MANIFEST
    if not manifest.is_file():
        return
    saved = json.loads(manifest.read_text()).get("model", {})
    for name in sorted(set(saved) & set(config)):
        if saved[name] != config[name]:
            raise ConversionError(
                f"{config_file} does not describe the model of {checkpoint} ({name}: "
                f"checkpoint {saved[name]!r}, config {config[name]!r}); pass the HF config the "
                "model was trained from")
