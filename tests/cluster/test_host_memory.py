"""Reading a node's available host memory (megarl/cluster/preflight.py): ``MemAvailable``, or the
room a cgroup limit leaves (cgroup v2 and v1, the tightest level of the hierarchy), on file trees
written by the test."""

from __future__ import annotations

from pathlib import Path

from megarl.cluster.preflight import read_host_memory

GB = 2**30
V1_UNLIMITED = "9223372036854771712"


def meminfo(tmp_path: Path, available_gb: int, total_gb: int = 128) -> str:
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal:       {total_gb * GB // 1024} kB\nMemFree:        1024 kB\n"
                    f"MemAvailable:   {available_gb * GB // 1024} kB\nHugePages_Total:       0\n")
    return str(path)


def cgroup(directory: Path, files: dict[str, object]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, value in files.items():
        (directory / name).write_text(f"{value}\n")


def test_meminfo_without_a_cgroup_limit(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("0::/user.slice/session-1.scope\n")
    root = tmp_path / "fs"
    cgroup(root / "user.slice" / "session-1.scope", {"memory.max": "max", "memory.current": GB})
    assert read_host_memory(meminfo(tmp_path, 100), str(proc), str(root)) == (
        100 * GB, 128 * GB, "MemAvailable")
    assert read_host_memory(meminfo(tmp_path, 100), str(tmp_path / "none"), str(root))[0] == (
        100 * GB)


def test_a_v2_limit_on_an_ancestor_counts_its_reclaimable_cache(tmp_path):
    """A Slurm job's --mem sits on the job's cgroup, above the step this process runs in."""
    proc = tmp_path / "cgroup"
    proc.write_text("0::/slurm/job_7/step_0\n")
    root = tmp_path / "fs"
    job = root / "slurm" / "job_7"
    cgroup(job, {"memory.max": 64 * GB, "memory.current": 40 * GB,
                 "memory.stat": f"anon {30 * GB}\ninactive_file {6 * GB}\nactive_file 1\n"})
    cgroup(job / "step_0", {"memory.max": "max", "memory.current": 39 * GB})
    available, total, source = read_host_memory(meminfo(tmp_path, 100), str(proc), str(root))
    assert (available, total) == (30 * GB, 64 * GB)
    assert source == str(job / "memory.max")


def test_a_v1_memory_controller_wins_over_the_unified_line(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/pod/ctr\n1:cpu:/\n0::/\n")
    root = tmp_path / "fs"
    cgroup(root / "memory", {"memory.limit_in_bytes": V1_UNLIMITED,
                             "memory.usage_in_bytes": 90 * GB})
    cgroup(root / "memory" / "pod", {"memory.limit_in_bytes": 16 * GB,
                                     "memory.usage_in_bytes": 10 * GB,
                                     "memory.stat": f"total_inactive_file {GB}\n"})
    cgroup(root / "memory" / "pod" / "ctr", {"memory.limit_in_bytes": V1_UNLIMITED,
                                             "memory.usage_in_bytes": 9 * GB})
    assert read_host_memory(meminfo(tmp_path, 100), str(proc), str(root))[:2] == (7 * GB, 16 * GB)
    # a limit above what the machine has available leaves MemAvailable in charge
    cgroup(root / "memory" / "pod", {"memory.limit_in_bytes": 512 * GB})
    assert read_host_memory(meminfo(tmp_path, 100), str(proc), str(root))[2] == "MemAvailable"
