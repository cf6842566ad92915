"""The Slurm script's functions, sourced into bash with a given environment (about 2 s).

These cover the cases one single-node Slurm cannot show: GPU counts in Slurm's spellings,
interface choice, separate rollout nodes, containers, and the errors outside a job.
"""

from __future__ import annotations

import ipaddress
import os
import subprocess

import pytest
from launch_helpers import REPO

from megarl.config import load_config

SCRIPT = REPO / "slurm" / "ray_on_slurm.slurm"
CONFIG = REPO / "configs" / "tiny-moe-cpu.yaml"
CLEAN_ENV = {k: v for k, v in os.environ.items()
             if not k.startswith(("SLURM_", "RAY_", "NCCL_", "CONTAINER_", "ROLLOUT_"))}


def bash(code: str, **env: str) -> subprocess.CompletedProcess:
    """Run ``code`` in bash after sourcing the Slurm script (which then does not run main)."""
    return subprocess.run(["bash", "-c", f'source "{SCRIPT}"\n{code}'], env={**CLEAN_ENV, **env},
                          capture_output=True, text=True, timeout=30, check=False)


def lines(code: str, **env: str) -> list[str]:
    """The output lines of ``code``; fails on a non-zero exit."""
    result = bash(code, **env)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


@pytest.mark.parametrize(("env", "expected"), [
    ({"SLURM_GPUS_PER_NODE": "8"}, "8"),
    ({"SLURM_GPUS_PER_NODE": "h100:4"}, "4"),
    ({"SLURM_GPUS_PER_NODE": "gpu:a100:2", "SLURM_GPUS_ON_NODE": "8"}, "2"),
    ({"SLURM_GPUS_ON_NODE": "6"}, "6"),
    ({}, "0"),
])
def test_gpus_per_node_reads_slurms_spellings(env: dict[str, str], expected: str) -> None:
    """--gpus-per-node=N or type:N, else the node's GPU count, else 0 (a CPU job)."""
    assert lines("gpus_per_node", **env) == [expected]


def test_gpus_per_node_rejects_an_unreadable_count() -> None:
    """A count it cannot read stops the job with the form to use."""
    result = bash("gpus_per_node", SLURM_GPUS_PER_NODE="h100:lots")
    assert result.returncode == 1
    assert "request GPUs as --gpus-per-node=N" in result.stderr


def test_cpus_per_node_ignores_omp_num_threads() -> None:
    """Outside an allocation it counts the CPUs, not OMP_NUM_THREADS (which nproc honours)."""
    assert lines("cpus_per_node", SLURM_CPUS_PER_TASK="48") == ["48"]
    assert lines("cpus_per_node", OMP_NUM_THREADS="1") == [str(len(os.sched_getaffinity(0)))]


@pytest.mark.parametrize(("env", "expected"), [
    ({"RAY_NETWORK_INTERFACE": "ib0", "NCCL_SOCKET_IFNAME": "eth0"}, "ib0"),
    ({"NCCL_SOCKET_IFNAME": "=eth1,eth2"}, "eth1"),
    ({"NCCL_SOCKET_IFNAME": "^docker,lo"}, ""),
    ({}, ""),
])
def test_network_interface_prefers_ray_then_nccl(env: dict[str, str], expected: str) -> None:
    """RAY_NETWORK_INTERFACE wins; NCCL's exact (=) form is used, its exclusion (^) form is not."""
    assert lines("network_interface", **env) == [expected]


def test_node_ip_on_an_interface_and_by_default_route() -> None:
    """On `lo` the loopback address; without an interface, an IPv4 address of this machine."""
    assert lines("node_ip lo") == ["127.0.0.1"]
    default = lines("node_ip ''")
    assert len(default) == 1 and ipaddress.ip_address(default[0]).version == 4


def _overrides(nnodes: int, gpus: int, **env: str) -> list[str]:
    code = (f'HEAD_ADDRESS=10.0.0.1:6379 RAY_CPUS=64\nset_train_overrides {nnodes} {gpus}\n'
            'printf "%s\\n" "${OVERRIDES[@]}"')
    return lines(code, **env)


def test_overrides_of_a_gpu_allocation_with_separate_rollout_nodes() -> None:
    """4 nodes x 8 GPUs with ROLLOUT_NODES=1: 3 train nodes, 1 rollout node, each 8 GPUs."""
    assert _overrides(4, 8, ROLLOUT_NODES="1") == [
        "resources.train_pool.nnodes=3", "resources.device=cuda",
        "resources.train_pool.gpus_per_node=8", "resources.rollout_pool.nnodes=1",
        "resources.rollout_pool.gpus_per_node=8", "ray.address=10.0.0.1:6379",
        "ray.num_cpus=64"]


def test_overrides_of_a_cpu_allocation_keep_the_yamls_processes_per_node() -> None:
    """Without GPUs: device=cpu and the node count only."""
    assert _overrides(2, 0) == ["resources.train_pool.nnodes=2", "resources.device=cpu",
                                "ray.address=10.0.0.1:6379", "ray.num_cpus=64"]


