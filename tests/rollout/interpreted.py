"""Runs checks of Triton kernels on CPU tensors through Triton's interpreter
(``TRITON_INTERPRET=1``) in one child process: the variable must be set before Triton loads, and
the child's path has the Triton that ``make test`` installs beside the venv
(``.venv/triton-interpreter``: not in the venv's site-packages, where every megatron process
would pay for importing it). The child prints one JSON object per check; a failed check's value
is ``"FAILED <traceback>"``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
TRITON = Path(sys.prefix) / "triton-interpreter"

PART = """
import json, traceback

def part(name, fn):
    try:
        print(json.dumps({name: fn()}))
    except Exception:
        print(json.dumps({name: "FAILED " + traceback.format_exc()}))
"""
"""The child's ``part(name, fn)``, prepended to every child script."""


def run_child(script: str) -> dict:
    """Every check's result by name (skips the test where the interpreter's Triton is absent)."""
    if not (TRITON / "triton").is_dir():
        pytest.skip(f"no Triton for the interpreter at {TRITON} (make test installs it)")
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(TRITON), str(TESTS), os.environ.get("PYTHONPATH",
                                                                                   "")])}
    done = subprocess.run([sys.executable, "-c", PART + script], env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    parts = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            parts.update(json.loads(line))
    return parts


def result(report: dict, name: str):
    """One check's value; fails the test with the child's traceback if the check failed."""
    value = report[name]
    assert not (isinstance(value, str) and value.startswith("FAILED")), value
    return value
