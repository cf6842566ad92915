"""Load pieces of real SGLang (the ``sglang==0.5.10`` wheel) as the reference for conformance tests.

The wheel is pure Python but its package ``__init__`` imports CUDA-only packages, so nothing here
runs ``import sglang``. Three ways in, from lightest to heaviest:

- :func:`load_file`: one module by file path (``weight_sync/tensor_bucket.py`` imports only torch);
- :func:`load_definitions`: only the named top-level classes and functions of a file, compiled
  under the file's own name (``MultiprocessingSerializer`` and ``SafeUnpickler`` of
  ``utils/common.py``, whose module imports triton, PIL and much more);
- :func:`import_with_stubs`: a real module imported with the few modules it needs but that cannot
  load on CPU replaced by stubs; ``sys.modules`` is restored afterwards, so other tests never
  see a half-stubbed ``sglang``.
"""

from __future__ import annotations

import ast
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

SGLANG_VERSION = "0.5.10"
"""The version `make test` installs (Makefile: pip install --no-deps sglang==0.5.10)."""


def sglang_root() -> Path:
    """The installed ``sglang`` package directory; skips the test when the wheel is absent."""
    spec = importlib.util.find_spec("sglang")  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"sglang=={SGLANG_VERSION} is not installed; `make test` installs it with "
                    f"`pip install --no-deps sglang=={SGLANG_VERSION}`")
    return Path(next(iter(spec.submodule_search_locations)))


def source_of(relpath: str) -> Path:
    """The file ``relpath`` (``srt/...``) inside the installed sglang package."""
    path = sglang_root() / relpath
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not in the installed sglang (expected {SGLANG_VERSION})")
    return path


def load_file(relpath: str, module_name: str) -> types.ModuleType:
    """Execute one SGLang file as module ``module_name`` (not left in ``sys.modules``)."""
    path = source_of(relpath)
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses look their module up while being built
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[module_name]
    return module


def load_constants(relpath: str, names: Sequence[str]) -> dict[str, Any]:
    """The top-level literal assignments ``names`` of an SGLang file (``ast.literal_eval``)."""
    path = source_of(relpath)
    found = {}
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name) and node.targets[0].id in names):
            found[node.targets[0].id] = ast.literal_eval(node.value)
    missing = set(names) - set(found)
    if missing:
        raise LookupError(f"{path}: no top-level literal {sorted(missing)} (sglang "
                          f"{SGLANG_VERSION}?)")
    return found


def load_definitions(relpath: str, names: Sequence[str],
                     namespace: Mapping[str, Any]) -> dict[str, Any]:
    """The top-level classes/functions ``names`` of an SGLang file, executed from its source in
    ``namespace`` (which supplies what they use from the file's imports)."""
    path = source_of(relpath)
    tree = ast.parse(path.read_text(), filename=str(path))
    wanted = [node for node in tree.body
              if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name in names]
    missing = set(names) - {node.name for node in wanted}
    if missing:
        raise LookupError(f"{path}: no top-level {sorted(missing)} (sglang {SGLANG_VERSION}?)")
    scope = {"__name__": relpath.removesuffix(".py").replace("/", "."), **namespace}
    code = compile(ast.Module(body=wanted, type_ignores=[]), str(path), "exec")
    exec(code, scope)  # noqa: S102 - SGLang's own source, the reference under test
    return {name: scope[name] for name in names}


class _Stub(types.ModuleType):
    """A module standing in for one SGLang cannot import on CPU: any attribute is a MagicMock
    unless given."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = mock.MagicMock(name=f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, stubs: Mapping[str, Mapping[str, Any]]) -> None:
        self.stubs = stubs

    def _stubbed(self, fullname: str) -> str | None:
        return next((s for s in self.stubs if fullname == s or fullname.startswith(s + ".")),
                    None)

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if self._stubbed(fullname) is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _Stub(spec.name)
        module.__path__ = []
        if spec.name in self.stubs:
            module.__dict__.update(self.stubs[spec.name])
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run."""


@contextmanager
def sglang_modules(stubs: Mapping[str, Mapping[str, Any]] | None = None,
                   extra: Mapping[str, types.ModuleType] | None = None) -> Iterator[None]:
    """Within the block, ``import sglang.X`` runs the real file of X without the package
    ``__init__``, the modules named in ``stubs`` (and their submodules) are stubs with the given
    attributes, and ``extra`` maps module names to given modules. Afterwards every module added
    under ``sglang`` or a stubbed name leaves ``sys.modules`` again (real third-party modules
    imported meanwhile stay: dropping half of torch would break it)."""
    root = sglang_root()
    stubs = dict(stubs or {})
    finder = _StubFinder(stubs)
    before = set(sys.modules)
    shell = types.ModuleType("sglang")
    shell.__path__ = [str(root)]
    saved = {k: v for k, v in sys.modules.items() if k == "sglang" or k.startswith("sglang.")}
    sys.modules["sglang"] = shell
    sys.modules.update(extra or {})
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for name in set(sys.modules) - before | set(extra or {}) | {"sglang"}:
            if (name == "sglang" or name.startswith("sglang.") or finder._stubbed(name)
                    or name in (extra or {})):
                sys.modules.pop(name, None)
        sys.modules.update(saved)


def import_with_stubs(module: str, stubs: Mapping[str, Mapping[str, Any]]) -> types.ModuleType:
    """Import the real SGLang module ``module`` with ``stubs`` in place (see
    :func:`sglang_modules`); the returned module keeps working after ``sys.modules`` is
    restored."""
    with sglang_modules(stubs):
        return importlib.import_module(module)
