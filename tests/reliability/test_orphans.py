"""A SIGKILLed driver leaves no process behind (issue 20, item 5, about 20 s; issue 28, item 4).

A driver script starts a reward pool, one embedded server and the manager process of megatron's
checkpoint writer results (which megatron would start so that it outlives a killed rank), each
from a short-lived thread
(the kernel's parent-death signal follows the thread that forked, so this checks megarl forks
from one that lives on), says it is ready, and sleeps. The test collects the driver's descendants
(pool workers, the multiprocessing resource tracker, the server), checks they are alive, SIGKILLs
the driver, and requires every one of them gone within 10 s.

A second driver, in a process session of its own, starts a local Ray the way ``megarl train``
does (with one worker group of one rank): 60 s after its SIGKILL, no process of that session may
be left. Ray's agents (``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``) used to outlive it by
more than a minute, reparented to init.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from megarl.children import die_with_parent

REPO = Path(__file__).resolve().parents[2]

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
        str(REPO), os.environ.get("PYTHONPATH")])))
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


RAY_DRIVER = """
import sys

from cluster_workers import EchoWorker

from megarl.cluster import create_resource_pool, init_ray, RayWorkerGroup

if __name__ == "__main__":
    init_ray("local", num_cpus=1)  # as `megarl train` does, with ray.address: local
    pool = create_resource_pool("train_pool", 1, 1, "cpu", cpus_per_bundle=0.5)
    group = RayWorkerGroup(EchoWorker, pool, "train", log_dir=sys.argv[1], call_timeout_s=60)
    assert group.execute_all("echo", 1) == [(0, (1,), {})]
    print("ready", flush=True)
    sys.stdin.read()  # until the test kills it
"""


def _session(sid: int) -> list[psutil.Process]:
    """The live (not zombie) processes of process session ``sid``."""
    found = []
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == sid and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (OSError, psutil.Error):
            pass
    return found


def _describe(procs: list[psutil.Process]) -> list[str]:
    """``pid cmdline`` of each process (cut to 160 characters)."""
    lines = []
    for proc in procs:
        try:
            lines.append(f"{proc.pid} {' '.join(' '.join(proc.cmdline()).split())[:160]}")
        except psutil.Error:
            lines.append(f"{proc.pid} (gone)")
    return lines


def _read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    """The first line ``proc`` writes to its stdout pipe, or what it wrote when it exited or
    ``timeout_s`` passed without a whole line."""
    assert proc.stdout is not None
    fd, out = proc.stdout.fileno(), b""
    deadline = time.monotonic() + timeout_s
    while b"\n" not in out and (left := deadline - time.monotonic()) > 0:
        if select.select([fd], [], [], left)[0]:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            out += chunk
    return out.decode(errors="replace")


def test_local_ray_dies_with_a_sigkilled_driver(tmp_path: Path) -> None:
    script = tmp_path / "ray_driver.py"
    script.write_text(RAY_DRIVER)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [
        str(REPO), str(REPO / "tests" / "cluster"), os.environ.get("PYTHONPATH")])))
    stderr = tmp_path / "ray_driver.err"
    with stderr.open("wb") as err:
        driver = subprocess.Popen([sys.executable, str(script), str(tmp_path / "logs")],
                                  env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=err, start_new_session=True)
    sid = driver.pid
    left: list[str] = []
    try:
        line = _read_line(driver, 180.0)
        assert line.strip() == "ready", \
            f"the driver did not start Ray: {line!r}\n{stderr.read_text()[-3000:]}"
        running = " ".join(_describe(_session(sid)))
        assert "raylet" in running and "gcs_server" in running, running
        started = time.monotonic()
        driver.kill()
        driver.wait(30)
        deadline = started + 60.0
        while _session(sid) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = _describe(_session(sid))
        print(f"{len(left)} processes of the session left {time.monotonic() - started:.1f} s "
              "after the driver's SIGKILL")
    finally:
        driver.kill()
        driver.wait(30)
        for proc in _session(sid):  # do not leave them to the next test
            try:
                proc.kill()
            except psutil.Error:
                pass
    assert not left, f"alive 60 s after the driver's SIGKILL: {left}"
