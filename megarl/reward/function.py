"""Load the user's reward function named by ``reward.function``.

The value is ``"package.module:callable"`` (imported from ``sys.path``) or
``"path/to/file.py:callable"`` (executed from that file; relative paths are taken from the
working directory). The callable follows verl's ``compute_score`` convention, so existing reward
functions work unchanged. It is called with keyword arguments::

    fn(data_source=..., solution_str=..., ground_truth=..., extra_info=...) -> float | dict

or, with ``reward.batched=true``, once per chunk of samples::

    fn(data_sources=[...], solution_strs=[...], ground_truths=[...], extra_infos=[...])
        -> list[float | dict]

where a dict carries the reward under ``"score"`` and any other keys as extra per-sample values.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

FIELD = "reward.function"
SAMPLE_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")
BATCHED_ARGS = ("data_sources", "solution_strs", "ground_truths", "extra_infos")
_FORMS = "'package.module:callable' or 'path/to/file.py:callable'"


class RewardFunctionError(ValueError):
    """``reward.function`` does not name a usable callable; the message says why and the fix."""


def _fail(spec: str, problem: str) -> RewardFunctionError:
    return RewardFunctionError(f"{FIELD}={spec!r}: {problem}")


def split_spec(spec: str) -> tuple[str, str]:
    """Split ``'target:attribute'`` into its module (or file) and attribute parts."""
    target, sep, attribute = spec.rpartition(":")
    if not sep or not target.strip() or not attribute.strip():
        raise _fail(spec, f"expected {_FORMS}")
    return target.strip(), attribute.strip()


def _is_file_target(target: str) -> bool:
    return target.endswith(".py") or "/" in target or os.sep in target


def _load_file(spec: str, target: str) -> Any:
    path = Path(target).expanduser().resolve()
    if not path.is_file():
        raise _fail(
            spec, f"file {path} not found (relative paths are taken from the working directory "
            f"{os.getcwd()}); give an existing .py file or a module path"
        )
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    name = f"_megarl_reward_{path.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise _fail(spec, f"{path} cannot be loaded as a Python module; give a .py file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise _fail(spec, f"executing {path} failed: {type(exc).__name__}: {exc}") from exc
    return module


def _import_module(spec: str, target: str) -> Any:
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as exc:
        if exc.name and (target == exc.name or target.startswith(exc.name + ".")):
            raise _fail(
                spec, f"no module named {exc.name!r}; check the spelling and that it is "
                f"installed or on sys.path/PYTHONPATH, or give {_FORMS}"
            ) from exc
        raise _fail(spec, f"importing {target!r} failed: {exc}") from exc
    except Exception as exc:
        raise _fail(spec, f"importing {target!r} failed: {type(exc).__name__}: {exc}") from exc


def _attribute(spec: str, module: Any, attribute: str) -> Any:
    value = module
    for part in attribute.split("."):
        if not hasattr(value, part):
            callables = sorted(
                name for name, obj in vars(module).items()
                if callable(obj) and not name.startswith("_")
            )
            hint = f"; callables defined there: {', '.join(callables[:12])}" if callables else ""
            raise _fail(spec, f"{module.__name__!r} has no attribute {attribute!r}{hint}")
        value = getattr(value, part)
    return value


def _check_signature(spec: str, fn: Callable[..., Any], batched: bool) -> None:
    names = BATCHED_ARGS if batched else SAMPLE_ARGS
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(**dict.fromkeys(names))
    except TypeError as exc:
        mode = "a batched" if batched else "a per-sample"
        raise _fail(
            spec, f"{fn!r} cannot be called as {mode} reward function with keyword arguments "
            f"({', '.join(names)}): {exc}; rename its parameters"
            + ("" if batched else " or set reward.batched=true if it takes lists")
        ) from exc


def load_reward_function(spec: str, batched: bool = False) -> Callable[..., Any]:
    """Import the callable named by ``spec`` and check that it accepts verl's arguments."""
    target, attribute = split_spec(spec)
    if _is_file_target(target):
        module = _load_file(spec, target)
    else:
        module = _import_module(spec, target)
    fn = _attribute(spec, module, attribute)
    if not callable(fn):
        raise _fail(spec, f"{attribute!r} is not callable (type {type(fn).__name__})")
    _check_signature(spec, fn, batched)
    return fn


def absolute_spec(spec: str) -> str:
    """``spec`` with a file path made absolute, so worker processes resolve the same file."""
    target, attribute = split_spec(spec)
    if _is_file_target(target):
        return f"{Path(target).expanduser().resolve()}:{attribute}"
    return spec
