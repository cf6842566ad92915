"""The layout of a checkpoint root (:mod:`megarl.megatron.checkpoint`) without megatron-core:
the ``step_XXXXXXXX`` directory names, the ``latest`` pointer and finding the checkpoint to
resume from. The driver reads it at resume (megatron-core takes seconds to import, and loads in
the train workers only)."""

from __future__ import annotations

import re
from pathlib import Path

MANIFEST = "megarl.json"
LATEST = "latest"
STEP_DIR = re.compile(r"^step_(\d{8})$")


def step_dir_name(step: int) -> str:
    """The directory name of the checkpoint of ``step``."""
    if step < 0:
        raise ValueError(f"checkpoint step={step}: must be >= 0")
    return f"step_{step:08d}"


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoint directories under ``root``, oldest step first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if STEP_DIR.match(p.name) and (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The directory ``<root>/latest`` names, or the newest complete one if the pointer is
    missing or dangling; None when there is no checkpoint."""
    root = Path(root)
    pointer = root / LATEST
    if pointer.is_file():
        target = root / pointer.read_text().strip()
        if STEP_DIR.match(target.name) and (target / MANIFEST).is_file():
            return target
    complete = list_checkpoints(root)
    return complete[-1] if complete else None
