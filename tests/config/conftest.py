"""Shared fixtures of the config tests: a real tiny MoE model dir, real data files on disk, and
a clean 8-GPU base config (Qwen3-30B-A3B) to break one rule at a time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from config_archs import QWEN3_30B_A3B, base_dict

from megarl.config import load_config_dict, validate_config
from megarl.config.model_info import ModelInfo, model_info_from_dict
from megarl.config.problems import Problem


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3-MoE written by make_tiny_model (4 experts, 4 heads, 2 KV heads)."""
    from megarl.data.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", arch="qwen3_moe")


@pytest.fixture
def data_file(tmp_path: Path) -> Path:
    """An existing (empty) training file."""
    path = tmp_path / "train.parquet"
    path.write_bytes(b"")
    return path


class Checker:
    """Builds the base config with overrides and validates it against a given architecture."""

    def __init__(self, tmp_path: Path, data_file: Path) -> None:
        self.tmp_path, self.data_file = tmp_path, data_file

    def problems(self, *overrides: str, model: dict[str, Any] | ModelInfo | None = None,
                 allow_missing_files: bool = False) -> list[Problem]:
        """Problems of the base config + overrides; ``model`` defaults to Qwen3-30B-A3B."""
        cfg, sources = load_config_dict(base_dict(self.tmp_path, self.data_file), overrides)
        info = model if isinstance(model, ModelInfo) else model_info_from_dict(
            model or QWEN3_30B_A3B)
        return validate_config(cfg, info, sources=sources, allow_missing_files=allow_missing_files)

    def find(self, rule: str, *overrides: str, field: str | None = None, **kwargs: Any) -> Problem:
        """The problem ``rule`` reports for these overrides (naming ``field`` when given)."""
        found = [p for p in self.problems(*overrides, **kwargs)
                 if p.rule == rule and (field is None or field in p.fields)]
        assert found, f"{rule} reported nothing for {overrides}"
        return found[0]


@pytest.fixture
def checker(tmp_path: Path, data_file: Path) -> Checker:
    """A :class:`Checker` over a fresh tmp dir."""
    return Checker(tmp_path, data_file)
