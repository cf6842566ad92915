"""Size estimates of a run, printed by ``megarl config show``: the parameter counts (total and
activated) and the memory of one GPU in each phase, with a warning when a phase needs more than
``resources.gpu_memory_gb`` (PITFALLS T1). Approximate by design. GB = 2**30 bytes, the unit in
which ``gpu_memory_gb`` is read.

Formulas (h hidden size, t tp, s = t with sequence parallelism else 1, k top_k, E experts):

* Parameters: :meth:`ModelInfo.param_count` (norms ignored, DeepSeek's MTP module excluded);
  ``active`` counts the top_k routed experts of each MoE layer instead of all of them and
  everything else a token passes through, the input embedding and the output layer included
  (the convention of Qwen's 3.3B / 22B and DeepSeek's 37B).
* Per train GPU, for one pipeline stage (the worst is reported): layers split evenly over pp; the
  input embedding sits on the first stage, the output layer on the last (vocab padded to
  128 x tp; a tied embedding is held once with pp=1, by both ends otherwise); non-expert
  parameters split over tp, routed experts over ep x etp.
  weights = params x bytes(model.dtype); grads = params x 4 (megatron's fp32 gradient buffers);
  optimizer = params x (8 for the Adam moments + 4 for the fp32 master copy, none when the model
  is float32) / shards, where shards = the data-parallel ranks that share the parameter
  (dp x cp, expert-dp for experts) with the distributed optimizer, and 1 without it.
* LoRA (``actor.lora.rank`` r > 0): r x (in + out) per adapted HF projection (B's rows split
  over tp in column-parallel layers, A's columns in row-parallel ones; per local routed expert
  one A for gate and up, over etp), in model.dtype; grads and optimizer state are theirs alone.
* Activations kept for backward, per token and layer, in units of bytes(model.dtype) (flash
  attention keeps no s^2 scores; RL runs without dropout):
  attention 2h/s + (q + k + v + attention-output widths)/t (MLA: + the replicated q/kv latents);
  dense MLP 2h/s + 3 ffn/t; MoE 2h/s + 2E/s (fp32 router) + k (etp h + 3 moe_ffn)/s
  + 3 shared_ffn/t. Tokens per micro-batch and GPU = micro-batch x longest sequence, or the
  dynamic token budget, over cp. Full recompute keeps the input of each unit of
  ``recompute.num_layers`` layers (h/s per token) plus one unit's activations during its backward
  (block: only the first num_layers layers of a stage are recomputed); selective recompute is
  counted as none (core_attn drops the s^2 attention scores, which flash attention never
  stores; the mlp/moe modules would lower the figure, which is then an upper bound).
  With 1F1B, stage i holds min(pp - i, micro-batches) micro-batches in flight, x (1 + (pp - 1) /
  (pp x vpp)) when interleaved. Log-probs on the last stage come straight from the hidden
  states, a chunk of rows at a time (:data:`LOG_PROB_CHUNK_ELEMENTS` fp32 logits,
  ``megarl.megatron.output_log_probs``): a chunk's logits in bytes(model.dtype) + its fp32 copy
  and softmax, the output weight's gradient in fp32 + bytes(model.dtype) (padded vocab / t x h;
  none with LoRA, which freezes it), and the gathered hidden states with their gradient
  (tokens x h x 2 bytes(model.dtype)). CUDA-graphed updates (``actor.cuda_graphs``) keep whole logits: tokens x padded vocab / t x
  (bytes(model.dtype) + 4 for the fp32 softmax the log-prob backward keeps).
* Roles idle on the same GPUs (reference: weights; critic: state, counted with the actor's
  architecture) keep what they do not offload. ``offload.*`` moves weights, grads or optimizer
  state to host memory while a role is idle (what a node then holds there:
  :mod:`megarl.config.host_estimates`), so it lowers the weight sync and the colocated
  rollout; in the update only ``optimizer_offload`` counts: that state comes back for each
  optimizer step only, so the update's peak is the larger of the forwards and backwards
  (weights + grads + activations + logits) and the step (weights + grads + optimizer). With
  ``offload.optimizer_step_chunk_mb`` the step streams the Adam moments (8 of the 12 bytes) and
  holds 3 chunks of them at most: 3 x max(chunk, the moments of the largest parameter, taken as
  the embedding's padded vocab / t x h x 8).
  Colocated engines release their memory during the update.
* Log-prob forwards (old log-probs, reference): what the actor keeps while idle, its weights
  always, the idle roles, the activations of the largest layer for the forward's tokens
  (``*.log_prob_max_token_len_per_gpu``, else the update's budget) and on the last stage one
  chunk of logits with the gathered hidden states (no gradients).
* Weight sync: what the actor keeps while idle, its weights always (the sync reads them; param
  offload starts after it) + the sender's two bucket buffers (one packed while the other is in
  flight) (+ the engine's weights, colocated).
* Rollout GPU: engine weights = params x bytes(rollout.dtype) / gpus_per_engine (with
  ``rollout.quantization=fp8`` the projections take 1 byte each plus an fp32 scale per 128x128
  block, :meth:`ModelInfo.weight_bytes`); the KV-cache pool
  is what SGLang's sizing leaves (``profile_max_num_token``; the embedded engine's
  ``kv_cache.kv_slots``): gpu_memory_utilization (its mem_fraction_static) x what is free when
  the engine loads, less the weights. A colocated engine loads next to what the train roles
  keep, which is not free then, so its share is that fraction of the rest of the GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megarl.config.derived import DerivedSizes, RoleLayout, derive_sizes, engine_share, is_whole
from megarl.config.lora_layers import (
    adapter_counts,
    is_excluded,
    lora_layer_names,
    resolve_targets,
)
from megarl.config.model_info import DTYPE_BYTES, ModelInfo
from megarl.config.schema import OffloadConfig, ParallelConfig, RunConfig
from megarl.config.schema_train import RecomputeConfig

BUCKETS_IN_FLIGHT = 2
"""Bucket buffers a weight sender holds at once: bucket k+1 is packed while k is in flight
(:class:`~megarl.weights.buckets.BufferPool`'s slots, the SGLang sender's two buckets)."""

GB = 2**30
GRAD_BYTES = 4  # megatron accumulates and reduces gradients in fp32 buffers
ADAM_MOMENT_BYTES = 8  # exp_avg + exp_avg_sq in fp32
MASTER_BYTES = 4  # fp32 copy of bf16/fp16 parameters kept by the optimizer
FP32_BYTES = 4


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of the whole model and those one token passes through."""

    total: int
    active: int

    @classmethod
    def of(cls, model: ModelInfo) -> ParamCounts:
        """The counts of ``model`` (see the module docstring for the convention)."""
        return cls(total=model.param_count(), active=model.active_param_count())


