"""Starting what a run needs: Ray, the two pools, actor workers, rollout engines, weight sync.

:func:`build_workers` turns a run config into a :class:`Workers` bundle that the trainer drives;
:func:`shutdown_workers` stops everything it started. The weight sync set up here follows
SGLang's protocols: colocated engines take ``/update_weights_from_tensor`` (CUDA IPC handles of
flattened buckets) from the train ranks on their GPUs; separate pools take
``/update_weights_from_distributed`` per bucket while actor rank 0 broadcasts it. The same code
serves SGLang servers and megarl's embedded engines.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megarl.config import RunConfig
from megarl.config.derived import weight_sync_backend
from megarl.config.estimates import resolve_sizes
from megarl.config.lora_layers import hf_leaf_modules
from megarl.config.model_info import ModelInfoError, load_model_info
from megarl.faults import fail_point
from megarl.megatron.offload import OffloadSettings
from megarl.megatron.parallel import ParallelSizes
from megarl.megatron.settings import (
    ActorSpec,
    LoraSettings,
    LossSettings,
    OptimizerSettings,
    recompute_settings,
)
from megarl.rollout.routed_experts import RoutedExpertsLayout
from megarl.rollout.server_worker import EngineSpec, RolloutServerWorker, local_engine_args
from megarl.rollout.sglang import SGLangClient
from megarl.trainer.critic import CriticWorkers, start_critic
from megarl.weights.flattened import FLATTENED_BUCKET
from megarl.weights.fp8 import ignored_modules
from megarl.weights.sglang_sender import BucketSpec, plan_buckets

ACTOR_WORKER = "megarl.megatron.worker:ActorWorker"
"""Imported by the Ray workers only: the driver does not import megatron-core."""
logger = logging.getLogger(__name__)


@dataclass
class Workers:
    """The running parts of a job and what the trainer needs to address them."""

    actor: Any
    rollout: Any
    client: SGLangClient
    dp_size: int
    dp_rank: list[int]
    """Data-parallel rank of each actor rank."""
    reports: list[bool]  # whether an actor rank returns results for its data-parallel group
    num_rollout_gpus: int
    weight_sync: Callable[..., dict[str, float]]
    """Push the actor's weights to the engines under a version; its ``checkpoint_engine/*``."""
    started_ray: bool = False
    critic: CriticWorkers | None = None
    """The value model's workers (``algorithm.adv_estimator=gae``), on the train pool."""
    pools: dict[str, Any] | None = None
    """The Ray resource pools the workers run on (None in the no-Ray mode); removed at
    shutdown, so a later job of the same driver or cluster gets their resources."""


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
        clip_cov_ratio=a.policy_loss.clip_cov_ratio, clip_cov_lb=a.policy_loss.clip_cov_lb,
        clip_cov_ub=a.policy_loss.clip_cov_ub, kl_cov_ratio=a.policy_loss.kl_cov_ratio,
        ppo_kl_coef=a.policy_loss.ppo_kl_coef, tau_pos=a.tau_pos, tau_neg=a.tau_neg,
        loss_agg_mode=a.loss_agg_mode, norm_len=float(cfg.data.max_response_length),
        entropy_coeff=a.entropy_coeff, use_kl_loss=a.use_kl_loss, kl_loss_coef=a.kl_loss_coef,
        kl_loss_type=a.kl_loss_type)
    seq_len = cfg.data.max_prompt_length + cfg.data.max_response_length
    if a.use_dynamic_bsz:  # per GPU: a packed row is split over the cp ranks of a replica
        budget = a.ppo_max_token_len_per_gpu * sizes.cp
        log_prob_budget = a.log_prob_max_token_len_per_gpu * sizes.cp
        ref_budget = cfg.ref.log_prob_max_token_len_per_gpu * sizes.cp
    else:
        micro = a.ppo_micro_batch_size_per_gpu or a.ppo_micro_batch_size or 1
        budget = micro * seq_len
        log_prob_budget = (a.log_prob_micro_batch_size_per_gpu or micro) * seq_len
        ref_budget = (cfg.ref.log_prob_micro_batch_size_per_gpu or micro) * seq_len
    return ActorSpec(model_path=cfg.model.path, dtype=cfg.model.dtype, sizes=sizes, optim=optim,
                     loss=loss, with_ref=bool(cfg.ref.enabled),
                     temperature=cfg.rollout.temperature or 1.0,
                     max_tokens_per_micro_batch=budget, seed=cfg.trainer.seed,
                     log_prob_max_tokens_per_micro_batch=log_prob_budget,
                     ref_max_tokens_per_micro_batch=ref_budget,
                     init_checkpoint=cfg.model.mcore_checkpoint,
                     router_replay=(a.router_replay.mode != "disabled"
                                    or bool(cfg.rollout.enable_return_routed_experts)),
                     cuda_graphs=a.cuda_graphs, cuda_graph_bucket_tokens=a.cuda_graph_bucket_tokens,
                     offload=OffloadSettings(**a.offload.model_dump()),
                     ref_param_offload=cfg.ref.offload.param_offload,
                     recompute=recompute_settings(a.recompute),
                     trust_remote_code=cfg.model.trust_remote_code,
                     lora=LoraSettings(rank=a.lora.rank, alpha=a.lora.alpha,
                                       dropout=a.lora.dropout,
                                       target_modules=None if a.lora.target_modules is None
                                       else tuple(a.lora.target_modules),
                                       exclude_modules=tuple(a.lora.exclude_modules),
                                       seed=cfg.trainer.seed))


