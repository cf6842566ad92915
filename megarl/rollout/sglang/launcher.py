"""Command lines for SGLang servers and the SGLang router, and launching them.

:func:`build_sglang_command` is a pure function from :class:`SGLangLaunchConfig` to argv, with
the flags RL needs (shared/reference/SGLANG_API.md); :func:`launch_sglang_engines` checks that
``sglang`` is installed (:class:`SGLangNotInstalled` says how to install it otherwise), starts one
process per engine and waits for ``/health_generate``.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from megarl.rollout.process import ManagedServer, start_all

INSTALL_HINT = ("install it on the rollout nodes with `pip install \"sglang[all]>=0.5.4\"` "
                "(or `pip install -e '.[sglang]'` in the megarl checkout, which also installs "
                "sglang-router), or set rollout.backend=local to use megarl's embedded engine")


class SGLangNotInstalled(RuntimeError):
    """The ``sglang`` (or ``sglang_router``) package is missing from the launch interpreter."""


@dataclass(frozen=True)
class SGLangLaunchConfig:
    """One SGLang server (one engine, possibly spanning several GPUs or nodes)."""

    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    tp_size: int = 1
    dp_size: int = 1
    ep_size: int = 1
    pp_size: int = 1
    enable_dp_attention: bool = False
    mem_fraction_static: float | None = 0.7
    enable_memory_saver: bool = False
    """Needed for release/resume memory (colocated training)."""
    enable_weights_cpu_backup: bool = False
    """Released weights wait in host memory; without it ``/release_memory_occupation`` drops
    them and the next weight sync must resend them all (the LoRA adapter sync does not)."""
    skip_tokenizer_init: bool = True
    """Token ids in and out, as megarl's client sends them."""
    enable_return_routed_experts: bool = False
    """Routed experts per token (R3)."""
    load_format: str | None = None
    """``dummy`` when the weights come from the trainer."""
    weight_version: str | None = None
    enable_deterministic_inference: bool = False
    """Honour ``sampling_seed`` (SGLang ignores it otherwise); on whenever ``random_seed`` is
    set, since a seed asks for reproducible samples."""
    skip_server_warmup: bool = False
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    base_gpu_id: int = 0
    nccl_port: int | None = None
    enable_metrics: bool = False
    dtype: str | None = None
    enable_lora: bool = False
    """Serve LoRA adapters loaded at run time (``/load_lora_adapter_from_tensors``)."""
    max_lora_rank: int | None = None
    lora_target_modules: tuple[str, ...] = ()
    """HF projection names adapters may sit on (SGLang sizes its LoRA buffers for them)."""
    quantization: str | None = None
    """``fp8`` with a block-FP8 ``quantization_config`` in the model's config.json
    (:func:`fp8_serving_dir`): the server holds fp8 weights + ``weight_scale_inv``."""
    context_length: int | None = None
    max_running_requests: int | None = None
    max_prefill_tokens: int | None = None
    """Prompt tokens one prefill step may take (SGLang's default 16384)."""
    chunked_prefill_size: int | None = None
    """Prompts longer than this prefill in chunks (-1: never; None: SGLang's choice)."""
    random_seed: int | None = None
    """The server's seed; also turns on ``enable_deterministic_inference``."""
    trust_remote_code: bool = False
    log_level: str | None = None
    extra_args: tuple[str, ...] = field(default_factory=tuple)
    """Further ``sglang.launch_server`` arguments, passed verbatim at the end."""

    @property
    def url(self) -> str:
        """The server's base URL."""
        return f"http://{self.host}:{self.port}"


def build_sglang_command(cfg: SGLangLaunchConfig, python: str = sys.executable) -> list[str]:
    """The argv of ``python -m sglang.launch_server`` for ``cfg``."""
    argv = [python, "-m", "sglang.launch_server", "--model-path", cfg.model_path,
            "--host", cfg.host, "--port", str(cfg.port), "--tp-size", str(cfg.tp_size)]
    sizes = (("--dp-size", cfg.dp_size), ("--ep-size", cfg.ep_size), ("--pp-size", cfg.pp_size))
    argv += [a for flag, size in sizes if size != 1 for a in (flag, str(size))]
    optional = (("--mem-fraction-static", cfg.mem_fraction_static),
                ("--load-format", cfg.load_format), ("--weight-version", cfg.weight_version),
                ("--dtype", cfg.dtype), ("--quantization", cfg.quantization),
                ("--context-length", cfg.context_length),
                ("--max-running-requests", cfg.max_running_requests),
                ("--max-prefill-tokens", cfg.max_prefill_tokens),
                ("--chunked-prefill-size", cfg.chunked_prefill_size),
                ("--random-seed", cfg.random_seed), ("--nccl-port", cfg.nccl_port),
                ("--max-lora-rank", cfg.max_lora_rank),
                ("--log-level", cfg.log_level))
    argv += [a for flag, value in optional if value is not None for a in (flag, str(value))]
    if cfg.base_gpu_id:
        argv += ["--base-gpu-id", str(cfg.base_gpu_id)]
    if cfg.nnodes > 1:
        if not cfg.dist_init_addr:
            raise ValueError("dist_init_addr: required when nnodes > 1 (host:port of node 0)")
        argv += ["--nnodes", str(cfg.nnodes), "--node-rank", str(cfg.node_rank),
                 "--dist-init-addr", cfg.dist_init_addr]
    switches = (("--enable-dp-attention", cfg.enable_dp_attention),
                ("--enable-memory-saver", cfg.enable_memory_saver),
                ("--enable-weights-cpu-backup", cfg.enable_weights_cpu_backup),
                ("--skip-tokenizer-init", cfg.skip_tokenizer_init),
                ("--enable-return-routed-experts", cfg.enable_return_routed_experts),
                ("--enable-deterministic-inference",
                 cfg.enable_deterministic_inference or cfg.random_seed is not None),
                ("--skip-server-warmup", cfg.skip_server_warmup),
                ("--enable-metrics", cfg.enable_metrics),
                ("--trust-remote-code", cfg.trust_remote_code),
                ("--enable-lora", cfg.enable_lora))
    argv += [flag for flag, on in switches if on]
    if cfg.lora_target_modules:
        argv += ["--lora-target-modules", *cfg.lora_target_modules]
    return argv + list(cfg.extra_args)


WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.safetensors.index.json", "*.bin.index.json")


def fp8_serving_dir(model_path: str | Path, dest: str | Path,
                    ignored: Sequence[str] = ()) -> Path:
    """A directory SGLang serves as a block-FP8 model with ``--load-format dummy``: every file
    of ``model_path`` but the weights linked, and config.json with the block-FP8
    ``quantization_config`` (docs/fp8.md: SGLang builds fp8 ``weight`` + ``weight_scale_inv``
    parameters only for an FP8-serialized config; the trainer's first sync fills them).
    ``ignored``: its ``ignored_layers`` (modules SGLang keeps in the model dtype)."""
    import json

    from megarl.weights.fp8 import QUANTIZATION_CONFIG

    source, dest = Path(model_path), Path(dest)
    config = json.loads((source / "config.json").read_text())
    existing = config.get("quantization_config")
    if existing and existing.get("quant_method") != "fp8":
        raise ValueError(f"{source}/config.json: quantization_config {existing} is not fp8; "
                         "rollout.quantization=fp8 needs a bf16 or block-FP8 checkpoint")
    config["quantization_config"] = dict(QUANTIZATION_CONFIG)
    if ignored:
        config["quantization_config"]["ignored_layers"] = list(ignored)
    dest.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        target = dest / item.name
        if item.name == "config.json" or any(item.match(p) for p in WEIGHT_FILES):
            continue
        if not target.exists():
            target.symlink_to(item.resolve())
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return dest


def build_router_command(worker_urls: Sequence[str], *, host: str = "127.0.0.1",
                         port: int = 30000, policy: str = "cache_aware",
                         python: str = sys.executable) -> list[str]:
    """The argv of ``python -m sglang_router.launch_router`` over ``worker_urls``."""
    policies = ("cache_aware", "round_robin", "random", "power_of_two")
    if policy not in policies:
        raise ValueError(f"policy: {policy!r} must be one of {policies}")
    return [python, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls,
            "--policy", policy, "--host", host, "--port", str(port)]


def require_module(module: str, python: str = sys.executable) -> None:
    """Raise :class:`SGLangNotInstalled` unless ``python`` can import ``module``."""
    if python == sys.executable:
        found = importlib.util.find_spec(module) is not None
    else:
        probe = ("import importlib.util, sys; "
                 f"sys.exit(importlib.util.find_spec({module!r}) is None)")
        found = subprocess.run([python, "-c", probe], capture_output=True,
                               check=False).returncode == 0
    if not found:
        raise SGLangNotInstalled(f"the sglang rollout backend needs the `{module}` package, "
                                 f"which {python} cannot import; {INSTALL_HINT}")


def launch_sglang_engines(configs: Sequence[SGLangLaunchConfig], *,
                          log_dir: str | Path | None = None, python: str = sys.executable,
                          ready_timeout_s: float = 1800.0) -> list[ManagedServer]:
    """Start one SGLang server per config and wait until each passes ``/health_generate``."""
    require_module("sglang", python)
    servers = [
        ManagedServer(build_sglang_command(cfg, python), cfg.url, name=f"sglang[{i}]",
                      log_path=Path(log_dir) / f"sglang_{i}.log" if log_dir else None,
                      health_path="/health_generate")
        for i, cfg in enumerate(configs)
    ]
    return start_all(servers, ready_timeout_s)


def launch_router(worker_urls: Sequence[str], *, host: str = "127.0.0.1", port: int = 30000,
                  policy: str = "cache_aware", log_dir: str | Path | None = None,
                  python: str = sys.executable, ready_timeout_s: float = 120.0) -> ManagedServer:
    """Start the SGLang router over running workers and wait for its ``/health``."""
    require_module("sglang_router", python)
    router = ManagedServer(
        build_router_command(worker_urls, host=host, port=port, policy=policy, python=python),
        f"http://{host}:{port}", name="sglang-router",
        log_path=Path(log_dir) / "sglang_router.log" if log_dir else None)
    router.start()
    router.wait_ready(ready_timeout_s)
    return router
