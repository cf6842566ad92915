"""Fixtures of the reliability tests: a tiny dense model with a tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.data.tiny_model import make_tiny_model


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny dense Qwen3 with a char-level tokenizer (vocab 128)."""
    return make_tiny_model(tmp_path_factory.mktemp("reliability") / "model", arch="qwen3")