@dataclass(frozen=True)
class TrainState:
    """Model state of one role on one train GPU: parameter counts and their bytes."""

    dense_params: int
    expert_params: int
    weights: int
    grads: int
    optimizer: int
    moments: int = 0
    """The Adam moments' part of ``optimizer``."""

    @property
    def total(self) -> int:
        """Weights + grads + optimizer state."""
        return self.weights + self.grads + self.optimizer

    def resident(self, offload: OffloadConfig | None) -> int:
        """Bytes kept on the GPU while the role is idle (``None`` = nothing offloaded)."""
        if offload is None:
            return self.total
        return ((0 if offload.param_offload else self.weights)
                + (0 if offload.grad_offload else self.grads)
                + (0 if offload.optimizer_offload else self.optimizer))


@dataclass(frozen=True)
class UpdateMemory:
    """One actor GPU during the policy update (forward + backward + optimizer step)."""

    stage: int
    pp: int
    state: TrainState
    activations: int
    logits: int
    other_roles: int
    tokens_per_micro_batch: int
    micro_batches_in_flight: float
    optimizer_deferred: bool = False
    """The optimizer state is on the GPU for the optimizer steps only (``offload.optimizer_offload``):
    the forwards and backwards run without it."""
    stream_window: int = 0
    """A streamed optimizer step (``offload.optimizer_step_chunk_mb``): the bytes of moments it
    holds at once; 0: the whole state comes back for the step."""

    @property
    def forward_backward(self) -> int:
        """What the GPU holds at the peak of the forwards and backwards."""
        optimizer = 0 if self.optimizer_deferred else self.state.optimizer
        return (self.state.weights + self.state.grads + optimizer + self.activations
                + self.logits + self.other_roles)

    @property
    def optimizer_step(self) -> int:
        """What the GPU holds during an optimizer step (activations freed)."""
        moments = self.state.moments
        if self.stream_window:
            moments = min(moments, self.stream_window)
        return self.state.total - self.state.moments + moments + self.other_roles

    @property
    def total(self) -> int:
        """Everything the GPU holds at the peak of the update."""
        return max(self.forward_backward, self.optimizer_step)


