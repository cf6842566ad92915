"""DESIGN.md's layering, checked on the source: a package imports downward only, and the two
engines (the Megatron train side and the rollout side) meet only through the checkpoint engine
(``megarl.weights``). Imports under ``if TYPE_CHECKING:`` are type hints, not dependencies."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "megarl"
TRAINER = {"trainer", "trainer_setup", "trainer_critic", "trainer_checkpoint"}
ABOVE_ENGINES = {"scheduler", *TRAINER}
# package -> top-level megarl modules it must not import (directly, at run time)
FORBIDDEN: dict[str, set[str]] = {
    "algo": {"*"},
    "config": {"*"},
    "kernels": {"*"},
    "net": {"*"},
    "children": {"*"},
    "cluster": {"megatron", "rollout", "weights", *ABOVE_ENGINES},
    "megatron": {"rollout", *ABOVE_ENGINES},
    "rollout": {"megatron", *ABOVE_ENGINES},
    "weights": {"rollout", *ABOVE_ENGINES},
    "scheduler": TRAINER,
}


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def megarl_imports(path: Path, with_hints: bool = False) -> list[tuple[int, str]]:
    """(line, top-level megarl module) of every run-time import in a file (``with_hints``:
    and of every type-hint import)."""
    tree = ast.parse(path.read_text())
    hints = set() if with_hints else _type_checking_lines(tree)
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "megarl" and len(parts) > 1 and node.lineno not in hints:
                found.append((node.lineno, parts[1]))
    return found


def _files(package: str) -> list[Path]:
    single = ROOT / f"{package}.py"
    return [single] if single.exists() else sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_packages_import_downward_only(package):
    banned = FORBIDDEN[package]
    bad = [f"{path.relative_to(ROOT.parent)}:{line} imports megarl.{target}"
           for path in _files(package) for line, target in megarl_imports(path)
           if target != package and ("*" in banned or target in banned)]
    assert not bad, "\n".join(bad)


def test_schedulers_do_not_know_the_trainer_module():
    """The trainer imports the schedulers; they see it through scheduler/driver.py's StepDriver
    protocol, not even as a type hint (no import cycle)."""
    bad = [f"{path.relative_to(ROOT.parent)}:{line} imports megarl.{target}"
           for path in _files("scheduler") for line, target in megarl_imports(path, True)
           if target in TRAINER]
    assert not bad, "\n".join(bad)


def test_the_checker_sees_function_level_imports(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                      "    from megarl.trainer import Trainer\n"
                      "def f():\n    from megarl.rollout.process import free_port\n")
    assert megarl_imports(source) == [(5, "rollout")]
    assert megarl_imports(source, with_hints=True) == [(3, "trainer"), (5, "rollout")]


def test_the_driver_does_not_import_megatron(tmp_path):
    """The driver builds the workers' specs from megarl.megatron.settings and names the worker
    classes by path, and finds the checkpoint to resume from (``trainer.resume=auto``) without
    megatron-core too; megatron-core (seconds to import) loads in the train workers only."""
    code = ("import sys, types, megarl.cli, megarl.trainer, megarl.trainer_setup, "
            "megarl.trainer_critic; from megarl.trainer_checkpoint import resume_path; "
            "trainer = types.SimpleNamespace(cfg=types.SimpleNamespace(trainer=types."
            f"SimpleNamespace(resume='auto', output_dir={str(tmp_path)!r}))); "
            "assert resume_path(trainer) is None; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('megatron', 'mbridge')))")
    env = {**os.environ, "PYTHONPATH": str(ROOT.parent)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True, cwd=ROOT.parent, env=env)
    assert out.stdout.strip() == "[]", out.stdout
