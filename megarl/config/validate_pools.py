"""Validation rules of the pools, the schedulers and the transports: colocation, the pools a
scheduler needs, the weight-sync backend, the rollout servers' binding, the device settings."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

from megarl.config.problems import Context, Problem, error, warning
from megarl.config.schema_common import is_loopback_host


def check_pools_and_colocation(ctx: Context) -> Iterator[Problem]:
    """Colocated engines use the train pool; separate pools need a rollout_pool."""
    rollout, resources = ctx.cfg.rollout, ctx.cfg.resources
    if rollout.colocate and resources.rollout_pool is not None:
        yield error(("rollout.colocate", "resources.rollout_pool"), "colocated engines run on the "
                    "train pool, so resources.rollout_pool would be ignored",
                    "set rollout.colocate=false to use the separate pool, or remove "
                    "resources.rollout_pool")
    if not rollout.colocate and resources.rollout_pool is None:
        yield error(("rollout.colocate", "resources.rollout_pool"), "separate engines need a "
                    "rollout pool", "add resources.rollout_pool (nnodes, gpus_per_node) or set "
                    "rollout.colocate=true")


def check_scheduler_needs_separate_pools(ctx: Context) -> Iterator[Problem]:
    """one_step_off and fully_async overlap rollout with training, so they need two pools and
    Ray; fully_async's queue must hold at least one step."""
    cfg = ctx.cfg
    mode, sched = cfg.scheduler.mode, cfg.scheduler
    if mode != "colocate_sync" and cfg.rollout.colocate:
        yield error(("scheduler.mode", "rollout.colocate"), f"{mode} overlaps generation with "
                    "training, which needs engines on their own GPUs: a colocated engine gives "
                    "its weights and KV cache back while the actor trains, so it cannot generate "
                    "then (on one GPU, colocate_sync is the only schedule; the pools cannot share "
                    "a GPU)", "set rollout.colocate=false with a resources.rollout_pool on other "
                    "GPUs, or scheduler.mode=colocate_sync")
    if mode != "colocate_sync" and cfg.trainer.worker_group == "naive":
        yield error(("scheduler.mode", "trainer.worker_group"), f"{mode} generates on a "
                    "background thread next to Ray workers; the no-Ray mode runs colocate_sync "
                    "only", "set trainer.worker_group=ray or scheduler.mode=colocate_sync")
    step = cfg.data.train_batch_size * cfg.rollout.n
    if mode == "fully_async" and sched.max_queue_length is not None and (
            sched.max_queue_length < step):
        yield error(("scheduler.max_queue_length", "data.train_batch_size", "rollout.n"),
                    f"the queue holds {sched.max_queue_length} samples but a step consumes "
                    f"{step}, so the trainer would wait forever",
                    f"set scheduler.max_queue_length >= {step}, or null")


def check_weight_sync_backend(ctx: Context) -> Iterator[Problem]:
    """ipc needs colocation; nccl cannot serve colocated engines on GPUs; nixl needs the NIXL
    package."""
    backend = ctx.cfg.checkpoint_engine.backend
    if backend == "nccl" and ctx.cfg.rollout.colocate and ctx.cfg.resources.device != "cpu":
        yield error(("checkpoint_engine.backend", "rollout.colocate"), "a colocated engine shares "
                    "its GPU with a train rank, and NCCL refuses two ranks of one group on one "
                    "GPU ('Duplicate GPU detected')",
                    "use checkpoint_engine.backend=ipc (or auto), which hands the engine CUDA "
                    "IPC handles")
    if backend == "ipc" and not ctx.cfg.rollout.colocate:
        yield error(("checkpoint_engine.backend", "rollout.colocate"), "ipc moves weights inside "
                    "one machine's shared memory, but the engines are on a separate pool",
                    "use checkpoint_engine.backend=nccl (or auto)")
    if backend == "nixl" and not any(importlib.util.find_spec(m) for m in ("nixl", "nixl_cu12")):
        yield error("checkpoint_engine.backend", "the NIXL package is not installed",
                    "pip install nixl-cu12, or use checkpoint_engine.backend=nccl")


def check_rollout_bind_needs_api_key(ctx: Context) -> Iterator[Problem]:
    """Engines reachable beyond this machine must require an API key: their weight-update
    endpoints replace the model (and ``update_weights_from_tensor`` unpickles its input)."""
    rollout = ctx.cfg.rollout
    if not is_loopback_host(rollout.host) and not rollout.api_key:
        yield error(("rollout.host", "rollout.api_key"),
                    f"host {rollout.host} opens the engines' generation, control and "
                    "weight-update endpoints to the network without an API key",
                    "set rollout.api_key (e.g. from a secret: rollout.api_key=$KEY) or "
                    "rollout.host=127.0.0.1")


def check_device_settings(ctx: Context) -> Iterator[Problem]:
    """SGLang needs CUDA; CPU runs are meant for fp32."""
    cfg = ctx.cfg
    if cfg.resources.device != "cpu":
        return
    if cfg.rollout.backend == "sglang":
        yield error(("rollout.backend", "resources.device"), "SGLang engines need CUDA GPUs",
                    "set rollout.backend=local on CPU")
    if cfg.model.dtype != "float32":
        yield warning(("model.dtype", "resources.device"), f"{cfg.model.dtype} on CPU is slow and "
                      "some CPU kernels need aligned strides", "set model.dtype=float32 on CPU")
    processes = cfg.resources.train_pool.world_size + (0 if cfg.rollout.colocate else (
        cfg.resources.rollout_pool.world_size if cfg.resources.rollout_pool else 0))
    if cfg.ray.num_cpus is not None and cfg.ray.num_cpus < processes:
        yield warning(("ray.num_cpus", "resources"), f"{processes} worker processes but Ray may "
                      f"use {cfg.ray.num_cpus} CPUs; workers wait for a free CPU",
                      f"set ray.num_cpus={processes} or more")


def check_sglang_only_settings(ctx: Context) -> Iterator[Problem]:
    """SGLang's own flags (chunked prefill, verbatim server flags) have no embedded-engine
    counterpart: refused with the local backend rather than dropped."""
    rollout = ctx.cfg.rollout
    if rollout.backend != "local":
        return
    if rollout.chunked_prefill_size is not None:
        yield error(("rollout.chunked_prefill_size", "rollout.backend"), "the embedded engine "
                    "prefills each prompt whole (no chunked prefill)", "remove "
                    "rollout.chunked_prefill_size, or lower rollout.max_prefill_tokens to bound "
                    "a prefill step; chunked prefill needs rollout.backend=sglang")
    if rollout.sglang_args:
        yield error(("rollout.sglang_args", "rollout.backend"), f"{rollout.sglang_args} are "
                    "SGLang server flags; the embedded engine (rollout.backend=local) takes none",
                    "remove rollout.sglang_args, or set rollout.backend=sglang")