def engine_max_num_seqs(cfg: RunConfig) -> int | None:
    """``rollout.max_num_seqs`` as each engine gets it: the number set, or for ``auto`` the one
    ``megarl config show`` derives (None only when it cannot be derived)."""
    if cfg.rollout.max_num_seqs != "auto":
        return int(cfg.rollout.max_num_seqs)
    try:
        model = load_model_info(cfg.model.path)
    except ModelInfoError:
        model = None
    return resolve_sizes(cfg, model).max_num_seqs


def engine_spec(cfg: RunConfig, log_dir: Path) -> EngineSpec:
    """The RolloutServerWorker's settings from the config."""
    r = cfg.rollout
    max_seqs = engine_max_num_seqs(cfg)
    adapters = cfg.actor.lora.rank > 0 and cfg.actor.lora.sync == "adapter"
    return EngineSpec(model_path=cfg.model.path, backend=r.backend, host=r.host,
                      dtype=r.dtype or cfg.model.dtype, max_running_requests=max_seqs,
                      seed=cfg.trainer.seed, log_dir=str(log_dir),
                      gpus_per_engine=r.gpus_per_engine, mem_fraction=r.gpu_memory_utilization,
                      return_routed_experts=bool(r.enable_return_routed_experts),
                      colocated=r.colocate, api_key=r.api_key, sglang_args=tuple(r.sglang_args),
                      trust_remote_code=cfg.model.trust_remote_code,
                      quantization=r.quantization, load_format=r.load_format,
                      max_prefill_tokens=r.max_prefill_tokens,
                      chunked_prefill_size=r.chunked_prefill_size,
                      fp8_ignored=ignored_modules(r.fp8_attention) if r.quantization else (),
                      enable_lora=adapters, lora_rank=cfg.actor.lora.rank if adapters else 0,
                      lora_modules=hf_leaf_modules(cfg.actor.lora.target_modules) if adapters
                      else ())


