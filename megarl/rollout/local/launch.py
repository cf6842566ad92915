"""Starting embedded-engine servers as processes (the ``local`` rollout backend)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from megarl.rollout.process import ManagedServer, free_port, start_all


def build_local_command(model_path: str, *, host: str = "127.0.0.1", port: int = 30000,
                        device: str | None = None, num_threads: int | None = None,
                        extra_args: Sequence[str] = (), python: str = sys.executable) -> list[str]:
    """The argv of ``python -m megarl.rollout.local.server`` for one engine."""
    argv = [python, "-m", "megarl.rollout.local.server", "--model", model_path,
            "--host", host, "--port", str(port)]
    if device is not None:
        argv += ["--device", device]
    if num_threads is not None:
        argv += ["--num-threads", str(num_threads)]
    return argv + list(extra_args)


def launch_local_engines(model_path: str, num_engines: int = 1, *, host: str = "127.0.0.1",
                         ports: Sequence[int] | None = None, device: str | None = None,
                         num_threads: int | None = None, extra_args: Sequence[str] = (),
                         log_dir: str | Path | None = None,
                         ready_timeout_s: float = 300.0) -> list[ManagedServer]:
    """Start ``num_engines`` embedded servers and wait until each is healthy."""
    ports = list(ports) if ports is not None else [free_port(host) for _ in range(num_engines)]
    servers = [
        ManagedServer(build_local_command(model_path, host=host, port=port, device=device,
                                          num_threads=num_threads, extra_args=extra_args),
                      f"http://{host}:{port}", name=f"engine[{i}]",
                      log_path=Path(log_dir) / f"engine_{i}.log" if log_dir else None)
        for i, port in enumerate(ports)
    ]
    return start_all(servers, ready_timeout_s)