@dataclass(frozen=True)
class LogProbMemory:
    """One actor GPU during the log-prob forwards (the old log-probs, the reference's): nothing
    is kept for a backward, so a layer's activations live only while it runs."""

    resident: int
    """What the actor holds: its idle state plus its weights (as during the weight sync)."""
    activations: int
    log_probs: int
    other_roles: int
    tokens_per_micro_batch: int

    @property
    def total(self) -> int:
        """Everything the GPU holds at the peak of a log-prob forward."""
        return self.resident + self.activations + self.log_probs + self.other_roles


@dataclass(frozen=True)
class EngineMemory:
    """One GPU of a rollout engine; the pool numbers need ``resources.gpu_memory_gb``."""

    gpus_per_engine: int
    weights: int
    kv_bytes_per_sequence: int
    free_at_load: int | None
    """What is free on the GPU when the engine loads: the GPU less what colocated train roles
    keep (None without ``resources.gpu_memory_gb``)."""
    usable: int | None
    """The engine's weights and KV pool: gpu_memory_utilization x ``free_at_load`` (SGLang's
    sizing)."""
    max_num_seqs: int | None
    train_resident: int
    colocated: bool

    @property
    def kv_pool(self) -> int | None:
        """KV-cache pool: what the memory fraction leaves after the weights."""
        return None if self.usable is None else max(0, self.usable - self.weights)

    @property
    def sequences_fit(self) -> int | None:
        """Full-length sequences the KV pool holds."""
        pool = self.kv_pool
        return None if pool is None else pool // self.kv_bytes_per_sequence

    @property
    def total(self) -> int:
        """The engine's share (weights + KV pool) plus what colocated train roles keep."""
        return max(self.usable or 0, self.weights) + self.train_resident


@dataclass(frozen=True)
class Estimates:
    """Everything ``megarl config show`` prints under "estimates"."""

    params: ParamCounts
    update: UpdateMemory
    actor_resident: int
    sync_actor: int
    """What the actor holds during the weight sync: what it keeps idle, plus its weights."""
    buckets: int
    """The sender's bucket buffers: two of ``checkpoint_engine.bucket_size_mb`` (double
    buffering; :class:`~megarl.weights.buckets.BufferPool`)."""
    sync: int
    log_prob: LogProbMemory
    engine: EngineMemory | None
    gpu_memory: int | None


# ---------------------------------------------------------------------------------------------
# Parameters and state per GPU


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """Layer indices of pipeline ``stage`` (even split, the last stage takes the remainder)."""
    per_stage = math.ceil(num_layers / pp)
    return range(min(num_layers, stage * per_stage), min(num_layers, (stage + 1) * per_stage))


def stage_params(model: ModelInfo, p: ParallelConfig, stage: int,
                 vocab: int) -> tuple[int, int]:
    """(non-expert, routed-expert) parameters on one GPU of pipeline ``stage``."""
    layers = stage_layers(model.num_layers, p.pp, stage)
    dense_set = set(model.dense_layers)
    n_dense = sum(1 for i in layers if i in dense_set)
    n_moe = len(layers) - n_dense
    dense = (len(layers) * model.attention_params()
             + n_dense * 3 * model.hidden_size * model.ffn_hidden_size
             + n_moe * model.moe_layer_shared_params())
    embedding = vocab * model.hidden_size
    if stage == 0:
        dense += embedding
    if stage == p.pp - 1 and (not model.tie_word_embeddings or p.pp > 1):
        dense += embedding
    expert = n_moe * model.num_experts * model.expert_params()
    return math.ceil(dense / p.tp), math.ceil(expert / (p.ep * p.expert_tp))