class _DriverHttp:
    """SGLang control calls issued from a background thread with its own client and event
    loop, so the driver can take part in the collective they pair with (the sender's
    broadcasts run on the calling thread; under torchrun the driver is also actor rank 0)."""

    def __init__(self, urls: list[str], calls: Callable[[SGLangClient], Any] | None,
                 api_key: str | None = None, ranks_per_engine: int = 1) -> None:
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main,
                                       args=(urls, calls, api_key, ranks_per_engine), daemon=True)
        self.thread.start()

    def _main(self, urls: list[str], calls: Callable[[SGLangClient], Any] | None,
              api_key: str | None, ranks_per_engine: int) -> None:
        async def run() -> None:
            client = SGLangClient(urls, api_key=api_key, ranks_per_engine=ranks_per_engine)
            try:
                if calls is not None:
                    await calls(client)
            finally:
                await client.close()

        try:
            asyncio.run(run())
        except BaseException as err:  # noqa: BLE001 - re-raised on the calling thread
            self.error = err

    def failure(self) -> BaseException | None:
        """The calls' error once they ended with one (None while running or on success)."""
        return None if self.thread.is_alive() else self.error

    def join(self, timeout_s: float, phase: str) -> None:
        """Wait for the calls; re-raise their error."""
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            raise TimeoutError(f"{phase}: the rollout engines did not answer within "
                               f"{timeout_s:.0f} s (trainer.phase_timeout_s)")
        if self.error is not None:
            raise self.error


ADAPTER_NAME = "policy-v{version}"
"""The engines' name of the adapter of weight version ``version`` (``actor.lora.sync``)."""


def _adapter_sync(cfg: RunConfig, actor: Any, rollout: Any, client: SGLangClient,
                  urls: list[str], is_driver: bool) -> Callable[..., dict[str, float]]:
    """The per-step sync of ``actor.lora.sync: adapter``: rank 0's adapters in PEFT's format
    go to every engine as adapter ``policy-v<version>`` (SGLang's
    ``/load_lora_adapter_from_tensors``, one flattened bucket inline; routed experts' adapters
    one per expert, as SGLang loads MoE adapters), every later request
    names it, and the previous version is unloaded; the engines' ``weight_version`` (which
    every sample carries, for staleness) is set to ``version``. A restarted engine has none
    loaded: it gets the new one like the others, and the previous one is unloaded from the
    engines that kept running (each restart would otherwise leave one adapter behind on them,
    until SGLang's ``--max-loaded-loras`` refuses the next load)."""
    from megarl.weights.expert_adapters import per_expert_adapter
    from megarl.weights.flattened import flatten_bucket, serialize

    timeout = cfg.trainer.phase_timeout_s

    def sync(version: str, restart: list[int] | tuple[int, ...] = ()) -> dict[str, float]:
        if restart:
            rollout.execute_all("restart", [urls[i] for i in restart], timeout)
        adapter = actor.execute_all("lora_adapter")[0]
        name, previous = ADAPTER_NAME.format(version=version), client.lora_path
        survivors = [i for i in range(len(urls)) if i not in restart]
        # routed experts' adapters under SGLang's per-expert names
        config, tensors = per_expert_adapter(*adapter) if adapter else ({}, {})
        if is_driver:
            payload = flatten_bucket(list(tensors.items()))

            async def push(engines: SGLangClient) -> None:
                await engines.load_lora_adapter_from_tensors(
                    name, config, serialize(payload), load_format=FLATTENED_BUCKET)
                if previous is not None and survivors:
                    await engines.unload_lora_adapter(previous, engines=survivors)
                # the base weights stay, so no update stamps the version the samples carry
                await engines.update_weight_version(str(version))

            _DriverHttp(urls, push, cfg.rollout.api_key,
                        cfg.rollout.gpus_per_engine).join(timeout, "sync_weights (adapter)")
        client.lora_path = name
        sent = sum(t.numel() * t.element_size() for t in tensors.values())
        return {"checkpoint_engine/bytes": float(sent)}

    return sync


