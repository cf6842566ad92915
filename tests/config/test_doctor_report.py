"""PITFALLS M3: ``megarl doctor --report --config CONFIG`` prints what a bug report needs: commit,
command, OS, versions, CUDA and driver, GPUs, and the resolved config exactly as ``megarl config
show`` resolves it."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megarl import doctor
from megarl.config.cli import show_main

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny-moe-cpu.yaml"


@pytest.fixture
def cheap_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Skip the slow checks (a process group, ``ray status``): the report is under test."""
    monkeypatch.setattr(doctor, "check_distributed", lambda: doctor.Check("PASS", "distributed",
                                                                          "stub"))
    monkeypatch.setattr(doctor, "check_ray", lambda: doctor.Check("PASS", "ray", "stub"))


def test_report_prints_every_section_and_the_resolved_config(
        tmp_path: Path, tiny_moe_dir: Path, cheap_checks: None,
        capsys: pytest.CaptureFixture[str]) -> None:
    train = tmp_path / "train.parquet"
    train.write_bytes(b"")
    overrides = [f"model.path={tiny_moe_dir}", f"data.train_files=[{train}]",
                 f"data.val_files=[{train}]", "actor.optim.lr=3e-5", "rollout.n=8"]
    doctor.doctor_main(["--report", "--config", str(TINY), *overrides])
    out = capsys.readouterr().out
    lines = out.splitlines()
    prefixes = ["megarl commit: ", f"command: megarl doctor --report --config {TINY} model.path=",
                "os: ", "python: ", "versions: ", "cuda: torch ", "driver: ", "gpus: ",
                "PASS python", "PASS distributed"]
    for prefix in prefixes:
        assert any(line.startswith(prefix) for line in lines), prefix
    versions = next(line for line in lines if line.startswith("versions: "))
    for package in ("torch", "megatron-core", "mbridge", "ray", "transformers"):
        assert f"{package} " in versions
    assert lines[0].removeprefix("megarl commit: ").split()[0] != "unknown"
    head = f"\nresolved config ({TINY}):\n"
    assert head in out
    reported = out.split(head, 1)[1].rsplit("\n\n", 1)[0] + "\n"
    show_main([str(TINY), *overrides])
    assert reported == capsys.readouterr().out
    assert "lr: 3.0e-05  # from override" in reported


def test_report_lists_each_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(name="NVIDIA H200", total_memory=141 * 2**30))
    lines = doctor.report_gpus()
    assert "gpus: 2" in lines
    assert "  gpu 1: NVIDIA H200, 141.0 GiB" in lines
