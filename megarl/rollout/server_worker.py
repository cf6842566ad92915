"""The rollout-pool role: one ``RolloutServerWorker`` per engine, placed by Ray.

The worker runs where its placement-group bundle is (a GPU node of the rollout pool, or a CPU
slot) and starts the engine's HTTP server there as a child process: SGLang's
``launch_server`` for ``rollout.backend=sglang``, megarl's embedded server for ``local``. The
trainer talks to the servers over HTTP with :class:`~megarl.rollout.sglang.SGLangClient`; the
worker only starts, watches and restarts its server (:meth:`RolloutServerWorker.restart` is the
``restart`` step of :class:`~megarl.rollout.recovery.EngineRecovery` under Ray).

``rollout.api_key`` reaches an embedded server through its environment; SGLang only takes
``--api-key`` on its command line.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from megarl.cluster.worker import Worker, host_ip
from megarl.net import free_port
from megarl.rollout.local.launch import build_local_command, local_server
from megarl.rollout.process import ManagedServer


@dataclass(frozen=True)
class EngineSpec:
    """How to start one rollout engine (from the ``rollout`` config section)."""

    model_path: str
    backend: str = "local"
    host: str = "127.0.0.1"
    dtype: str = "auto"
    max_running_requests: int | None = None
    """Sequences the engine runs at once (``rollout.max_num_seqs``, ``auto`` resolved); None
    leaves the engine's default."""
    seed: int | None = 0
    """Run seed: engines start with it and with ``--enable-deterministic-inference`` so that
    ``sampling_seed`` is honoured (samples reproducible); None leaves sampling unseeded."""
    num_threads: int | None = 1
    gpus_per_engine: int = 1
    mem_fraction: float | None = 0.7
    return_routed_experts: bool = False
    colocated: bool = False
    log_dir: str = "outputs/logs"
    sglang_args: tuple[str, ...] = field(default_factory=tuple)
    """More SGLang flags, verbatim (``rollout.sglang_args``)."""
    max_prefill_tokens: int | None = None
    """Prompt tokens one prefill step may take (``rollout.max_prefill_tokens``); None leaves the
    engine's default."""
    chunked_prefill_size: int | None = None
    """SGLang's ``--chunked-prefill-size`` (``rollout.chunked_prefill_size``)."""
    api_key: str | None = field(default=None, repr=False)
    """Key the server requires on every endpoint (``rollout.api_key``); never printed."""
    trust_remote_code: bool = False
    """Let the engine load custom code shipped with the model (``model.trust_remote_code``)."""
    enable_lora: bool = False
    """Serve LoRA adapters (``actor.lora.sync: adapter``): ``--enable-lora``, for SGLang with
    ``--max-lora-rank`` and ``--lora-target-modules`` from the two fields below."""
    lora_rank: int = 0
    lora_modules: tuple[str, ...] = ()
    load_format: str = "auto"
    """``dummy``: the engine starts from random weights without reading the checkpoint
    (``rollout.load_format``); the trainer syncs before the first generation."""
    quantization: str | None = None
    """``fp8``: the engine holds its projections in block FP8 (``rollout.quantization``;
    docs/fp8.md); SGLang starts from dummy weights, which the trainer's first sync replaces."""
    fp8_ignored: tuple[str, ...] = ()
    """Modules an FP8 engine keeps in its dtype (``rollout.fp8_attention``): the embedded
    server's ``--fp8-ignored-layers``, SGLang's config.json ``ignored_layers``."""


def local_engine_args(spec: EngineSpec) -> list[str]:
    """The embedded server's arguments for the settings every device shares."""
    extra = ["--dtype", spec.dtype]
    if spec.trust_remote_code:
        extra.append("--trust-remote-code")
    if spec.quantization:
        extra += ["--quantization", spec.quantization]
    if spec.fp8_ignored:
        extra += ["--fp8-ignored-layers", *spec.fp8_ignored]
    if spec.load_format != "auto":
        extra += ["--load-format", spec.load_format]
    if spec.max_prefill_tokens is not None:
        extra += ["--max-prefill-tokens", str(spec.max_prefill_tokens)]
    if spec.enable_lora:  # the adapter sync never resends the base: released weights wait
        extra += ["--enable-lora", "--enable-weights-cpu-backup"]  # in host memory
    return extra


