"""Fixtures for the launcher tests: a real one-node Slurm cluster."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator

import pytest
from slurm_local import LocalSlurm, ensure_slurm_installed, make_root


@pytest.fixture(scope="module")
def local_slurm() -> Iterator[LocalSlurm]:
    """A running one-node Slurm (installed with apt-get when missing); skipped where impossible."""
    reason, install_s = ensure_slurm_installed()
    if reason:
        pytest.skip(f"real Slurm test skipped: {reason}")
    if install_s:
        print(f"\ninstalled Slurm + munge with apt-get in {install_s:.1f}s")
    root = make_root()
    cluster = LocalSlurm(root)
    start = time.monotonic()
    try:
        cluster.start()
    except (RuntimeError, OSError) as err:
        cluster.stop()
        pytest.skip(f"real Slurm test skipped: the Slurm daemons do not run here: {err}")
    print(f"\nlocal Slurm up in {time.monotonic() - start:.1f}s ({root})")
    yield cluster
    cluster.stop()
    shutil.rmtree(root, ignore_errors=True)