def _weight_sync(cfg: RunConfig, actor: Any, rollout: Any, urls: list[str], is_driver: bool,
                 device: str, client: SGLangClient | None = None
                 ) -> Callable[..., dict[str, float]]:
    """The per-step sync ``sync(version, restart=())`` over SGLang's protocol: colocated engines
    (backend ipc) get ``/update_weights_from_tensor`` from the train ranks on their GPUs;
    separate pools (nccl; gloo on CPU) get ``/update_weights_from_distributed`` while train
    rank 0 broadcasts each bucket. ``restart``: engines the client marked down, restarted first
    (the broadcast group, which a dead member breaks, is formed again)."""
    if cfg.actor.lora.rank and cfg.actor.lora.sync == "adapter":
        return _adapter_sync(cfg, actor, rollout, client, urls, is_driver)
    dtype = cfg.rollout.dtype or cfg.model.dtype
    timeout, gpus = cfg.trainer.phase_timeout_s, cfg.rollout.gpus_per_engine
    plan = plan_buckets(actor.execute_all("weight_specs")[0], dtype,
                        cfg.checkpoint_engine.bucket_size_mb, cfg.rollout.quantization,
                        ignored_modules(cfg.rollout.fp8_attention))
    if weight_sync_backend(cfg) == "ipc":
        sent = [False]  # the plan goes to the ranks once (an MoE plan pickles in milliseconds)

        def sync_colocated(version: str, restart: list[int] | tuple[int, ...] = ()
                           ) -> dict[str, float]:
            if restart:
                rollout.execute_all("restart", [urls[i] for i in restart], timeout)
            ranks = actor.execute_all("send_weights_colocated", None if sent[0] else plan, urls,
                                      gpus, version, cfg.rollout.api_key, timeout)
            sent[0] = True
            return {"checkpoint_engine/bytes": sum(r["bytes"] for r in ranks),
                    "checkpoint_engine/pack_s": max(r["pack_s"] for r in ranks),
                    "checkpoint_engine/engine_wait_s": max(r["engine_s"] for r in ranks),
                    "checkpoint_engine/replayed": max(r["replayed"] for r in ranks)}

        return sync_colocated
    return _broadcast_sync(cfg, actor, rollout, urls, is_driver, device, plan)


def _broadcast_sync(cfg: RunConfig, actor: Any, rollout: Any, urls: list[str], is_driver: bool,
                    device: str, plan: list[BucketSpec]) -> Callable[..., dict[str, float]]:
    """Open the weight-update group (train rank 0 + every engine GPU: engine i's TP rank r is
    ``1 + i * gpus_per_engine + r``) and return the broadcast sync function."""
    backend = "nccl" if device == "cuda" else "gloo"
    timeout = cfg.trainer.phase_timeout_s
    gpus = cfg.rollout.gpus_per_engine
    world = 1 + len(urls) * gpus

    def open_group(members: list[str]) -> None:
        address, port = actor.execute_all("weight_group_address")[0]
        join_group = _DriverHttp(members, (lambda c: c.init_weights_update_group(
            address, port, world, backend=backend)) if is_driver else None, cfg.rollout.api_key,
            gpus)
        actor.execute_all("open_weight_group", address, port, world, backend)
        join_group.join(timeout, "open the weight-update group")

    def reform(restart: list[int]) -> None:
        survivors = [u for i, u in enumerate(urls) if i not in restart]
        rollout.execute_all("restart", [urls[i] for i in restart], timeout)
        leave = _DriverHttp(survivors, (lambda c: c.destroy_weights_update_group())
                            if is_driver else None, cfg.rollout.api_key, gpus)
        leave.join(timeout, "leave the broken weight-update group")
        actor.execute_all("close_weight_group")
        open_group(urls)

    open_group(urls)

    def sync(version: str, restart: list[int] | tuple[int, ...] = ()) -> dict[str, float]:
        if restart:
            reform(list(restart))

        async def receive(client: SGLangClient) -> None:
            for k, bucket in enumerate(plan):
                last = k == len(plan) - 1
                await client.update_weights_from_distributed(
                    [n for n, _, _ in bucket], [d for _, _, d in bucket],
                    [s for _, s, _ in bucket],
                    weight_version=version if last else None, flush_cache=last,
                    load_format=FLATTENED_BUCKET)

        receiving = _DriverHttp(urls, receive if is_driver else None, cfg.rollout.api_key, gpus)
        # an engine that refuses a bucket never joins its broadcast: say why at once, instead
        # of after trainer.phase_timeout_s of train ranks waiting in the collective
        sent = actor.execute_all_async("broadcast_weights", plan).get(
            phase="sync_weights", abort=receiving.failure)[0]
        receiving.join(timeout, "sync_weights")
        return {"checkpoint_engine/bytes": float(sent)}

    return sync


