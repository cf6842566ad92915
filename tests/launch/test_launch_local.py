"""launch/local.sh and launch/submit.sh against real Ray heads on this machine (about 45 s).

One local.sh run starts a private head with a dashboard and holds it (its probe waits on a file);
the other tests attach to that head, submit a Ray job to it, and run the Slurm script's join check
against it. At the end the held run is released and must leave no Ray process behind.
"""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from launch_helpers import PROBE, REPO, job_env, processes_mentioning, ray_port_env

from megarl.config import load_config

LOCAL = REPO / "launch" / "local.sh"
SUBMIT = REPO / "launch" / "submit.sh"
CONFIG = "configs/tiny-moe-cpu.yaml"
PROBE_COMMAND = f"python {PROBE.relative_to(REPO)}"


@dataclass
class HeldRay:
    """A local.sh run whose probe finished and now holds its private Ray head."""

    proc: subprocess.Popen
    env: dict[str, str]
    out_dir: Path
    temp_dir: Path

    @property
    def output(self) -> str:
        """What local.sh printed so far."""
        return (self.out_dir.parent / "local.out").read_text()

    @property
    def hold_file(self) -> Path:
        """While this file exists the held probe keeps waiting."""
        return self.out_dir / "hold"

    @property
    def gcs_port(self) -> str:
        """The head's GCS port."""
        return self.env["RAY_PORT"]


