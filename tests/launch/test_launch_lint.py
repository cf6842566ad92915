"""`bash -n` and shellcheck on every shell script in slurm/ and launch/ (a few seconds)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from launch_helpers import REPO
from slurm_local import run

SCRIPT_DIRS = ("slurm", "launch")


def shell_scripts() -> list[Path]:
    """Files in SCRIPT_DIRS that are shell scripts: a .sh/.slurm suffix or a shell shebang."""
    found = []
    for folder in SCRIPT_DIRS:
        for path in sorted((REPO / folder).rglob("*")):
            if not path.is_file():
                continue
            with open(path, "rb") as f:
                first = f.readline()
            if path.suffix in (".sh", ".slurm") or first.startswith((b"#!/bin/bash",
                                                                     b"#!/usr/bin/env bash",
                                                                     b"#!/bin/sh")):
                found.append(path)
    return found


SCRIPTS = shell_scripts()


def _shellcheck() -> str | None:
    """The shellcheck binary, installed with apt-get when missing and possible."""
    if shutil.which("shellcheck") is None and os.geteuid() == 0 and shutil.which("apt-get"):
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        install = ["apt-get", "install", "-y", "-q", "shellcheck"]
        if run(install, env=env).returncode != 0:
            run(["apt-get", "update", "-q"], env=env)
            run(install, env=env)
    return shutil.which("shellcheck")


def test_the_launch_scripts_are_found() -> None:
    """The scripts the README documents are among the checked ones."""
    names = {p.relative_to(REPO).as_posix() for p in SCRIPTS}
    assert {"slurm/ray_on_slurm.slurm", "launch/local.sh", "launch/submit.sh"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_bash_parses(script: Path) -> None:
    """`bash -n` finds no syntax error."""
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True,
                            check=False)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_shellcheck_is_clean(script: Path) -> None:
    """shellcheck (all severities, bash dialect) reports nothing."""
    shellcheck = _shellcheck()
    if shellcheck is None:
        pytest.skip("shellcheck is not installed and could not be installed with apt-get")
    result = subprocess.run([shellcheck, "--shell=bash", str(script)], capture_output=True,
                            text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_scripts_are_executable(script: Path) -> None:
    """Users run them directly (`launch/local.sh ...`)."""
    assert os.access(script, os.X_OK), f"chmod +x {script.relative_to(REPO)}"


RAY_STARTERS = ("launch/local.sh", "slurm/ray_on_slurm.slurm")


@pytest.mark.parametrize("name", RAY_STARTERS)
def test_ray_workers_start_at_normal_priority(name: str) -> None:
    """Scripts that run `ray start` export RAY_worker_niceness=0 before it (ray_init.py's setting)."""
    lines = [line.strip() for line in (REPO / name).read_text().splitlines()]
    exports = [i for i, line in enumerate(lines) if line == "export RAY_worker_niceness=0"]
    starts = [i for i, line in enumerate(lines) if "ray start" in line.split("#")[0]]
    assert exports, f"{name}: add `export RAY_worker_niceness=0` (Ray's default niceness is 15)"
    assert starts and min(exports) < min(starts), f"{name}: export it before `ray start`"
