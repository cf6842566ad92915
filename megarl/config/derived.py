"""Sizes that follow from the config: how a step's sequences split over engines, data-parallel
ranks, mini- and micro-batches (PITFALLS B1), and the parallel layout of each train-side role.

A division that does not come out whole is kept as a float (validation reports it); a size that
cannot be known (no rollout pool, dynamic batch size) is None.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megarl.config.model_info import ModelInfo
from megarl.config.schema import ParallelConfig, RunConfig

Number = int | float  # a float only where a division is not exact
MEGATRON_VOCAB_DIVISOR = 128  # megatron's make_vocab_size_divisible_by default


def ratio(a: Number | None, b: Number | None) -> Number | None:
    """``a / b`` as an int when exact, a float when not, None when either is unknown or b is 0."""
    if a is None or b is None or b == 0:
        return None
    if isinstance(a, int) and isinstance(b, int) and a % b == 0:
        return a // b
    return a / b


def is_whole(value: Number | None) -> bool:
    """Whether a derived size is a known positive whole number."""
    return isinstance(value, int) and value > 0


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n`` in increasing order."""
    return [d for d in range(1, n + 1) if n % d == 0] if n > 0 else []


def nearest_divisor(n: int, target: Number) -> int:
    """The divisor of ``n`` closest to ``target`` (the smaller one on a tie)."""
    return min(divisors(n), key=lambda d: (abs(d - target), d))