def test_overrides_are_fields_megarls_loader_accepts() -> None:
    """Every key the script passes exists in the config schema and lands where it should."""
    overrides = _overrides(3, 8, ROLLOUT_NODES="1")
    cfg, sources = load_config(CONFIG, overrides)
    assert cfg.resources.train_pool.nnodes == 2 and cfg.resources.train_pool.gpus_per_node == 8
    assert cfg.resources.rollout_pool.nnodes == 1 and cfg.resources.device == "cuda"
    assert cfg.ray.address == "10.0.0.1:6379" and cfg.ray.num_cpus == 64
    assert all(sources[o.split("=")[0]] == "override" for o in overrides)


def test_rollout_nodes_must_leave_a_train_node() -> None:
    """ROLLOUT_NODES equal to the job's nodes is an error naming both numbers."""
    result = bash("HEAD_ADDRESS=x:1 RAY_CPUS=1; set_train_overrides 2 8", ROLLOUT_NODES="2")
    assert result.returncode == 1
    assert "ROLLOUT_NODES=2 leaves no node for the train pool of this 2-node job" in result.stderr


def _container(gpus: int, **env: str) -> list[str]:
    code = (f'GPUS={gpus}; set_container_args\n'
            'printf "srun %s\\n" "${SRUN_CONTAINER[@]}"; printf "exec %s\\n" "${EXEC_CONTAINER[@]}"')
    return [line for line in lines(code, SLURM_SUBMIT_DIR="/work/x", **env)
            if line not in ("srun ", "exec ")]


def test_container_apptainer_prefixes_commands() -> None:
    """Apptainer: `apptainer exec` with the submit dir bound, --nv on GPU jobs, image last."""
    assert _container(8, CONTAINER_IMAGE="/img/megarl.sif", CONTAINER_MOUNTS="/data:/data") == [
        "exec apptainer", "exec exec", "exec --bind", "exec /work/x:/work/x,/data:/data",
        "exec --pwd", "exec /work/x", "exec --nv", "exec /img/megarl.sif"]
    assert "exec --nv" not in _container(0, CONTAINER_IMAGE="/img/megarl.sif")


def test_container_pyxis_adds_srun_flags() -> None:
    """Pyxis/enroot: srun flags, no command prefix."""
    assert _container(8, CONTAINER_IMAGE="nvcr.io#me/megarl:1", CONTAINER_RUNTIME="pyxis") == [
        "srun --container-image=nvcr.io#me/megarl:1", "srun --container-mounts=/work/x:/work/x",
        "srun --container-workdir=/work/x"]


def test_no_container_and_an_unknown_runtime() -> None:
    """No image: nothing added. An unknown runtime: an error naming the supported ones."""
    assert _container(8) == []
    result = bash("GPUS=0; set_container_args", CONTAINER_IMAGE="x", CONTAINER_RUNTIME="docker")
    assert result.returncode == 1 and "use apptainer or pyxis" in result.stderr


def test_ray_auth_defaults_to_a_fresh_token_and_respects_the_users_choice() -> None:
    """Unset: token mode with a new 64-hex-digit token; a mode the user set is left alone."""
    mode, token = lines('set_ray_auth; echo "$RAY_AUTH_MODE"; echo "$RAY_AUTH_TOKEN"')
    assert mode == "token" and len(token) == 64 and int(token, 16) >= 0
    assert lines('set_ray_auth; echo "$RAY_AUTH_MODE:${RAY_AUTH_TOKEN:-}"',
                 RAY_AUTH_MODE="disabled") == ["disabled:"]
    assert lines('set_ray_auth; echo "$RAY_AUTH_TOKEN"', RAY_AUTH_TOKEN="abc") == ["abc"]


def test_main_outside_a_job_and_without_config_says_how_to_submit() -> None:
    """Run by hand it explains sbatch; in a job without CONFIG it names the variable."""
    outside = subprocess.run(["bash", str(SCRIPT)], env=CLEAN_ENV, capture_output=True,
                             text=True, check=False)
    assert outside.returncode == 1 and "not inside a Slurm job" in outside.stderr
    no_config = subprocess.run(["bash", str(SCRIPT)], env={**CLEAN_ENV, "SLURM_JOB_ID": "7"},
                               capture_output=True, text=True, check=False)
    assert no_config.returncode == 1 and "CONFIG is not set" in no_config.stderr
    missing = subprocess.run(["bash", str(SCRIPT)], cwd=REPO, capture_output=True, text=True,
                             env={**CLEAN_ENV, "SLURM_JOB_ID": "7", "CONFIG": "configs/nope.yaml"},
                             check=False)
    assert missing.returncode == 1 and "CONFIG=configs/nope.yaml is not a file" in missing.stderr