def build_workers(cfg: RunConfig, output_dir: Path) -> Workers:
    """Start Ray, check that every node can read the run's inputs, then the pools, the actor and
    rollout workers, and the weight-update group (or, with ``trainer.worker_group=naive``, the
    same parts inside the torchrun world). When a part fails, what was started before it is
    stopped (its actors killed, the pools' placement groups removed) and the error re-raised."""
    if cfg.trainer.worker_group == "naive":
        return build_naive_workers(cfg, output_dir)
    from megarl.cluster import init_ray

    runtime = init_ray(cfg.ray.address, cfg.ray.num_cpus)
    started: list[Any] = []  # groups and pools, in the order they were created
    try:
        check_inputs_on_nodes(cfg)
        for line in check_memory_on_nodes(cfg):
            print(f"megarl: {line}", flush=True)
        return _build_ray_workers(cfg, output_dir, runtime.started_here, started)
    except BaseException:
        _stop_started(started)
        raise


def check_inputs_on_nodes(cfg: RunConfig) -> int:
    """Every alive Ray node reads the data files and the model directory (PITFALLS S3); raises
    NodePathError with one line per node and path it cannot read. Returns the nodes checked."""
    from megarl.cluster.preflight import run_input_checks

    files = {"data.train_files": cfg.data.train_files}
    if cfg.trainer.val_every and cfg.data.val_files:
        files["data.val_files"] = cfg.data.val_files
    return run_input_checks(files, {"model.path": cfg.model.path})


def check_memory_on_nodes(cfg: RunConfig,
                          read: Callable[[], dict[str, tuple[int, int]]] | None = None,
                          read_host: Callable[[], tuple[int, int, str]] | None = None
                          ) -> list[str]:
    """The device preflight against every Ray node's GPUs (``read`` on each node; default
    nvidia-smi) and the host preflight against every node's available host memory
    (``read_host``; default /proc/meminfo and the cgroup): raises NodeMemoryError with one line
    per phase that does not fit the GPU with the least free memory and per node that cannot
    hold its host-memory estimate; otherwise returns the lines to print (none without GPUs:
    a CPU run keeps its state in host memory, offload moves nothing)."""
    from megarl.cluster.preflight import NodeMemoryError, gpu_memory_on_nodes, host_memory_on_nodes
    from megarl.config.model_info import ModelInfoError, load_model_info
    from megarl.memory_preflight import device_preflight, host_preflight

    if not cfg.trainer.preflight or cfg.resources.device == "cpu":
        return []
    readings, failed = gpu_memory_on_nodes(read)
    if not readings:
        return failed
    try:
        model = load_model_info(cfg.model.path)
    except ModelInfoError:
        model = None  # device_preflight says it did not run
    lines, refused = device_preflight(cfg, model, read=lambda: readings)
    host_lines, host_refused = [], False
    if model is not None:
        nodes, host_failed = host_memory_on_nodes(read_host)
        host_lines, host_refused = host_preflight(cfg, model, nodes, readings)
        failed += host_failed
    if refused or host_refused:
        what = [f"{len(lines)} phase(s) do not fit the GPUs' free memory"] if refused else []
        what += [f"{len(host_lines)} node(s) cannot hold the run's host memory"] * host_refused
        problems = (lines if refused else []) + (host_lines if host_refused else [])
        raise NodeMemoryError(f"{' and '.join(what)}, checked on every node before starting "
                              "workers:\n" + "\n".join(problems + failed))
    return [line.replace("preflight:", "preflight on every node:", 1)
            for line in lines + host_lines] + failed