def _shards(value: float | None) -> float:
    """A data-parallel size usable as a divisor (1 when unknown or below 1)."""
    return float(value) if isinstance(value, int | float) and value >= 1 else 1.0


def optimizer_shards(layout: RoleLayout, distributed_optimizer: bool) -> tuple[float, float]:
    """The ranks that share the optimizer state of a (non-expert, expert) parameter."""
    if not distributed_optimizer:
        return 1.0, 1.0
    return _shards(layout.dp) * layout.cp, _shards(layout.expert_dp)


def train_state(dense: int, expert: int, layout: RoleLayout, dtype: str,
                distributed_optimizer: bool, adapters: tuple[int, int] | None = None
                ) -> TrainState:
    """Weights, fp32 grads and Adam state of ``dense`` + ``expert`` parameters on one GPU; with
    LoRA ``adapters`` (non-expert, routed-expert adapter parameters) the only ones with grads
    and state (a routed expert's adapters sharded over expert-DP, as the experts)."""
    per_param = ADAM_MOMENT_BYTES + (0 if dtype == "float32" else MASTER_BYTES)
    dense_shards, expert_shards = optimizer_shards(layout, distributed_optimizer)
    if adapters is not None:
        (dense_lora, expert_lora), lora = adapters, sum(adapters)
        return TrainState(dense_params=dense + dense_lora, expert_params=expert + expert_lora,
                          weights=(dense + expert + lora) * DTYPE_BYTES[dtype],
                          grads=lora * GRAD_BYTES, optimizer=math.ceil(per_param * (
                              dense_lora / dense_shards + expert_lora / expert_shards)),
                          moments=math.ceil(ADAM_MOMENT_BYTES * (
                              dense_lora / dense_shards + expert_lora / expert_shards)))
    params = dense + expert
    return TrainState(
        dense_params=dense, expert_params=expert,
        weights=params * DTYPE_BYTES[dtype], grads=params * GRAD_BYTES,
        optimizer=math.ceil(per_param * (dense / dense_shards + expert / expert_shards)),
        moments=math.ceil(ADAM_MOMENT_BYTES * (dense / dense_shards + expert / expert_shards)))