def engine_command(spec: EngineSpec, *, rank: int, port: int, device: str) -> list[str]:
    """The argv that starts the engine of ``rank`` (the embedded server or SGLang's)."""
    if spec.backend == "local":
        extra = local_engine_args(spec)
        if spec.mem_fraction is not None and device == "cuda":
            extra += ["--mem-fraction-static", str(spec.mem_fraction)]
        if spec.max_running_requests:
            extra += ["--max-running-requests", str(spec.max_running_requests)]
        seed = None if spec.seed is None else spec.seed + rank
        return build_local_command(spec.model_path, host=spec.host, port=port,
                                   device="cuda" if device == "cuda" else "cpu",
                                   num_threads=spec.num_threads, seed=seed, extra_args=extra)
    from megarl.rollout.sglang.launcher import (
        SGLangLaunchConfig,
        build_sglang_command,
        fp8_serving_dir,
    )

    model_path = spec.model_path
    load_format = None if spec.load_format == "auto" else spec.load_format
    if spec.quantization == "fp8":  # an FP8-serialized config, weights from the first sync
        model_path = str(fp8_serving_dir(spec.model_path,
                                         Path(spec.log_dir) / f"fp8_model_engine{rank}",
                                         ignored=spec.fp8_ignored))
        load_format = "dummy"
    launch = SGLangLaunchConfig(
        model_path=model_path, host=spec.host, port=port, tp_size=spec.gpus_per_engine,
        quantization=spec.quantization, load_format=load_format,
        enable_lora=spec.enable_lora, max_lora_rank=spec.lora_rank or None,
        lora_target_modules=spec.lora_modules if spec.enable_lora else (),
        mem_fraction_static=spec.mem_fraction, enable_memory_saver=spec.colocated,
        enable_weights_cpu_backup=spec.colocated and spec.enable_lora,
        enable_return_routed_experts=spec.return_routed_experts,
        enable_deterministic_inference=spec.seed is not None, random_seed=spec.seed,
        dtype=None if spec.dtype == "auto" else spec.dtype,
        max_running_requests=spec.max_running_requests,
        max_prefill_tokens=spec.max_prefill_tokens,
        chunked_prefill_size=spec.chunked_prefill_size,
        trust_remote_code=spec.trust_remote_code)
    argv = build_sglang_command(launch) + list(spec.sglang_args)
    return argv + ["--api-key", spec.api_key] if spec.api_key else argv


class RolloutServerWorker(Worker):
    """Starts and supervises the HTTP server of one rollout engine."""

    def __init__(self, spec: EngineSpec) -> None:
        self.server: ManagedServer | None = None
        if self.rank % spec.gpus_per_engine:
            return  # a follower GPU of a multi-GPU engine: its leader's server uses it
        host = spec.host if spec.host != "0.0.0.0" else host_ip()
        port = free_port(spec.host)
        log = Path(spec.log_dir) / f"rollout_engine{self.rank}.log"
        argv = engine_command(spec, rank=self.rank, port=port, device=self.info.device)
        if spec.backend == "local":
            self.server = local_server(argv, f"http://{host}:{port}", name=f"engine[{self.rank}]",
                                       log_path=log, api_key=spec.api_key)
        else:
            self.server = ManagedServer(argv, f"http://{host}:{port}",
                                        name=f"engine[{self.rank}]", log_path=log,
                                        api_key=spec.api_key)
        self.server.start()

    def wait_ready(self, timeout_s: float = 600.0) -> str | None:
        """Block until the server answers its health check; returns its URL (None on a
        follower rank, which runs no server)."""
        if self.server is None:
            return None
        self.server.wait_ready(timeout_s)
        return self.server.url

    def restart(self, urls: Sequence[str] | None = None, timeout_s: float = 600.0) -> bool:
        """Restart this rank's server if its URL is in ``urls`` (all when None): stop what is
        left of it, start it on the same port, wait until it is healthy. It serves the weights
        on disk until the trainer re-syncs it. Returns whether it restarted (never on a
        follower rank)."""
        if self.server is None or (urls is not None and self.server.url not in urls):
            return False
        self.server.restart(stop_timeout_s=5.0)
        self.server.wait_ready(timeout_s)
        return True

    def alive(self) -> bool:
        """Whether the server process is running (a follower rank is always alive)."""
        return self.server is None or self.server.alive

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of the server's log."""
        return self.server.log_tail(lines) if self.server is not None else ""

    def stop(self) -> None:
        """Stop the server process."""
        if self.server is not None:
            self.server.stop()