def _build_ray_workers(cfg: RunConfig, output_dir: Path, started_ray: bool,
                       started: list[Any]) -> Workers:
    """The Ray part of :func:`build_workers`; appends each group and pool it creates to
    ``started`` as soon as it exists."""
    from megarl.cluster import RayWorkerGroup, create_pools, resolve_device

    device = resolve_device(cfg.resources.device)
    colocate = cfg.rollout.colocate
    # groups sharing a train-pool slot: the actor, the critic, colocated engines
    groups = 1 + int(bool(cfg.critic.enabled)) + int(colocate)
    pools = create_pools(cfg.resources, colocate=colocate, max_colocate_count=groups)
    started.append(pools)
    log_dir = output_dir / "logs"
    env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"} if device == "cpu" else {}
    timeout = cfg.trainer.phase_timeout_s

    def start_actor() -> RayWorkerGroup:
        fail_point("start_actor")
        started.append(RayWorkerGroup(ACTOR_WORKER, pools["train_pool"], "actor",
                                      log_dir=log_dir, args=(actor_spec(cfg),), env=env,
                                      echo_logs=False, call_timeout_s=timeout))
        return started[-1]

    def start_rollout() -> RayWorkerGroup:
        fail_point("start_rollout")
        started.append(RayWorkerGroup(RolloutServerWorker, pools["rollout_pool"], "rollout",
                                      log_dir=log_dir, args=(engine_spec(cfg, log_dir),),
                                      env=env, echo_logs=False, call_timeout_s=timeout))
        return started[-1]

    clock = time.perf_counter()
    seconds: dict[str, float] = {}

    def lap(name: str) -> None:
        nonlocal clock
        seconds[name] = time.perf_counter() - clock
        clock = time.perf_counter()

    if colocate:  # the actor takes its memory first; the engines fit in what is left
        actor = start_actor()
        lap("actor")
        rollout = start_rollout()
    else:
        # A rollout worker only launches its server: the engines load their weights while the
        # Megatron ranks build (wait_ready below waits for them).
        rollout = start_rollout()
        actor = start_actor()
        lap("actor")
    critic = None
    if cfg.critic.enabled:
        fail_point("start_critic")
        critic = start_critic(cfg, pool=pools["train_pool"], log_dir=log_dir, env=env)
        started.append(critic.group)
        lap("critic")
    urls = [u for u in rollout.execute_all("wait_ready") if u]
    lap("engines")
    workers = _assemble(cfg, actor, rollout, urls, True, device, rollout.world_size, started_ray)
    lap("weight sync setup")
    workers.critic = critic
    workers.pools = pools
    print("megarl: started in " + ", ".join(f"{name} {s:.1f} s" for name, s in seconds.items())
          + (" (the engines after the actor: colocated)" if colocate else
             " (the engines loading while the actor built)"), flush=True)
    return workers


def _stop_started(started: list[Any]) -> None:
    """Undo a failed :func:`build_workers`: stop the engines of a rollout group, kill every
    group's actors, then remove the pools (newest first; each step best effort)."""
    for part in reversed(started):
        try:
            if isinstance(part, dict):
                _remove_pools(part)
                continue
            if part.role == "rollout":
                part.execute_all("stop")
        except Exception as err:  # noqa: BLE001 - the original error is the one to report
            logger.warning("cleaning up after a failed start: %s", err)
        finally:
            if not isinstance(part, dict):
                part.shutdown()


def _remove_pools(pools: dict[str, Any]) -> None:
    """Release the pools' placement groups (a colocated pool is listed twice, removed once)."""
    for pool in {id(p): p for p in pools.values()}.values():
        pool.remove()


def client_concurrency(cfg: RunConfig) -> int:
    """Requests the trainer's client keeps in flight per engine. Each carries one sample, so
    twice the sequences an engine runs at once (``rollout.max_num_seqs``; the other half waits
    in the engine's queue and is admitted as rows finish), and at least the client's default
    256. With the default alone an engine never ran more than 256 sequences, whatever
    ``max_num_seqs`` said (512 on the e2e benchmark's shapes)."""
    return max(256, 2 * (engine_max_num_seqs(cfg) or 256))


def rollout_client(cfg: RunConfig, urls: list[str]) -> SGLangClient:
    """The trainer's client of the rollout engines; with R3 it knows where the MoE layers sit
    in SGLang's every-layer ``routed_experts`` (from the model's config.json)."""
    layout = (RoutedExpertsLayout.from_model_path(cfg.model.path)
              if cfg.rollout.enable_return_routed_experts else None)
    return SGLangClient(urls, timeout_s=cfg.trainer.phase_timeout_s,
                        api_key=cfg.rollout.api_key, routed_experts_layout=layout,
                        max_concurrency_per_engine=client_concurrency(cfg))


