"""Fixtures of the trainer tests: the demo's tiny model and data, made once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.demo import prepare_demo_assets


@pytest.fixture(scope="session")
def demo_assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's tiny Qwen3-MoE and copy_digit train/val data (``<root>/model``, ``data/``)."""
    root = tmp_path_factory.mktemp("tiny")
    prepare_demo_assets(root)
    return root
