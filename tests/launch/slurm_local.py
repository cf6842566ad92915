"""A real one-node Slurm cluster (munged, slurmctld, slurmd) living in a temporary directory.

Follows ../shared/reference/SLURM_LOCAL.md, but keeps every file (munge key and socket, slurm.conf,
state, spool, logs) in its own directory instead of /etc and /run, listens on free ports, and
stops only the daemons it started, by PID.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from megarl.net import free_port

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
COMMANDS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "scancel")
TERMINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                   "BOOT_FAIL", "DEADLINE", "PREEMPTED"}
PARTITION = "megarl-test"


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    """Run a command, capturing text output; the caller checks the return code."""
    return subprocess.run(cmd, check=False, capture_output=True, text=True, **kwargs)


def _missing_commands() -> list[str]:
    return [cmd for cmd in COMMANDS if shutil.which(cmd) is None]


def ensure_slurm_installed() -> tuple[str | None, float]:
    """Install Debian's Slurm + munge when missing; (reason Slurm is unusable or None, seconds)."""
    start = time.monotonic()
    if not _missing_commands():
        return None, 0.0
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return (f"Slurm commands {_missing_commands()} are missing and cannot be installed here "
                "(needs root and apt-get)"), 0.0
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    result = run(install, env=env)
    if result.returncode != 0:  # the package lists may be missing or stale
        run(["apt-get", "update", "-q"], env=env)
        result = run(install, env=env)
    seconds = time.monotonic() - start
    if result.returncode != 0 or _missing_commands():
        tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        return f"apt-get could not install {' '.join(PACKAGES)}: {' | '.join(tail)}", seconds
    return None, seconds


def _memory_mb() -> int:
    with open("/proc/meminfo") as f:
        total_kb = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    return total_kb // 1024


@dataclass
class LocalSlurm:
    """munged + slurmctld + slurmd for this host, configured under ``root``."""

    root: Path
    node: str = field(default_factory=lambda: socket.gethostname().split(".")[0])
    cpus: int = field(default_factory=lambda: os.cpu_count() or 1)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        """The cluster's slurm.conf."""
        return self.root / "slurm" / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """The environment for Slurm client commands (sbatch, squeue, scontrol) of this cluster."""
        return dict(os.environ, SLURM_CONF=str(self.conf))

    def _write_munge(self) -> Path:
        munge = self.root / "munge"
        munge.mkdir(mode=0o700)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        for path in (munge, key):
            shutil.chown(path, "munge", "munge")
        return munge

    def _write_slurm_conf(self, munge_socket: Path) -> None:
        slurm = self.root / "slurm"
        for sub in ("state", "spool"):
            (slurm / sub).mkdir(parents=True)
        memory = int(_memory_mb() * 0.8)
        self.conf.write_text("\n".join([
            "ClusterName=megarltest",
            f"SlurmctldHost={self.node}",
            f"SlurmctldPort={free_port('')}",
            f"SlurmdPort={free_port('')}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={munge_socket}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SlurmUser=root",
            "SlurmdUser=root",
            "ReturnToService=2",
            "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "MinJobAge=600",
            f"StateSaveLocation={slurm / 'state'}",
            f"SlurmdSpoolDir={slurm / 'spool'}",
            f"SlurmctldPidFile={slurm / 'slurmctld.pid'}",
            f"SlurmdPidFile={slurm / 'slurmd.pid'}",
            f"SlurmctldLogFile={slurm / 'slurmctld.log'}",
            f"SlurmdLogFile={slurm / 'slurmd.log'}",
            f"NodeName={self.node} CPUs={self.cpus} RealMemory={memory} State=UNKNOWN",
            f"PartitionName={PARTITION} Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
        ]) + "\n")

    def start(self, timeout_s: float = 60.0) -> None:
        """Start the three daemons and wait until the node is idle."""
        munge = self._write_munge()
        munge_socket = munge / "munged.sock"
        self.procs["munged"] = subprocess.Popen(
            ["munged", "--foreground", "--force", f"--key-file={munge / 'munge.key'}",
             f"--socket={munge_socket}", f"--pid-file={munge / 'munged.pid'}",
             f"--log-file={munge / 'munged.log'}", f"--seed-file={munge / 'munged.seed'}"],
            user="munge", group="munge", stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        self._wait(lambda: munge_socket.exists(), timeout_s, "munged socket")
        self._write_slurm_conf(munge_socket)
        log = open(self.root / "daemons.out", "ab")  # noqa: SIM115 (closed with the daemons)
        self.procs["slurmctld"] = subprocess.Popen(
            ["slurmctld", "-D", "-i", "-f", str(self.conf)], stdout=log, stderr=subprocess.STDOUT)
        self.procs["slurmd"] = subprocess.Popen(
            ["slurmd", "-D", "-f", str(self.conf), "-N", self.node], stdout=log,
            stderr=subprocess.STDOUT)
        log.close()
        self._wait(lambda: self.node_state() == "idle", timeout_s, f"node {self.node} idle")

    def _wait(self, ready: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            dead = [name for name, proc in self.procs.items() if proc.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"local Slurm: {what} not reached (exited: {dead}); logs in "
                                   f"{self.root}:\n{self.logs()}")
            time.sleep(0.5)

    def node_state(self) -> str:
        """The node's state as sinfo prints it (idle, mixed, down, ...), '' when unknown."""
        result = run(["sinfo", "-h", "-N", "-o", "%T"], env=self.env)
        return result.stdout.strip().rstrip("*~#") if result.returncode == 0 else ""

    def logs(self) -> str:
        """The tail of every daemon log, for failure messages."""
        parts = []
        for path in [*sorted((self.root / "slurm").glob("*.log")),
                     self.root / "munge" / "munged.log", self.root / "daemons.out"]:
            if path.exists():
                parts.append(f"--- {path}\n" + "\n".join(path.read_text().splitlines()[-20:]))
        return "\n".join(parts)

    def sbatch(self, args: list[str], env: dict[str, str], cwd: Path) -> str:
        """Submit a batch job from ``cwd`` with ``env``; return its job id."""
        result = run(["sbatch", "--parsable", *args], env={**env, "SLURM_CONF": str(self.conf)},
                     cwd=cwd)
        if result.returncode != 0:
            raise RuntimeError(f"sbatch failed: {result.stderr.strip()}")
        return result.stdout.strip().split(";")[0]

    def job_fields(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, ExitCode, NodeList, ...)."""
        result = run(["scontrol", "show", "job", "-o", job_id], env=self.env)
        fields: dict[str, str] = {}
        for token in result.stdout.split():
            key, _, value = token.partition("=")
            fields.setdefault(key, value)
        return fields

    def wait_job(self, job_id: str, timeout_s: float) -> dict[str, str]:
        """Wait until the job ends; return its final fields, or cancel it on timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            fields = self.job_fields(job_id)
            if fields.get("JobState") in TERMINAL_STATES:
                return fields
            if time.monotonic() > deadline:
                run(["scancel", job_id], env=self.env)
                raise TimeoutError(f"job {job_id} did not finish in {timeout_s:.0f}s "
                                   f"(state {fields.get('JobState')}); cancelled")
            time.sleep(1)

    def stop(self) -> None:
        """Cancel this cluster's jobs, then stop its daemons (by PID, newest first)."""
        if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            run(["scancel", "--partition", PARTITION], env=self.env)
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def make_root() -> Path:
    """A fresh directory the munge user can traverse (pytest's tmp_path is private to root)."""
    root = Path(tempfile.mkdtemp(prefix="slurm-"))
    root.chmod(0o755)
    return root