def stage_adapter_params(cfg: RunConfig, model: ModelInfo, stage: int
                         ) -> tuple[int, int] | None:
    """The actor's (non-expert, routed-expert) adapter parameters on one GPU of ``stage``."""
    lora, p = cfg.actor.lora, cfg.actor.parallel
    if lora.rank == 0 or model.is_mla:
        return None
    moe_layers = [model.is_moe and i not in model.dense_layers for i in range(model.num_layers)]
    shared = model.shared_expert_ffn_hidden_size > 0
    widths = {"hidden": model.hidden_size, "q": model.num_attention_heads * model.head_dim,
              "kv": model.num_kv_heads * model.head_dim, "ffn": model.ffn_hidden_size,
              "shared_ffn": model.shared_expert_ffn_hidden_size,
              "expert_ffn": model.moe_ffn_hidden_size,
              "local_experts": -(-model.num_experts // p.ep) if model.is_moe else 0}
    names = [n for n in lora_layer_names(moe_layers, shared, resolve_targets(
        moe_layers, shared, lora.target_modules)) if not is_excluded(n, lora.exclude_modules)
        and int(n.split(".")[1]) in stage_layers(model.num_layers, p.pp, stage)]
    return adapter_counts(names, lora.rank, widths, p.tp, p.expert_tp)


def role_state(cfg: RunConfig, model: ModelInfo, layout: RoleLayout, parallel: ParallelConfig,
               vocab: int) -> TrainState:
    """The state of a role on its worst pipeline stage (the one holding the most bytes)."""
    states = [train_state(*stage_params(model, parallel, stage, vocab), layout, cfg.model.dtype,
                          cfg.actor.use_distributed_optimizer) for stage in range(parallel.pp)]
    return max(states, key=lambda s: s.total)


# ---------------------------------------------------------------------------------------------
# Activations


def layer_activation_bytes(model: ModelInfo, p: ParallelConfig, moe: bool, nbytes: int) -> float:
    """Bytes one token leaves for backward in one layer (formula in the module docstring)."""
    h, t = model.hidden_size, p.tp
    s = t if p.sequence_parallel and t > 1 else 1
    heads = model.num_attention_heads
    if model.is_mla:
        qk = model.qk_nope_head_dim + model.qk_rope_head_dim
        latents = model.q_lora_rank + model.kv_lora_rank + model.qk_rope_head_dim
        attention = 2 * h / s + latents + heads * (2 * qk + 2 * model.v_head_dim) / t
    else:
        attention = 2 * h / s + model.head_dim * (2 * heads + 2 * model.num_kv_heads) / t
    if moe:
        routed = model.top_k * (p.expert_tp * h + 3 * model.moe_ffn_hidden_size) / s
        mlp = (2 * h + 2 * model.num_experts) / s + routed + (
            3 * model.shared_expert_ffn_hidden_size / t)
    else:
        mlp = 2 * h / s + 3 * model.ffn_hidden_size / t
    return (attention + mlp) * nbytes


def stage_activation_bytes(model: ModelInfo, p: ParallelConfig, recompute: RecomputeConfig,
                           stage: int, nbytes: int) -> float:
    """Bytes per token of one micro-batch that pipeline ``stage`` keeps for backward."""
    dense_set = set(model.dense_layers)
    layers = [layer_activation_bytes(model, p, model.is_moe and i not in dense_set, nbytes)
              for i in stage_layers(model.num_layers, p.pp, stage)]
    if recompute.granularity != "full" or not layers:
        return sum(layers)
    s = p.tp if p.sequence_parallel and p.tp > 1 else 1
    unit_input = model.hidden_size / s * nbytes
    n = recompute.num_layers
    if recompute.method == "uniform":
        units = [layers[i:i + n] for i in range(0, len(layers), n)]
        return len(units) * unit_input + max(sum(u) for u in units)
    head, rest = layers[:n], layers[n:]
    return len(head) * unit_input + sum(rest) + max(head)


def micro_batch_tokens(cfg: RunConfig, sizes: DerivedSizes) -> int:
    """Tokens of one micro-batch on one GPU (padded to the longest sequence), after cp."""
    cp = cfg.actor.parallel.cp
    if sizes.token_budget_per_micro_batch is not None:
        return math.ceil(sizes.token_budget_per_micro_batch / cp)
    micro = sizes.micro_batch_size_per_gpu
    sequences = micro if is_whole(micro) else 1
    return math.ceil(sequences * sizes.max_sequence_length / cp)


def micro_batches_in_flight(p: ParallelConfig, stage: int,
                            micro_batches: float | None) -> float:
    """Micro-batches whose activations ``stage`` holds at once under the 1F1B schedule."""
    if p.pp == 1:
        return 1.0
    count = float(p.pp - stage)
    if is_whole(micro_batches):
        count = min(count, float(micro_batches))
    if p.vpp:
        count *= 1 + (p.pp - 1) / (p.pp * p.vpp)
    return count


# ---------------------------------------------------------------------------------------------
# Phases


def idle_roles_bytes(cfg: RunConfig, model: ModelInfo, sizes: DerivedSizes, vocab: int) -> int:
    """What the reference and critic keep on a train GPU while the actor works."""
    total = 0
    if sizes.ref is not None and cfg.ref.parallel is not None and cfg.ref.enabled:
        state = role_state(cfg, model, sizes.ref, cfg.ref.parallel, vocab)
        total += 0 if cfg.ref.offload.param_offload else state.weights
    if sizes.critic is not None and cfg.critic.parallel is not None and cfg.critic.enabled:
        state = role_state(cfg, model, sizes.critic, cfg.critic.parallel, vocab)
        total += state.resident(cfg.critic.offload)
    return total


LOG_PROB_CHUNK_ELEMENTS = 1 << 26
"""fp32 logits per chunk of rows on the log-prob path (megarl.megatron.vocab_parallel's
CHUNK_ELEMENTS; a test holds them equal)."""


def log_prob_bytes(cfg: RunConfig, model: ModelInfo, tokens: int, vocab: int,
                   nbytes: int) -> float:
    """The last stage's log-prob memory for a micro-batch of ``tokens`` (module docstring)."""
    local_vocab = vocab / cfg.actor.parallel.tp
    if cfg.actor.cuda_graphs:  # the graphs hold the whole micro-batch's logits
        return tokens * local_vocab * (nbytes + FP32_BYTES)
    chunk = min(tokens * local_vocab, LOG_PROB_CHUNK_ELEMENTS)
    trained = cfg.actor.lora.rank == 0  # LoRA freezes the output layer: no weight gradient
    weight_grad = local_vocab * model.hidden_size * (FP32_BYTES + nbytes) if trained else 0
    hidden = 2 * tokens * model.hidden_size * nbytes
    return chunk * (nbytes + 2 * FP32_BYTES) + weight_grad + hidden


def log_prob_tokens(cfg: RunConfig, sizes: DerivedSizes) -> int:
    """Tokens of one log-prob forward on one GPU: the larger of the actor's and the reference's
    budget (``*.log_prob_max_token_len_per_gpu``; sequences x the longest one, over cp)."""
    a, ref = cfg.actor, cfg.ref
    with_ref = bool(ref.enabled)
    if a.use_dynamic_bsz:
        return max(a.log_prob_max_token_len_per_gpu,
                   ref.log_prob_max_token_len_per_gpu if with_ref else 0)
    micro = sizes.micro_batch_size_per_gpu
    sequences = max(a.log_prob_micro_batch_size_per_gpu or 0,
                    (ref.log_prob_micro_batch_size_per_gpu or 0) if with_ref else 0)
    sequences = sequences or (micro if is_whole(micro) else 1)
    return math.ceil(sequences * sizes.max_sequence_length / a.parallel.cp)


def log_prob_memory(cfg: RunConfig, model: ModelInfo, sizes: DerivedSizes, vocab: int,
                    resident: int, other_roles: int) -> LogProbMemory:
    """The log-prob forward's peak: the largest layer's activations for the forward's tokens,
    and on the last stage a chunk of logits (:data:`LOG_PROB_CHUNK_ELEMENTS`) with the gathered
    hidden states (no gradients: module docstring)."""
    p, nbytes = cfg.actor.parallel, DTYPE_BYTES[cfg.model.dtype]
    tokens = log_prob_tokens(cfg, sizes)
    dense = set(model.dense_layers)
    kinds = {model.is_moe and i not in dense for i in range(model.num_layers)}
    layer = max(layer_activation_bytes(model, p, moe, nbytes) for moe in kinds)
    chunk = min(tokens * vocab / p.tp, LOG_PROB_CHUNK_ELEMENTS)
    return LogProbMemory(resident=resident, activations=math.ceil(layer * tokens),
                         log_probs=math.ceil(chunk * (nbytes + 2 * FP32_BYTES)
                                             + tokens * model.hidden_size * nbytes),
                         other_roles=other_roles, tokens_per_micro_batch=tokens)


def update_memory(cfg: RunConfig, model: ModelInfo, sizes: DerivedSizes, vocab: int,
                  other_roles: int) -> UpdateMemory:
    """The actor GPU of the pipeline stage with the highest peak during the update."""
    p, nbytes = cfg.actor.parallel, DTYPE_BYTES[cfg.model.dtype]
    tokens = micro_batch_tokens(cfg, sizes)
    offload = cfg.actor.offload
    window = 3 * max(offload.optimizer_step_chunk_mb << 20, math.ceil(
        ADAM_MOMENT_BYTES * vocab * model.hidden_size / p.tp)) if (
        offload.optimizer_offload and offload.optimizer_step_chunk_mb) else 0
    candidates = []
    for stage in range(p.pp):
        state = train_state(*stage_params(model, p, stage, vocab), sizes.actor, cfg.model.dtype,
                            cfg.actor.use_distributed_optimizer,
                            stage_adapter_params(cfg, model, stage))
        flight = micro_batches_in_flight(p, stage, sizes.micro_batches_per_mini_batch)
        per_token = stage_activation_bytes(model, p, cfg.actor.recompute, stage, nbytes)
        logits = (log_prob_bytes(cfg, model, tokens, vocab, nbytes)
                  if stage == p.pp - 1 else 0)
        candidates.append(UpdateMemory(
            stage=stage, pp=p.pp, state=state, activations=math.ceil(per_token * tokens * flight),
            logits=math.ceil(logits), other_roles=other_roles, tokens_per_micro_batch=tokens,
            micro_batches_in_flight=flight,
            optimizer_deferred=bool(offload.optimizer_offload), stream_window=window))
    return max(candidates, key=lambda m: m.total)


def engine_memory(cfg: RunConfig, model: ModelInfo, sizes: DerivedSizes,
                  train_resident: int) -> EngineMemory | None:
    """One rollout-engine GPU (None without a rollout pool)."""
    if sizes.rollout_pool_gpus is None:
        return None
    resident = train_resident if cfg.rollout.colocate else 0
    free, usable, weights, per_seq = engine_share(cfg, model, resident)
    return EngineMemory(
        gpus_per_engine=cfg.rollout.gpus_per_engine, weights=weights,
        kv_bytes_per_sequence=per_seq, free_at_load=free, usable=usable,
        max_num_seqs=sizes.max_num_seqs, train_resident=resident,
        colocated=cfg.rollout.colocate)


def estimate(cfg: RunConfig, model: ModelInfo, sizes: DerivedSizes) -> Estimates:
    """Parameter counts and per-GPU memory of every phase of ``cfg`` with ``model``."""
    vocab = sizes.padded_vocab_size or model.vocab_size
    other = idle_roles_bytes(cfg, model, sizes, vocab)
    update = update_memory(cfg, model, sizes, vocab, other)
    actor_resident = update.state.resident(cfg.actor.offload)
    sync_actor = actor_resident + (update.state.weights if cfg.actor.offload.param_offload else 0)
    engine = engine_memory(cfg, model, sizes, actor_resident + other)
    buckets = BUCKETS_IN_FLIGHT * cfg.checkpoint_engine.bucket_size_mb * 2**20
    sync = sync_actor + other + buckets + (
        engine.weights if engine is not None and engine.colocated else 0)
    mem = cfg.resources.gpu_memory_gb
    return Estimates(params=ParamCounts.of(model), update=update, actor_resident=actor_resident,
                     sync_actor=sync_actor, buckets=buckets, sync=sync,
                     log_prob=log_prob_memory(cfg, model, sizes, vocab, sync_actor, other),
                     engine=engine, gpu_memory=None if mem is None else int(mem * GB))


def resolve_sizes(cfg: RunConfig, model: ModelInfo | None) -> DerivedSizes:
    """:func:`derive_sizes` with a colocated engine's KV cache (and so ``rollout.max_num_seqs:
    auto``) sized as the engine will be: on what is free next to what the train roles keep while
    it generates, which only the estimates know."""
    sizes = derive_sizes(cfg, model)
    if model is None or not cfg.rollout.colocate or cfg.resources.gpu_memory_gb is None:
        return sizes
    engine = estimate(cfg, model, sizes).engine
    return sizes if engine is None else derive_sizes(cfg, model, engine.train_resident)


def phase_estimates(est: Estimates) -> dict[str, int]:
    """Bytes one GPU needs at the peak of each phase (the names of :mod:`megarl.memory`), what
    the other roles hold meanwhile included: the colocated engine's weights and KV cache next
    to what the train roles keep while it generates; the engine's weights during the sync;
    nothing of the engine's during the log-prob forwards and the update, which it released."""
    phases = {"gen": est.engine.total} if est.engine is not None else {}
    return {**phases, "old_log_prob": est.log_prob.total, "update_actor": est.update.total,
            "sync_weights": est.sync}


# ---------------------------------------------------------------------------------------------
# Display (the rest: estimates_report.py)


def size(nbytes: float) -> str:
    """Bytes as GB (2**30) with one decimal, or MB / KB below one GB."""
    for unit, scale in (("GB", GB), ("MB", 2**20)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes / 2**10:.1f} KB"