def _assemble(cfg: RunConfig, actor: Any, rollout: Any, urls: list[str], is_driver: bool,
              device: str, num_rollout_gpus: int, started_ray: bool) -> Workers:
    layouts = actor.execute_all("layout")
    client = rollout_client(cfg, urls)
    sync = _weight_sync(cfg, actor, rollout, urls, is_driver, device, client)
    return Workers(actor=actor, rollout=rollout, client=client,
                   dp_size=layouts[0]["dp_size"], dp_rank=[x["dp_rank"] for x in layouts],
                   reports=[bool(x["reports"]) for x in layouts],
                   num_rollout_gpus=num_rollout_gpus, weight_sync=sync, started_ray=started_ray)


def build_naive_workers(cfg: RunConfig, output_dir: Path) -> Workers:
    """The no-Ray mode (PITFALLS M4): under torchrun every rank is an actor rank and runs the
    trainer; rank 0 is the driver and starts the rollout engines as local server processes."""
    import torch.distributed as dist

    from megarl.cluster import NaiveWorkerGroup, init_naive
    from megarl.rollout.local.launch import launch_local_engines

    ctx = init_naive(timeout_s=cfg.trainer.phase_timeout_s)
    if cfg.rollout.backend != "local":
        raise ValueError("trainer.worker_group=naive runs the embedded engines only; set "
                         "rollout.backend=local")
    pool = cfg.resources.rollout_pool
    num_engines = max(1, (pool.nnodes * pool.gpus_per_node if pool else 1)
                      // cfg.rollout.gpus_per_engine)
    spec = engine_spec(cfg, output_dir / "logs")
    servers = []
    if ctx.rank == 0:
        servers = launch_local_engines(
            cfg.model.path, num_engines, host=spec.host, device=ctx.device,
            num_threads=spec.num_threads, log_dir=spec.log_dir, api_key=spec.api_key,
            seed=spec.seed, extra_args=local_engine_args(spec))
    box = [[s.url for s in servers]]
    dist.broadcast_object_list(box, src=0)
    from megarl.megatron.worker import ActorWorker  # this process is a train rank

    actor = NaiveWorkerGroup(ActorWorker, "actor", args=(actor_spec(cfg),),
                             call_timeout_s=cfg.trainer.phase_timeout_s)
    workers = _assemble(cfg, actor, _LocalServers(servers), box[0], ctx.rank == 0, ctx.device,
                        num_engines, False)
    workers.critic = start_critic(cfg) if cfg.critic.enabled else None
    return workers


class _LocalServers:
    """The rollout engines of the no-Ray mode: server processes owned by rank 0."""

    def __init__(self, servers: list[Any]) -> None:
        self.servers = servers

    def execute_all(self, method: str, *args: Any) -> list[Any]:
        """``stop`` every server this rank started, or ``restart(urls, timeout_s)`` those whose
        URL is listed (waiting until they are healthy)."""
        if method == "stop":
            for server in self.servers:
                server.stop()
            return [None]
        assert method == "restart", method
        urls, timeout_s = args
        restarted = [s for s in self.servers if s.url in urls]
        for server in restarted:
            server.restart(stop_timeout_s=5.0)
            server.wait_ready(timeout_s)
        return [bool(restarted)]

    def shutdown(self) -> None:
        """Nothing beyond ``stop``."""


def shutdown_workers(workers: Workers, loop: asyncio.AbstractEventLoop) -> None:
    """Stop the engines and workers (and Ray when this job started it)."""
    try:
        loop.run_until_complete(workers.client.close())
        workers.rollout.execute_all("stop")
    finally:
        workers.rollout.shutdown()
        workers.actor.shutdown()
        if workers.critic is not None:
            workers.critic.group.shutdown()
        if workers.pools is not None:
            _remove_pools(workers.pools)
        if workers.started_ray:
            import ray

            ray.shutdown()
        if isinstance(workers.rollout, _LocalServers):
            import torch.distributed as dist

            dist.barrier()
