"""Starting what a run needs: Ray, the two pools, actor workers, rollout engines, weight sync.

:func:`build_workers` turns a run config into a :class:`Workers` bundle that the trainer drives;
:func:`shutdown_workers` stops everything it started. The weight sync set up here follows
SGLang's distributed protocol (``/init_weights_update_group`` once, then one
``/update_weights_from_distributed`` per bucket while actor rank 0 broadcasts the tensors), so
the same code serves SGLang servers and megarl's embedded engines.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megarl.config import RunConfig
from megarl.megatron.optimizer import OptimizerSettings
from megarl.megatron.parallel import ParallelSizes
from megarl.megatron.update import LossSettings
from megarl.megatron.worker import DTYPES, ActorSpec, ActorWorker
from megarl.rollout.server_worker import EngineSpec, RolloutServerWorker
from megarl.rollout.sglang import SGLangClient


@dataclass
class Workers:
    """The running parts of a job and what the trainer needs to address them."""

    actor: Any
    rollout: Any
    client: SGLangClient
    dp_size: int
    dp_rank: list[int]
    """Data-parallel rank of each actor rank."""
    reports: list[bool]
    """Whether an actor rank returns results for its data-parallel group."""
    num_rollout_gpus: int
    weight_sync: Callable[[str], int]
    """Push the actor's weights to every engine under a version string; returns bytes sent."""
    started_ray: bool = False


