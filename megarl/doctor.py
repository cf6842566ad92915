"""``megarl doctor``: check the environment before a job burns GPU hours (PITFALLS S1, M3).

Each check prints one ``PASS`` / ``WARN`` / ``FAIL`` line; a failure carries its fix. The exit
code is 1 when any check failed. ``--report`` adds what a bug report needs (commit, command,
platform, resolved config).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata as md
import os
import platform
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from megarl.net import free_port

Status = Literal["PASS", "WARN", "FAIL"]

# package -> (tested range as (min inclusive, max exclusive) version tuples, required?, fix)
TESTED: dict[str, tuple[tuple[int, ...], tuple[int, ...], bool, str]] = {
    "torch": ((2, 6), (2, 15), True, "pip install torch==2.13.0 (CPU) or a CUDA build 2.6-2.14"),
    "megatron-core": ((0, 16), (0, 20), True, "pip install 'megatron-core>=0.16,<0.20'"),
    "mbridge": ((0, 15, 1), (0, 16), True, "pip install mbridge==0.15.1"),
    "ray": ((2, 40), (2, 61), True, "pip install 'ray[default]>=2.40,<2.61'"),
    "pydantic": ((2, 6), (3,), True, "pip install 'pydantic>=2.6,<3'"),
    "transformers": ((4, 57), (5, 30), True, "pip install 'transformers>=4.57,<5.30'"),
    "transformer-engine": ((2, 0), (3,), False,
                           "optional on GPU: pip install transformer-engine[pytorch]"),
    "sglang": ((0, 5, 4), (0, 6), False, "for rollout.backend=sglang: pip install 'megarl[sglang]'"),
    "nixl-cu12": ((1, 0), (2,), False, "for checkpoint_engine.backend=nixl: pip install nixl-cu12"),
}


@dataclass
class Check:
    """One line of the doctor's report."""

    status: Status
    name: str
    detail: str
    fix: str = ""

    def line(self) -> str:
        """The printed form: ``STATUS name: detail — fix``."""
        text = f"{self.status:4} {self.name}: {self.detail}"
        return f"{text} — {self.fix}" if self.fix and self.status != "PASS" else text


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def check_package(name: str) -> Check:
    """Installed version of ``name`` against its tested range."""
    low, high, required, fix = TESTED[name]
    try:
        version = md.version(name)
    except md.PackageNotFoundError:
        status: Status = "FAIL" if required else "WARN"
        return Check(status, name, "not installed", fix)
    rng = f"tested {'.'.join(map(str, low))} <= v < {'.'.join(map(str, high))}"
    if low <= _version_tuple(version) < high:
        return Check("PASS", name, f"{version} ({rng})")
    return Check("WARN", name, f"{version} is outside the tested range ({rng})", fix)


def check_python() -> Check:
    """Python >= 3.11."""
    if sys.version_info >= (3, 11):  # noqa: UP036 - the check reports an older interpreter
        return Check("PASS", "python", platform.python_version())
    return Check("FAIL", "python", platform.python_version(), "use Python 3.11 or newer")


def check_devices() -> list[Check]:
    """CUDA devices, driver and NCCL as torch sees them; no GPU is a warning, not a failure."""
    import torch

    if not torch.cuda.is_available():
        cuda_build = torch.version.cuda or "none (CPU build)"
        return [Check("WARN", "cuda", f"no CUDA device visible (torch CUDA: {cuda_build}); "
                      "megarl runs on CPU over gloo (development/CI mode)",
                      "on a GPU node install a CUDA build of torch and check nvidia-smi")]
    names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
    checks = [Check("PASS", "cuda", f"{torch.cuda.device_count()} x {', '.join(names)}, "
                    f"torch CUDA {torch.version.cuda}")]
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        checks.append(Check("PASS", "nccl", nccl))
    except Exception as err:  # noqa: BLE001 - report whatever torch raises
        checks.append(Check("FAIL", "nccl", f"unavailable ({err})", "install a torch with NCCL"))
    smi = shutil.which("nvidia-smi")
    if smi:
        out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=False)
        checks.append(Check("PASS", "driver", out.stdout.strip().splitlines()[0]
                            if out.returncode == 0 and out.stdout.strip() else "unknown"))
    return checks