def _wait_for(path: Path, held: HeldRay, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if held.proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{path} not written (local.sh rc={held.proc.poll()}):\n"
                                 f"{held.output}")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def held_ray() -> Iterator[HeldRay]:
    """local.sh starting its own head (dashboard on), with its probe holding the head open."""
    root = Path(tempfile.mkdtemp(prefix="rl-"))  # short: Ray's socket paths must fit 107 bytes
    ports = ray_port_env()
    env = job_env(MEGARL_CMD=PROBE_COMMAND, RAY_AUTH_TOKEN=secrets.token_hex(32),
                  RAY_DASHBOARD_PORT=ports.pop("RAY_CLIENT_SERVER_PORT"), NUM_CPUS="2",
                  RAY_TEMP_DIR=str(root / "ray"), **ports)
    (root / "run").mkdir()
    (root / "run" / "hold").touch()
    with open(root / "local.out", "w") as log:  # a file, not a pipe: a full pipe would block Ray
        proc = subprocess.Popen([str(LOCAL), CONFIG, f"trainer.output_dir={root / 'run'}"],
                                env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    held = HeldRay(proc, env, root / "run", root / "ray")
    try:
        _wait_for(held.out_dir / "probe.json", held, timeout_s=180)
        yield held
    finally:
        held.hold_file.unlink(missing_ok=True)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.terminate()
            proc.wait(timeout=30)
        shutil.rmtree(root, ignore_errors=True)


def test_local_sh_starts_a_private_head_and_passes_it_to_the_command(held_ray: HeldRay) -> None:
    """The command got ray.address/ray.num_cpus of the head it started, and ran its tasks there."""
    probe = json.loads((held_ray.out_dir / "probe.json").read_text())
    assert probe["config"]["ray.address"] == f"127.0.0.1:{held_ray.gcs_port}"
    assert probe["config"]["ray.num_cpus"] == 2
    assert [n["cpus"] for n in probe["nodes"]] == [2.0]
    assert sorted(r["value"] for r in probe["results"]) == [0, 1]
    # Workers run at the command's priority, not Ray's default niceness 15.
    assert {r["niceness"] for r in probe["results"]} == {probe["driver_niceness"]}


def test_local_sh_attaches_to_a_running_ray(held_ray: HeldRay, tmp_path: Path) -> None:
    """A second run finds the head on RAY_PORT, says it attaches, and starts no head of its own."""
    env = dict(held_ray.env, RAY_AUTH_MODE="token",
               RAY_TEMP_DIR=str(tmp_path / "unused"))
    result = subprocess.run([str(LOCAL), CONFIG, f"trainer.output_dir={tmp_path}"], env=env,
                            cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"attaching to the Ray already running on 127.0.0.1:{held_ray.gcs_port}" in result.stdout
    assert "starting a private Ray head" not in result.stdout
    assert not (tmp_path / "unused").exists()
    probe = json.loads((tmp_path / "probe.json").read_text())
    assert probe["config"]["ray.address"] == f"127.0.0.1:{held_ray.gcs_port}"
    # An attach adds no ray.num_cpus: the YAML's value stays.
    assert probe["config"]["ray.num_cpus"] == load_config(REPO / CONFIG)[0].ray.num_cpus


def test_local_sh_refuses_a_port_held_by_a_ray_it_cannot_reach(held_ray: HeldRay,
                                                               tmp_path: Path) -> None:
    """Without the head's token the port looks like a stale Ray: a message with the fixes."""
    env = dict(held_ray.env, RAY_AUTH_TOKEN="0" * 64, RAY_AUTH_MODE="token")
    result = subprocess.run([str(LOCAL), CONFIG, f"trainer.output_dir={tmp_path}"], env=env,
                            cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 1
    assert f"port {held_ray.gcs_port} is in use, but not by a Ray this script can reach" in (
        result.stderr)
    assert "set RAY_PORT to a free port" in result.stderr
    assert not (tmp_path / "probe.json").exists()


def test_submit_sh_runs_the_command_as_a_ray_job(held_ray: HeldRay, tmp_path: Path) -> None:
    """`ray job submit` uploads the repo; the job attaches with ray.address=auto and runs tasks."""
    env = dict(held_ray.env, RAY_AUTH_MODE="token",
               RAY_ADDRESS=f"http://127.0.0.1:{held_ray.env['RAY_DASHBOARD_PORT']}")
    result = subprocess.run([str(SUBMIT), CONFIG, f"trainer.output_dir={tmp_path}"], env=env,
                            cwd=REPO, capture_output=True, text=True, timeout=180, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "succeeded" in result.stdout
    probe = json.loads((tmp_path / "probe.json").read_text())
    assert probe["argv"] == ["--config", CONFIG, "ray.address=auto",
                             f"trainer.output_dir={tmp_path}"]
    assert sorted(r["value"] for r in probe["results"]) == [0, 1]


def test_submit_sh_rejects_a_config_outside_the_repository(tmp_path: Path) -> None:
    """The job would not see it: the message says to copy it into the repository."""
    outside = tmp_path / "mine.yaml"
    outside.write_text((REPO / CONFIG).read_text())
    result = subprocess.run([str(SUBMIT), str(outside)], env=job_env(RAY_ADDRESS="http://x:1"),
                            capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 1
    assert f"config {outside} is outside {REPO}" in result.stderr


def _join_check(held_ray: HeldRay, nodes: dict[str, str], timeout_s: int
                ) -> subprocess.CompletedProcess:
    """Run the Slurm script's JOIN_CHECK_PY against the held head."""
    code = subprocess.run(["bash", "-c", 'source "$1"; printf %s "$JOIN_CHECK_PY"', "_",
                           str(REPO / "slurm" / "ray_on_slurm.slurm")],
                          capture_output=True, text=True, check=True).stdout
    address = f"127.0.0.1:{held_ray.gcs_port}"
    pairs = [f"{name}={ip}" for name, ip in nodes.items()]
    return subprocess.run(["python", "-c", code, address, str(timeout_s), *pairs],
                          env=dict(held_ray.env, RAY_AUTH_MODE="token"), capture_output=True,
                          text=True, timeout=120, check=False)


def test_slurm_join_check_names_the_nodes_that_did_not_join(held_ray: HeldRay) -> None:
    """All present: exit 0. A node that never starts Ray: exit 1 naming it, after the timeout."""
    node = json.loads((held_ray.out_dir / "probe.json").read_text())["nodes"][0]
    joined = _join_check(held_ray, {"n1": node["ip"]}, timeout_s=5)
    assert joined.returncode == 0, joined.stderr
    assert "all 1 nodes joined the Ray cluster" in joined.stdout

    start = time.monotonic()
    missing = _join_check(held_ray, {"n1": node["ip"], "n2": "10.255.255.1"}, timeout_s=3)
    assert missing.returncode == 1
    assert time.monotonic() - start >= 3
    assert "nodes missing from the Ray cluster" in missing.stderr
    assert "n2 (10.255.255.1)" in missing.stderr and "n1 (" not in missing.stderr


def test_local_sh_stops_only_its_own_head_at_exit(held_ray: HeldRay) -> None:
    """Released, the held run exits 0 and no process using its temp dir remains (runs last)."""
    held_ray.hold_file.unlink()
    assert held_ray.proc.wait(timeout=90) == 0
    output = held_ray.output
    assert "starting a private Ray head on 127.0.0.1:" in output
    assert "stopping the private Ray head" in output
    deadline = time.monotonic() + 15
    while processes_mentioning(str(held_ray.temp_dir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not processes_mentioning(str(held_ray.temp_dir))