def actor_spec(cfg: RunConfig) -> ActorSpec:
    """The ActorWorker's settings from the config."""
    a, p = cfg.actor, cfg.actor.parallel
    sizes = ParallelSizes(tp=p.tp, pp=p.pp, vpp=p.vpp, ep=p.ep, etp=p.etp, cp=p.cp,
                          sequence_parallel=p.sequence_parallel if p.tp > 1 else None)
    mini_batches = -(-cfg.data.train_batch_size // a.ppo_mini_batch_size)
    optim = OptimizerSettings(
        lr=a.optim.lr, weight_decay=a.optim.weight_decay, betas=tuple(a.optim.betas),
        lr_warmup_steps=a.optim.lr_warmup_steps, lr_decay_style=a.optim.lr_decay_style,
        min_lr=a.optim.min_lr, total_steps=cfg.trainer.total_steps * mini_batches * a.ppo_epochs,
        grad_clip=a.grad_clip, use_distributed_optimizer=a.use_distributed_optimizer)
    loss = LossSettings(
        loss_mode=a.policy_loss.loss_mode, clip_ratio_low=a.clip_ratio_low,
        clip_ratio_high=a.clip_ratio_high, clip_ratio_c=a.clip_ratio_c,
        loss_agg_mode=a.loss_agg_mode, entropy_coeff=a.entropy_coeff,
        use_kl_loss=a.use_kl_loss, kl_loss_coef=a.kl_loss_coef, kl_loss_type=a.kl_loss_type)
    seq_len = cfg.data.max_prompt_length + cfg.data.max_response_length
    if a.use_dynamic_bsz:
        budget = a.ppo_max_token_len_per_gpu
    else:
        micro = a.ppo_micro_batch_size_per_gpu or a.ppo_micro_batch_size or 1
        budget = micro * seq_len
    return ActorSpec(model_path=cfg.model.path, dtype=cfg.model.dtype, sizes=sizes, optim=optim,
                     loss=loss, with_ref=bool(cfg.ref.enabled),
                     temperature=cfg.rollout.temperature or 1.0,
                     max_tokens_per_micro_batch=budget, seed=cfg.trainer.seed)


def engine_spec(cfg: RunConfig, log_dir: Path) -> EngineSpec:
    """The RolloutServerWorker's settings from the config."""
    r = cfg.rollout
    max_seqs = None if r.max_num_seqs == "auto" else int(r.max_num_seqs)
    return EngineSpec(model_path=cfg.model.path, backend=r.backend, host=r.host,
                      dtype=r.dtype or cfg.model.dtype, max_running_requests=max_seqs,
                      seed=cfg.trainer.seed, log_dir=str(log_dir),
                      gpus_per_engine=r.gpus_per_engine, mem_fraction=r.gpu_memory_utilization,
                      return_routed_experts=bool(r.enable_return_routed_experts),
                      colocated=r.colocate)


def plan_buckets(specs: list[tuple[str, list[int]]], dtype: str,
                 bucket_size_mb: int) -> list[list[tuple[str, list[int]]]]:
    """Group tensors in export order into buckets of at most ``bucket_size_mb`` (a larger
    tensor gets a bucket of its own)."""
    limit = bucket_size_mb * 2**20
    itemsize = DTYPES[dtype].itemsize
    buckets: list[list[tuple[str, list[int]]]] = [[]]
    used = 0
    for name, shape in specs:
        size = itemsize
        for dim in shape:
            size *= dim
        if buckets[-1] and used + size > limit:
            buckets.append([])
            used = 0
        buckets[-1].append((name, shape))
        used += size
    return [b for b in buckets if b]


def _weight_sync(cfg: RunConfig, actor: Any, client: SGLangClient, loop: asyncio.AbstractEventLoop,
                 num_engines: int, device: str) -> Callable[[str], int]:
    """Open the weight-update group and return the per-step sync function."""
    backend = "nccl" if device == "cuda" else "gloo"
    dtype = cfg.rollout.dtype or cfg.model.dtype
    buckets = plan_buckets(actor.execute_all("weight_specs")[0], dtype,
                           cfg.checkpoint_engine.bucket_size_mb)
    address, port = actor.execute_all("weight_group_address")[0]
    opening = actor.execute_all_async("open_weight_group", address, port, 1 + num_engines,
                                      backend)
    loop.run_until_complete(client.init_weights_update_group(address, port, 1 + num_engines,
                                                             backend=backend))
    opening.get(phase="open the weight-update group")

    def sync(version: str) -> int:
        sending = actor.execute_all_async("broadcast_weights", dtype)
        for k, bucket in enumerate(buckets):
            last = k == len(buckets) - 1
            loop.run_until_complete(client.update_weights_from_distributed(
                [n for n, _ in bucket], [dtype] * len(bucket), [s for _, s in bucket],
                weight_version=version if last else None, flush_cache=last))
        return int(sending.get(phase="sync_weights")[0])

    return sync


def build_workers(cfg: RunConfig, output_dir: Path, loop: asyncio.AbstractEventLoop) -> Workers:
    """Start Ray, the pools, the actor and rollout workers, and the weight-update group."""
    from megarl.cluster import RayWorkerGroup, create_pools, init_ray, resolve_device

    runtime = init_ray(cfg.ray.address, cfg.ray.num_cpus)
    device = resolve_device(cfg.resources.device)
    colocate = cfg.rollout.colocate
    pools = create_pools(cfg.resources, colocate=colocate, max_colocate_count=2 if colocate else 1)
    log_dir = output_dir / "logs"
    env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"} if device == "cpu" else {}
    timeout = cfg.trainer.phase_timeout_s
    actor = RayWorkerGroup(ActorWorker, pools["train_pool"], "actor", log_dir=log_dir,
                           args=(actor_spec(cfg),), env=env, echo_logs=False,
                           call_timeout_s=timeout)
    rollout = RayWorkerGroup(RolloutServerWorker, pools["rollout_pool"], "rollout",
                             log_dir=log_dir, args=(engine_spec(cfg, log_dir),), env=env,
                             echo_logs=False, call_timeout_s=timeout)
    urls = [u for u in rollout.execute_all("wait_ready") if u]
    client = SGLangClient(urls, timeout_s=timeout)
    layouts = actor.execute_all("layout")
    sync = _weight_sync(cfg, actor, client, loop, len(urls), device)
    return Workers(actor=actor, rollout=rollout, client=client,
                   dp_size=layouts[0]["dp_size"], dp_rank=[x["dp_rank"] for x in layouts],
                   reports=[bool(x["reports"]) for x in layouts],
                   num_rollout_gpus=rollout.world_size, weight_sync=sync,
                   started_ray=runtime.started_here)


def shutdown_workers(workers: Workers, loop: asyncio.AbstractEventLoop) -> None:
    """Stop the engines and workers (and Ray when this job started it)."""
    import ray

    try:
        loop.run_until_complete(workers.client.close())
        workers.rollout.execute_all("stop")
    finally:
        workers.rollout.shutdown()
        workers.actor.shutdown()
        if workers.started_ray:
            ray.shutdown()