def nearest_multiple(step: int, target: Number) -> int:
    """The positive multiple of ``step`` closest to ``target`` (the larger one on a tie)."""
    low = max(step, int(target // step) * step)
    high = low + step
    return low if target - low < high - target else high


@dataclass(frozen=True)
class RoleLayout:
    """How one train-side role (actor, ref, critic) splits the train pool."""

    role: str
    world: int
    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    dp: Number
    expert_dp: Number

    @classmethod
    def of(cls, role: str, parallel: ParallelConfig, world: int) -> RoleLayout:
        """The layout of ``role`` with ``parallel`` on a pool of ``world`` GPUs."""
        p = parallel
        return cls(role=role, world=world, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, etp=p.expert_tp,
                   dp=ratio(world, p.tp * p.pp * p.cp),
                   expert_dp=ratio(world, p.pp * p.ep * p.expert_tp))

    def describe(self) -> str:
        """``tp 1 x pp 1 x cp 1 x dp 2 (experts: etp 1 x ep 2 x expert-dp 1)``."""
        return (f"tp {self.tp} x pp {self.pp} x cp {self.cp} x dp {fmt(self.dp)} (experts: etp "
                f"{self.etp} x ep {self.ep} x expert-dp {fmt(self.expert_dp)} per stage)")


@dataclass(frozen=True)
class DerivedSizes:
    """Everything ``megarl config show`` prints under "derived sizes"."""

    prompts_per_step: int
    samples_per_prompt: int
    sequences_per_step: int
    max_sequence_length: int
    train_pool_gpus: int
    rollout_pool_gpus: int | None
    actor: RoleLayout
    ref: RoleLayout | None
    critic: RoleLayout | None
    gpus_per_engine: int
    num_engines: Number | None
    sequences_per_engine: Number | None
    sequences_per_dp_rank: Number | None
    mini_batches_per_step: Number | None
    sequences_per_mini_batch: int
    sequences_per_mini_batch_per_dp_rank: Number | None
    micro_batch_size_per_gpu: Number | None
    micro_batches_per_mini_batch: Number | None
    token_budget_per_micro_batch: int | None
    optimizer_steps_per_step: Number | None
    max_num_seqs: int | None
    kv_cache_sequences_per_engine: int | None
    padded_vocab_size: int | None
    weight_sync_backend: str
    slot_name: str = "GPUs"  # what a pool slot is: GPUs, or CPU processes with device=cpu


def fmt(value: Number | None) -> str:
    """A derived number for display: ints as is, inexact divisions with 2 decimals."""
    if value is None:
        return "n/a"
    return str(value) if isinstance(value, int) else f"{value:.2f} (not whole)"


def micro_batch_per_gpu(cfg: RunConfig, dp: Number | None) -> Number | None:
    """Sequences per micro-batch on one DP rank (None with dynamic batch size or when unset)."""
    actor = cfg.actor
    if actor.use_dynamic_bsz:
        return None
    if actor.ppo_micro_batch_size_per_gpu is not None:
        return actor.ppo_micro_batch_size_per_gpu
    return ratio(actor.ppo_micro_batch_size, dp)


def rollout_pool_gpus(cfg: RunConfig) -> int | None:
    """GPUs the rollout engines run on (the train pool's when colocated)."""
    if cfg.rollout.colocate:
        return cfg.resources.train_pool.world_size
    pool = cfg.resources.rollout_pool
    return None if pool is None else pool.world_size


def engine_share(cfg: RunConfig, model: ModelInfo, engine_resident: int = 0
                 ) -> tuple[int | None, int | None, int, int]:
    """One engine GPU as SGLang sizes it: (what is free when the engine loads, the share it takes
    of that for its weights and KV pool, its weights, the KV bytes of one full-length sequence);
    the first two None without ``resources.gpu_memory_gb``. The engine takes
    ``gpu_memory_utilization`` of what is free, which for a colocated engine is the GPU less
    ``engine_resident`` (what the train roles keep while it generates); its weights are block
    FP8 with ``rollout.quantization=fp8``."""
    dtype = cfg.rollout.dtype or cfg.model.dtype
    tp = cfg.rollout.gpus_per_engine
    weights = math.ceil(model.weight_bytes(dtype, cfg.rollout.quantization,
                                           cfg.rollout.fp8_attention) / tp)
    per_seq = model.kv_bytes_per_token(dtype, tp) * (
        cfg.data.max_prompt_length + cfg.data.max_response_length)
    mem_gb = cfg.resources.gpu_memory_gb
    if mem_gb is None:
        return None, None, weights, per_seq
    free = max(0, int(mem_gb * 2**30) - engine_resident)
    return free, int(free * cfg.rollout.gpu_memory_utilization), weights, per_seq


def kv_cache_sequences(cfg: RunConfig, model: ModelInfo | None,
                       engine_resident: int = 0) -> int | None:
    """Full-length sequences whose KV cache fits in one engine (:func:`engine_share`; its
    ``engine_resident`` comes from :func:`megarl.config.estimates.resolve_sizes`), when GPU
    memory is known."""
    if model is None or cfg.resources.gpu_memory_gb is None:
        return None
    _, usable, weights, per_seq = engine_share(cfg, model, engine_resident)
    return max(0, (usable - weights) // per_seq)


def effective_max_num_seqs(cfg: RunConfig, per_engine: Number | None,
                           kv_fit: int | None) -> int | None:
    """The engine concurrency used: the configured number, or ``auto``'s choice."""
    if cfg.rollout.max_num_seqs != "auto":
        return cfg.rollout.max_num_seqs
    if per_engine is None:
        return None
    wanted = math.ceil(per_engine)
    return wanted if kv_fit is None else max(1, min(wanted, kv_fit))


def weight_sync_backend(cfg: RunConfig) -> str:
    """The checkpoint-engine transport ``auto`` resolves to."""
    if cfg.checkpoint_engine.backend != "auto":
        return cfg.checkpoint_engine.backend
    return "ipc" if cfg.rollout.colocate else "nccl"


def derive_sizes(cfg: RunConfig, model: ModelInfo | None = None,
                 engine_resident: int = 0) -> DerivedSizes:
    """Compute the derived sizes of ``cfg`` (``model`` adds the KV-cache and vocab numbers;
    ``engine_resident``: what colocated train roles keep on an engine's GPU, see
    :func:`kv_cache_sequences`)."""
    actor, n = cfg.actor, cfg.rollout.n
    world = cfg.resources.train_pool.world_size
    layout = RoleLayout.of("actor", actor.parallel, world)
    sequences = cfg.data.train_batch_size * n
    rollout_gpus = rollout_pool_gpus(cfg)
    engines = ratio(rollout_gpus, cfg.rollout.gpus_per_engine)
    per_engine = ratio(sequences, engines) if is_whole(engines) else None
    mini_seqs = actor.ppo_mini_batch_size * n
    mini_per_rank = ratio(mini_seqs, layout.dp) if is_whole(layout.dp) else None
    micro = micro_batch_per_gpu(cfg, layout.dp)
    minis = ratio(cfg.data.train_batch_size, actor.ppo_mini_batch_size)
    kv_fit = kv_cache_sequences(cfg, model, engine_resident)
    vocab_step = MEGATRON_VOCAB_DIVISOR * actor.parallel.tp
    return DerivedSizes(
        prompts_per_step=cfg.data.train_batch_size,
        samples_per_prompt=n,
        sequences_per_step=sequences,
        max_sequence_length=cfg.data.max_prompt_length + cfg.data.max_response_length,
        train_pool_gpus=world,
        rollout_pool_gpus=rollout_gpus,
        actor=layout,
        ref=RoleLayout.of("ref", cfg.ref.parallel, world) if (
            cfg.ref.enabled and cfg.ref.parallel) else None,
        critic=RoleLayout.of("critic", cfg.critic.parallel, world) if (
            cfg.critic.enabled and cfg.critic.parallel) else None,
        gpus_per_engine=cfg.rollout.gpus_per_engine,
        num_engines=engines,
        sequences_per_engine=per_engine,
        sequences_per_dp_rank=ratio(sequences, layout.dp) if is_whole(layout.dp) else None,
        mini_batches_per_step=minis,
        sequences_per_mini_batch=mini_seqs,
        sequences_per_mini_batch_per_dp_rank=mini_per_rank,
        micro_batch_size_per_gpu=micro,
        micro_batches_per_mini_batch=ratio(mini_per_rank, micro) if is_whole(micro) else None,
        token_budget_per_micro_batch=(actor.ppo_max_token_len_per_gpu * actor.parallel.cp
                                      if actor.use_dynamic_bsz else None),
        optimizer_steps_per_step=None if minis is None else minis * actor.ppo_epochs,
        max_num_seqs=effective_max_num_seqs(cfg, per_engine, kv_fit),
        kv_cache_sequences_per_engine=kv_fit,
        padded_vocab_size=(math.ceil(model.vocab_size / vocab_step) * vocab_step
                           if model is not None else None),
        weight_sync_backend=weight_sync_backend(cfg),
        slot_name="processes" if cfg.resources.device == "cpu" else "GPUs",
    )


def format_sizes(s: DerivedSizes) -> list[str]:
    """The derived sizes as aligned ``name  value`` lines."""
    rows: list[tuple[str, str]] = [
        ("sequences per step", (f"{s.prompts_per_step} prompts x {s.samples_per_prompt} samples "
                               f"= {s.sequences_per_step}")),
        ("longest sequence", f"{s.max_sequence_length} tokens"),
        ("train pool", f"{s.train_pool_gpus} {s.slot_name}: actor {s.actor.describe()}"),
    ]
    for role in (s.ref, s.critic):
        if role is not None:
            rows.append(("", f"{role.role} {role.describe()}"))
    rows += [
        ("rollout pool", (f"{fmt(s.rollout_pool_gpus)} {s.slot_name}: {fmt(s.num_engines)} "
                         f"engine(s) x {s.gpus_per_engine}")),
        ("sequences per engine", fmt(s.sequences_per_engine)),
        ("engine concurrency", f"max_num_seqs {fmt(s.max_num_seqs)}" + (
            f" (KV cache fits {s.kv_cache_sequences_per_engine} full-length sequences)"
            if s.kv_cache_sequences_per_engine is not None else "")),
        ("sequences per DP rank", fmt(s.sequences_per_dp_rank)),
        ("mini-batches per step", (f"{fmt(s.mini_batches_per_step)} of {s.sequences_per_mini_batch}"
                                  f" sequences ({fmt(s.sequences_per_mini_batch_per_dp_rank)} "
                                  f"per DP rank)")),
    ]
    if s.token_budget_per_micro_batch is not None:
        rows.append(("micro-batches", (f"dynamic, up to {s.token_budget_per_micro_batch} tokens "
                                      f"each (per CP group)")))
    else:
        rows.append(("micro-batches per mini", (f"{fmt(s.micro_batches_per_mini_batch)} per DP "
                                               f"rank of {fmt(s.micro_batch_size_per_gpu)} "
                                               f"sequences")))
    rows.append(("optimizer steps per step", fmt(s.optimizer_steps_per_step)))
    if s.padded_vocab_size is not None:
        rows.append(("padded vocab", (f"{s.padded_vocab_size} (multiple of "
                                     f"{MEGATRON_VOCAB_DIVISOR} x tp)")))
    rows.append(("weight sync", s.weight_sync_backend))
    width = max(len(name) for name, _ in rows)
    return [f"{name:<{width}}  {value}" for name, value in rows]
