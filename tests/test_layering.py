"""DESIGN.md's layering, checked on the source: a package imports downward only, the two
engines (the Megatron train side and the rollout side) meet only through the checkpoint engine
(``megarl.weights``), no module imports one that imports it back (directly or around a
circle), and no module is over 600 lines. Imports under ``if TYPE_CHECKING:`` are type hints,
not dependencies."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "megarl"
TRAINER = {"trainer"}
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
MAX_LINES = 600
"""STYLE.md: a module over ~600 lines usually holds more than one role."""


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
    code = ("import sys, types, megarl.cli, megarl.trainer, megarl.trainer.workers, "
            "megarl.trainer.critic; from megarl.trainer.checkpoint import resume_path; "
            "trainer = types.SimpleNamespace(cfg=types.SimpleNamespace(trainer=types."
            f"SimpleNamespace(resume='auto', output_dir={str(tmp_path)!r}))); "
            "assert resume_path(trainer) is None; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('megatron', 'mbridge')))")
    env = {**os.environ, "PYTHONPATH": str(ROOT.parent)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True, cwd=ROOT.parent, env=env)
    assert out.stdout.strip() == "[]", out.stdout


def module_name(path: Path, root: Path = ROOT) -> str:
    """``megarl.a.b`` of ``megarl/a/b.py`` (and of ``megarl/a/b/__init__.py``)."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules of ``root`` it imports at run time (function-level imports too,
    type hints not). ``from a import b`` is an edge to ``a.b`` when that is a module, else to
    ``a``; a package's ``__init__`` is a module like any other, so its re-exports are edges."""
    modules = {module_name(path, root): path for path in root.rglob("*.py")}

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        hints = _type_checking_lines(tree)
        targets: set[str | None] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom) and node.lineno in hints:
                continue
            if isinstance(node, ast.Import):
                targets.update(resolve(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets.update(resolve(f"{node.module}.{a.name}") for a in node.names)
        graph[name] = {t for t in targets if t is not None and t != name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every circle a depth-first walk of ``graph`` closes, each as ``[a, b, ..., a]``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []
    cycles: list[list[str]] = []

    def walk(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycles.append(path[path.index(target):] + [target])
            elif target not in state:
                walk(target)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            walk(module)
    return cycles


def test_no_import_cycles():
    cycles = import_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_cycle_checker_sees_circles_through_init_and_functions(tmp_path):
    package = tmp_path / "megarl" / "pkg"
    package.mkdir(parents=True)
    (tmp_path / "megarl" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("from megarl.pkg.a import f\n")
    (package / "a.py").write_text("def f():\n    from megarl.pkg import b\n")
    (package / "b.py").write_text("from typing import TYPE_CHECKING\nimport megarl.pkg\n"
                                  "if TYPE_CHECKING:\n    from megarl.pkg.a import f\n")
    graph = import_graph(tmp_path / "megarl")
    assert graph["megarl.pkg.b"] == {"megarl.pkg"}  # the type hint is no edge
    assert import_cycles(graph) == [["megarl.pkg", "megarl.pkg.a", "megarl.pkg.b", "megarl.pkg"]]


def test_no_module_over_the_size_limit():
    sizes = {path: len(path.read_text().splitlines()) for path in sorted(ROOT.rglob("*.py"))}
    big = [f"{path.relative_to(ROOT.parent)}: {n} lines (at most {MAX_LINES})"
           for path, n in sizes.items() if n > MAX_LINES]
    assert not big, "\n".join(big)