def check_distributed() -> Check:
    """A one-process torch.distributed group initialises and an all-reduce runs."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return Check("PASS", "distributed", f"already initialised ({dist.get_backend()})")
    backend = _backend()
    try:
        with _one_process_group():
            value = torch.ones(1, device="cuda" if backend == "nccl" else "cpu")
            dist.all_reduce(value)
            ok = value.item() == 1.0
    except Exception as err:  # noqa: BLE001
        return Check("FAIL", "distributed", f"{backend} init failed: {err}",
                     "check NCCL/gloo installation and that 127.0.0.1 is usable")
    return Check("PASS" if ok else "FAIL", "distributed", f"one-process {backend} all-reduce")


def _backend() -> str:
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


@contextlib.contextmanager
def _one_process_group() -> Iterator[None]:
    """A torch.distributed group of this process alone (nccl on a GPU, else gloo), destroyed
    on the way out."""
    import torch.distributed as dist

    dist.init_process_group(_backend(), init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def check_layer_spec() -> Check:
    """Which Megatron layer spec the actor will use (TE when importable, else native)."""
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return Check("WARN", "layer_spec", "TransformerEngine not importable: megarl's native "
                     "spec will be used", "on GPU clusters install transformer-engine for the "
                     "TE spec (optional)")
    return Check("PASS", "layer_spec", "TransformerEngine spec")


def check_modules() -> Check:
    """The key modules instantiate (PITFALLS S1): a one-layer tiny Qwen3-MoE built as megarl's
    actor (megatron-core's GPTModel through mbridge, its weights loaded from an HF checkpoint)
    runs a forward in a one-process group, on the GPU where there is one."""
    import tempfile

    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return Check("WARN", "modules", "not checked: a process group already exists here")
    cuda = torch.cuda.is_available()
    try:
        from megarl.data.tiny_model import make_tiny_model
        from megarl.megatron.model import build_actor_model
        from megarl.megatron.parallel import ParallelSizes, destroy_parallel

        with tempfile.TemporaryDirectory(prefix="megarl-doctor-") as tmp:
            path = make_tiny_model(Path(tmp) / "model", arch="qwen3_moe", seed=0)
            with _one_process_group():
                try:
                    actor = build_actor_model(path, ParallelSizes(),
                                              torch.bfloat16 if cuda else torch.float32)
                    ids = torch.arange(8, device="cuda" if cuda else "cpu")[None]
                    logits = actor.chunks[0](input_ids=ids, position_ids=ids,
                                             attention_mask=None)
                    ok = bool(torch.isfinite(logits).all())
                finally:
                    destroy_parallel()
    except Exception as err:  # noqa: BLE001 - report whatever the stack raises
        return Check("FAIL", "modules", f"a tiny actor did not build or run: "
                     f"{type(err).__name__}: {err}", "install megatron-core, mbridge and "
                     "transformers within the tested ranges above (`pip install -e .`)")
    if not ok:
        return Check("FAIL", "modules", "a tiny actor's forward gave non-finite logits",
                     "check the torch build and the GPU (`megarl doctor --report` for the issue)")
    return Check("PASS", "modules", f"tiny MoE actor ({actor.spec} spec) built through mbridge "
                 f"and ran a forward on {'cuda' if cuda else 'cpu'}")


def check_ray() -> Check:
    """Whether a local Ray instance is already running (PITFALLS S2): any on this node, found
    through its raylet process as ``megarl train`` finds it (a Slurm job's too)."""
    try:
        import ray  # noqa: F401
    except ImportError:
        return Check("FAIL", "ray", "not importable", TESTED["ray"][3])
    from megarl.cluster.ray_init import find_local_ray

    running = find_local_ray()
    if running:
        ray_here = running[0]
        return Check("WARN", "ray", f"a Ray instance is already running on this node (GCS "
                     f"{ray_here.gcs_address}, raylet pid {ray_here.raylet_pid}, user "
                     f"{ray_here.user}); with ray.address null megarl attaches to it",
                     "set ray.address=local for a private instance, or `ray stop` it")
    return Check("PASS", "ray", "no running local instance; megarl will start one")


def check_disk(path: Path, min_gb: float = 10.0) -> Check:
    """Free space where outputs and checkpoints go."""
    target = path if path.exists() else Path.cwd()
    free_gb = shutil.disk_usage(target).free / 1e9
    if free_gb < min_gb:
        return Check("WARN", "disk", f"{free_gb:.1f} GB free at {target}",
                     "free space or set trainer.output_dir elsewhere")
    return Check("PASS", "disk", f"{free_gb:.1f} GB free at {target}")


def run_checks(output_dir: Path) -> list[Check]:
    """All checks in the order they are printed."""
    checks = [check_python()] + [check_package(name) for name in TESTED]
    checks += check_devices()
    checks += [check_distributed(), check_modules(), check_layer_spec(), check_ray(),
               check_disk(output_dir)]
    return checks


def git_commit(root: Path) -> str:
    """``HEAD`` of the megarl checkout, marked when the work tree has uncommitted changes."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                                  timeout=30, check=False).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = git("rev-parse", "HEAD")
    if not commit:
        return "unknown (not a git checkout)"
    return commit + (" (+ uncommitted changes)" if git("status", "--porcelain", "-uno") else "")


def report_gpus() -> list[str]:
    """CUDA build, driver and one line per visible GPU (name, memory)."""
    import torch

    lines = [f"cuda: torch {torch.__version__}, CUDA build {torch.version.cuda or 'none (CPU)'}"]
    smi = shutil.which("nvidia-smi")
    driver = "none (nvidia-smi not found)"
    if smi:
        out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=False)
        driver = out.stdout.strip().splitlines()[0] if out.returncode == 0 and (
            out.stdout.strip()) else "unknown (nvidia-smi failed)"
    lines.append(f"driver: {driver}")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not count:
        return [*lines, "gpus: none visible"]
    lines.append(f"gpus: {count}")
    for i in range(count):
        props = torch.cuda.get_device_properties(i)
        lines.append(f"  gpu {i}: {props.name}, {props.total_memory / 2**30:.1f} GiB")
    return lines


def report_header(argv: list[str]) -> list[str]:
    """Lines a bug report needs: commit, command, OS, Python, package versions, CUDA, GPUs."""
    root = Path(__file__).resolve().parent.parent
    versions = []
    for name in TESTED:
        try:
            versions.append(f"{name} {md.version(name)}")
        except md.PackageNotFoundError:
            versions.append(f"{name} not installed")
    return [f"megarl commit: {git_commit(root)}", f"command: megarl doctor {' '.join(argv)}",
            f"os: {platform.platform()}",
            f"python: {platform.python_version()} ({sys.executable})", f"versions: {', '.join(versions)}", *report_gpus(),
            f"host: {socket.gethostname()}", f"cpus: {os.cpu_count()}"]


def doctor_main(argv: list[str]) -> int:
    """``megarl doctor [--report] [--config CONFIG] [overrides]``."""
    parser = argparse.ArgumentParser(prog="megarl doctor")
    parser.add_argument("--report", action="store_true", help="add bug-report details")
    parser.add_argument("--config", help="a run config to resolve and print")
    parser.add_argument("overrides", nargs="*", help="a.b.c=value overrides for --config")
    args = parser.parse_intermixed_args(argv)
    if args.report:
        print("\n".join(report_header(argv)))
    output_dir = Path("outputs")
    checks = run_checks(output_dir)
    for check in checks:
        print(check.line())
    failed = [c for c in checks if c.status == "FAIL"]
    if args.config:
        from megarl.config import cli as config_cli

        print(f"\nresolved config ({args.config}):")
        config_cli.show_main([args.config, *args.overrides])
    counts = {status: sum(c.status == status for c in checks) for status in ("PASS", "WARN", "FAIL")}
    print(f"\n{len(checks)} checks: {counts['PASS']} pass, {counts['WARN']} warn, "
          f"{counts['FAIL']} fail")
    return 1 if failed else 0
