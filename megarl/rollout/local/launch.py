"""Starting embedded-engine servers as processes (the ``local`` rollout backend).

The API key reaches a server through the environment variable :data:`API_KEY_ENV`, never its
command line (which every user of the machine can read in the process list).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from megarl.config.schema_common import is_loopback_host
from megarl.net import free_port
from megarl.rollout.process import ManagedServer, start_all

API_KEY_ENV = "MEGARL_ROLLOUT_API_KEY"
"""Environment variable holding the key an embedded server requires (``rollout.api_key``)."""

__all__ = ["API_KEY_ENV", "build_local_command", "is_loopback_host", "launch_local_engines",
           "local_server"]


def build_local_command(model_path: str, *, host: str = "127.0.0.1", port: int = 30000,
                        device: str | None = None, num_threads: int | None = None,
                        seed: int | None = None, extra_args: Sequence[str] = (),
                        python: str = sys.executable) -> list[str]:
    """The argv of ``python -m megarl.rollout.local.server`` for one engine; a ``seed`` asks
    for reproducible sampling (``--random-seed`` and ``--enable-deterministic-inference``,
    without which the engine ignores ``sampling_seed``, as SGLang does)."""
    argv = [python, "-m", "megarl.rollout.local.server", "--model", model_path,
            "--host", host, "--port", str(port)]
    if device is not None:
        argv += ["--device", device]
    if num_threads is not None:
        argv += ["--num-threads", str(num_threads)]
    if seed is not None:
        argv += ["--random-seed", str(seed), "--enable-deterministic-inference"]
    return argv + list(extra_args)


def local_server(argv: Sequence[str], url: str, *, name: str, log_path: str | Path | None,
                 api_key: str | None = None) -> ManagedServer:
    """A :class:`ManagedServer` for an embedded-engine command, with the API key (if any) in its
    environment and in its health probes."""
    env = {API_KEY_ENV: api_key} if api_key else None
    return ManagedServer(argv, url, name=name, env=env, log_path=log_path, api_key=api_key)


def launch_local_engines(model_path: str, num_engines: int = 1, *, host: str = "127.0.0.1",
                         ports: Sequence[int] | None = None, device: str | None = None,
                         num_threads: int | None = None, seed: int | None = None,
                         extra_args: Sequence[str] = (), log_dir: str | Path | None = None,
                         api_key: str | None = None,
                         ready_timeout_s: float = 300.0) -> list[ManagedServer]:
    """Start ``num_engines`` embedded servers and wait until each is healthy (``seed``: see
    :func:`build_local_command`)."""
    ports = list(ports) if ports is not None else [free_port(host) for _ in range(num_engines)]
    servers = [
        local_server(build_local_command(model_path, host=host, port=port, device=device,
                                         num_threads=num_threads, seed=seed,
                                         extra_args=extra_args),
                     f"http://{host}:{port}", name=f"engine[{i}]", api_key=api_key,
                     log_path=Path(log_dir) / f"engine_{i}.log" if log_dir else None)
        for i, port in enumerate(ports)
    ]
    return start_all(servers, ready_timeout_s)
