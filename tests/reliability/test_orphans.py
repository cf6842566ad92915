"""A SIGKILLed driver leaves no process behind (issue 20, item 5; about 20 s).

A driver script starts a reward pool, one embedded server and the manager process of megatron's
checkpoint writer results (which megatron would start so that it outlives a killed rank), each
from a short-lived thread
(the kernel's parent-death signal follows the thread that forked, so this checks megarl forks
from one that lives on), says it is ready, and sleeps. The test collects the driver's descendants
(pool workers, the multiprocessing resource tracker, the server), checks they are alive, SIGKILLs
the driver, and requires every one of them gone within 10 s.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from megarl.children import die_with_parent

DRIVER = """
import sys, threading, time

from megarl.reward.pool import TimedProcessPool
from megarl.rollout.local.launch import launch_local_engines


def square(x):
    return x * x


if __name__ == "__main__":
    made = {}
    def start():
        made["pool"] = TimedProcessPool(2)
        assert made["pool"].run(square, [(3,)], [30.0]) == [9]
        made["servers"] = launch_local_engines(sys.argv[1], 1, num_threads=1,
                                               ready_timeout_s=300)
        # the manager process of megatron's checkpoint writer results (made at the first save)
        from megatron.core.dist_checkpointing.strategies import filesystem_async
        from megarl.megatron.checkpoint import write_results_queue_dies_with_this_process
        made["manager"] = write_results_queue_dies_with_this_process()
        assert filesystem_async._get_write_results_queue() is filesystem_async._results_queue
    thread = threading.Thread(target=start)
    thread.start()
    thread.join()
    time.sleep(1.0)  # children forked by an exited thread would be dying now
    print("ready", flush=True)
    time.sleep(600)
"""


def _alive(pids: list[int]) -> list[str]:
    """``pid name`` of the processes in ``pids`` still running (zombies count as gone)."""
    found = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE:
                found.append(f"{pid} {' '.join(proc.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            pass
    return found


def test_children_die_with_a_sigkilled_driver(model_dir: Path, tmp_path: Path) -> None:
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [
        str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")])))
    driver = subprocess.Popen([sys.executable, str(script), str(model_dir)], env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert driver.stdout is not None and driver.stdout.readline().strip() == "ready"
        children = psutil.Process(driver.pid).children(recursive=True)
        pids = [child.pid for child in children]
        alive = _alive(pids)
        # two workers, the resource tracker, the server, the checkpoint writers' manager
        assert len(pids) >= 5, alive
        assert len(alive) == len(pids), f"children died before the driver: {pids} {alive}"
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait(30)
    deadline = time.monotonic() + 10.0
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _alive(pids)
    for line in left:  # do not leave them to the next test either
        os.kill(int(line.split()[0]), signal.SIGKILL)
    assert not left, f"alive 10 s after the driver's SIGKILL: {left}"


def test_die_with_parent_arms_the_signal_on_linux() -> None:
    code = ("import ctypes, sys; from megarl.children import die_with_parent; "
            "ok = die_with_parent(); sig = ctypes.c_int(); "
            "ctypes.CDLL(None).prctl(2, ctypes.byref(sig)); print(ok, sig.value)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    if sys.platform.startswith("linux"):
        assert out == ["True", str(int(signal.SIGKILL))]
    else:
        assert out[0] == "False" and die_with_parent is not None
