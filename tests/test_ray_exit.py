"""The test process's exit (tests/ray_exit.py): with Ray's driver threads alive it ends without
the interpreter's finalization, and its exit status is still pytest's (a failed test fails)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SESSION = '''
import ray

def test_ray_comes_and_goes():
    ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR")
    ray.shutdown()

def test_that_fails():
    assert False, "this one fails"
'''


def test_a_failed_test_still_fails_the_run_when_ray_threads_end_it(tmp_path: Path) -> None:
    (tmp_path / "test_session.py").write_text(SESSION)
    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(here), os.environ.get("PYTHONPATH")) if p)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "ray_exit",
                          "-p", "no:cacheprovider", str(tmp_path / "test_session.py")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180,
                         check=False)
    assert run.returncode == 1, (run.stdout[-2000:], run.stderr[-2000:])
    assert "1 failed, 1 passed" in run.stdout
    assert "ray_exit: Ray's driver threads are alive (" in run.stderr
    assert "exit 1 without the interpreter's finalization" in run.stderr
