"""Host (CPU) memory per node of a GPU run, printed by ``megarl config show`` next to the GPU
estimates and held against every node's available memory before any worker starts
(:func:`megarl.memory_preflight.host_preflight`). GB = 2**30 bytes.

What a node holds in host memory, per part (all at once: the offloaded state stays in host
memory while the engines generate, and the engines' released weights while the actor trains):

* Offloaded train state, per train GPU (one actor rank; one critic rank with GAE): the parts its
  ``offload`` moves, in the GPU estimate's own sizes (:class:`~megarl.config.estimates
  .TrainState` of the worst pipeline stage, counted for every rank), so the two cannot disagree:
  ``param_offload`` its weights, ``optimizer_offload`` its fp32 main params and Adam moments.
  ``grad_offload`` costs nothing here: :mod:`megarl.megatron.offload` frees the gradient
  buffers without copying them (every update zeroes them first). The reference keeps its
  weights there with ``ref.offload.param_offload``.
* Round-up: :mod:`megarl.megatron.offload` packs each part's storages into the slabs of a
  :class:`~megarl.host_arena.HostArena`: full slabs of :data:`~megarl.host_arena.SLAB_BYTES`
  (a power of two, which torch's pinned-memory allocator does not round) and one slab of the
  next power of two of the rest, so a part of B bytes holds less than B + one slab.
* Released engine weights, per colocated engine GPU, only with the LoRA adapter sync
  (``actor.lora.sync: adapter``), which never resends the base: its engines start with
  ``--enable-weights-cpu-backup`` and keep released weights in host memory. megarl's embedded
  engine pins one buffer per tensor, which torch's pinned-memory allocator rounds up to the
  next power of two (its tensors counted in megatron's layout: HF's split q/k/v and gate/up
  round alike up to a few MB per layer); SGLang's torch_memory_saver keeps a plain copy. Every
  other colocated engine counts 0: without the flag ``release_memory_occupation`` drops the
  weights (SGLang: a torch_memory_saver region without CPU backup; the embedded engine frees
  its parameters' storage) and the next weight sync refills them.
* Checkpoint staging (``trainer.async_save``): each rank's weights and optimizer state, copied
  to host memory while the save is written.
* Processes: an allowance for each worker process the run starts, for its libraries, CUDA
  context and buffers (:data:`TRAIN_PROCESS_BYTES` per train rank, :data:`ENGINE_PROCESS_BYTES`
  per engine GPU), and :data:`NODE_BYTES` per node. Allowances, not measurements. The driver
  and Ray's daemons already run when the preflight reads the available memory, so they are not
  counted again.

A node holds the most the pools can place on it: each pool puts ``gpus_per_node`` GPUs on each
of its ``nnodes`` nodes, and a node with GPUs enough for several takes them all.

CPU runs (``resources.device=cpu``) have no host estimate: there the roles' state lives in host
memory all the time (it is what the phases' estimates count) and offload moves nothing, so
adding it again would count it twice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from megarl.config.derived import DerivedSizes, RoleLayout
from megarl.config.estimates import (
    GB,
    Estimates,
    TrainState,
    estimate,
    phase_estimates,
    size,
    stage_layers,
    stage_params,
    train_state,
)
from megarl.config.model_info import DTYPE_BYTES, ModelInfo
from megarl.config.schema import OffloadConfig, ParallelConfig, RunConfig

TRAIN_PROCESS_BYTES = 4 * GB
"""Host memory of one train rank's process (actor or critic) besides what it offloads."""
ENGINE_PROCESS_BYTES = 4 * GB
"""Host memory of one engine GPU's processes (SGLang runs a scheduler per GPU and a tokenizer
and detokenizer per engine) besides released weights."""
NODE_BYTES = 8 * GB
"""Per node: Ray's object store holding the step's batches, the driver's growth, and the page
cache that the running programs' code needs (a node whose available memory runs out evicts it,
reads it back again and again, and stops answering: Ray then marks it dead)."""

Tensors = list[tuple[int, int]]
"""(elements, count) of weight tensors."""


@dataclass(frozen=True)
class HostPart:
    """One thing held in host memory: its bytes, and what the pinned allocator adds to them."""

    name: str
    nbytes: int
    round_up: int = 0

    @property
    def total(self) -> int:
        """Bytes with the round-up."""
        return self.nbytes + self.round_up

    def times(self, k: int) -> HostPart:
        """The part of ``k`` GPUs."""
        return replace(self, nbytes=self.nbytes * k, round_up=self.round_up * k)

    def text(self) -> str:
        """``name X GB`` (``(+Y GB round-up)`` when rounded)."""
        extra = f" (+{size(self.round_up)} round-up)" if self.round_up else ""
        return f"{self.name} {size(self.nbytes)}{extra}"


@dataclass(frozen=True)
class PoolHost:
    """What one GPU of a pool puts in host memory, and how the pool spreads over nodes."""

    nnodes: int
    gpus_per_node: int
    per_gpu: tuple[HostPart, ...]

    @property
    def gpu_total(self) -> int:
        """Bytes of one GPU's parts."""
        return sum(p.total for p in self.per_gpu)


@dataclass(frozen=True)
class NodeHost:
    """The host memory one node needs: the GPUs of each pool placed there, and the parts."""

    train_gpus: int
    rollout_gpus: int
    parts: tuple[HostPart, ...]

    @property
    def total(self) -> int:
        """Bytes of every part."""
        return sum(p.total for p in self.parts)

    def breakdown(self) -> str:
        """``part + part + ... for N train GPU(s)``."""
        gpus = [f"{n} {pool} GPU(s)" for n, pool in ((self.train_gpus, "train"),
                                                     (self.rollout_gpus, "rollout")) if n]
        return " + ".join(p.text() for p in self.parts) + f" for {' and '.join(gpus)}"


@dataclass(frozen=True)
class HostEstimate:
    """Host memory of a GPU run: per GPU of each pool, and per node."""

    train: PoolHost
    rollout: PoolHost | None
    """A separate rollout pool (None when the engines are colocated)."""

    def on_node(self, gpus: int | None = None) -> NodeHost:
        """The most the pools can place on a node with ``gpus`` GPUs (None: one train node)."""
        t, r = self.train, self.rollout
        if gpus is None:
            return self.place(1, 0)
        best = self.place(0, 0)
        for a in range(min(t.nnodes, gpus // t.gpus_per_node) + 1):
            b = 0 if r is None else min(r.nnodes, (gpus - a * t.gpus_per_node) // r.gpus_per_node)
            node = self.place(a, b)
            if node.total > best.total:
                best = node
        return best

    def place(self, train_nodes: int, rollout_nodes: int) -> NodeHost:
        """A node holding ``train_nodes`` of the train pool's nodes and ``rollout_nodes`` of the
        rollout pool's."""
        t, r = self.train, self.rollout
        n_train = train_nodes * t.gpus_per_node
        n_rollout = rollout_nodes * r.gpus_per_node if r is not None else 0
        parts = [p.times(n_train) for p in t.per_gpu] if n_train else []
        parts += [p.times(n_rollout) for p in r.per_gpu] if r is not None and n_rollout else []
        if parts:
            parts.append(HostPart("processes", NODE_BYTES))
        merged: dict[str, HostPart] = {}
        for p in parts:
            old = merged.get(p.name)
            merged[p.name] = p if old is None else replace(
                old, nbytes=old.nbytes + p.nbytes, round_up=old.round_up + p.round_up)
        return NodeHost(n_train, n_rollout, tuple(merged.values()))


# ---------------------------------------------------------------------------------------------
# Pinned buffers


def pinned(nbytes: int) -> int:
    """Bytes torch's pinned-memory allocator takes for a buffer of ``nbytes``: the next power
    of two (CachingHostAllocator's rounding, on by default)."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


SLAB_BYTES = 1 << 30
""":data:`megarl.host_arena.SLAB_BYTES` (config imports nothing outside itself; a test holds
the two equal)."""


def arena_round_up(nbytes: int) -> int:
    """What a :class:`~megarl.host_arena.HostArena` holding ``nbytes`` adds to them: its full
    slabs are exact, the last one is the next power of two of the rest (alignment padding,
    at most 512 bytes a tensor, left out)."""
    rest = nbytes % SLAB_BYTES
    return pinned(rest) - rest


def round_up(tensors: Tensors, nbytes: int, shards: float = 1.0) -> int:
    """What pinning each tensor (its ``shards``-th share, ``nbytes`` per element) adds."""
    total = 0
    for elements, count in tensors:
        b = math.ceil(elements / shards) * nbytes
        total += count * (pinned(b) - b)
    return total


def stage_tensors(model: ModelInfo, p: ParallelConfig, stage: int,
                  vocab: int) -> tuple[Tensors, Tensors]:
    """(non-expert, routed-expert) weight tensors on one GPU of pipeline ``stage``, megatron's
    layout (module docstring); they add up to :func:`~megarl.config.estimates.stage_params`
    but for each tensor's split over tp rounding up."""
    layers = stage_layers(model.num_layers, p.pp, stage)
    dense_set = set(model.dense_layers)
    n_dense = sum(1 for i in layers if i in dense_set)
    n_moe = len(layers) - n_dense
    h, n = model.hidden_size, len(layers)
    proj = model.num_attention_heads * (model.v_head_dim if model.is_mla else model.head_dim) * h
    dense = [(proj, n), (model.attention_params() - proj, n),
             (2 * h * model.ffn_hidden_size, n_dense), (h * model.ffn_hidden_size, n_dense)]
    if n_moe:
        shared = model.shared_expert_ffn_hidden_size
        dense += [(h * model.num_experts, n_moe), (2 * h * shared, n_moe), (h * shared, n_moe)]
    ends = int(stage == 0) + int(stage == p.pp - 1 and (not model.tie_word_embeddings
                                                         or p.pp > 1))
    dense.append((vocab * h, ends))
    experts = n_moe * model.num_experts // p.ep
    expert = [(2 * h * model.moe_ffn_hidden_size, experts), (h * model.moe_ffn_hidden_size,
                                                              experts)]
    return ([(math.ceil(e / p.tp), c) for e, c in dense if e and c],
            [(math.ceil(e / p.expert_tp), c) for e, c in expert if e and c])


# ---------------------------------------------------------------------------------------------
# Parts


def _worst_state(cfg: RunConfig, model: ModelInfo, layout: RoleLayout, p: ParallelConfig,
                 vocab: int) -> TrainState:
    """The state of the pipeline stage :func:`~megarl.config.estimates.role_state` reports."""
    states = [train_state(*stage_params(model, p, s, vocab), layout, cfg.model.dtype,
                          cfg.actor.use_distributed_optimizer) for s in range(p.pp)]
    return max(states, key=lambda st: st.total)


def _role_parts(role: str, state: TrainState, offload: OffloadConfig) -> list[HostPart]:
    """The parts one rank of a trained role offloads (with LoRA the optimizer state is the
    adapters'; the frozen weights are its params)."""
    parts = []
    if offload.param_offload:
        parts.append(HostPart(f"{role} params", state.weights, arena_round_up(state.weights)))
    if offload.optimizer_offload and state.optimizer:
        parts.append(HostPart(f"{role} optimizer", state.optimizer,
                              arena_round_up(state.optimizer)))
    return parts


def _train_gpu(cfg: RunConfig, model: ModelInfo, sizes: DerivedSizes,
               est: Estimates) -> list[HostPart]:
    """The parts of one train GPU: its ranks' offloaded state, staging, a colocated engine's
    released weights, and the processes."""
    vocab = sizes.padded_vocab_size or model.vocab_size
    a, st = cfg.actor, est.update.state
    parts = _role_parts("actor", st, a.offload)
    processes = TRAIN_PROCESS_BYTES
    if cfg.ref.enabled and sizes.ref is not None and cfg.ref.offload.param_offload:
        ref = _worst_state(cfg, model, sizes.ref, cfg.ref.parallel or a.parallel, vocab)
        parts.append(HostPart("ref params", ref.weights, arena_round_up(ref.weights)))
    if cfg.critic.enabled and sizes.critic is not None:
        critic = _worst_state(cfg, model, sizes.critic, cfg.critic.parallel or a.parallel, vocab)
        parts += _role_parts("critic", critic, cfg.critic.offload)
        processes += TRAIN_PROCESS_BYTES
    if cfg.trainer.async_save:
        parts.append(HostPart("checkpoint staging", st.weights + st.optimizer))
    engine = est.engine
    if engine is not None and engine.colocated:
        if cfg.actor.lora.rank and cfg.actor.lora.sync == "adapter":  # released weights kept
            share = 0
            if cfg.rollout.backend == "local":
                dense, expert = stage_tensors(model, ParallelConfig(), 0, model.vocab_size)
                share = round_up(dense + expert, DTYPE_BYTES[cfg.rollout.dtype or cfg.model.dtype])
            parts.append(HostPart("engine weights", engine.weights,
                                  math.ceil(share / engine.gpus_per_engine)))
        processes += ENGINE_PROCESS_BYTES
    return [*parts, HostPart("processes", processes)]


def host_estimate(cfg: RunConfig, model: ModelInfo, sizes: DerivedSizes,
                  est: Estimates | None = None) -> HostEstimate:
    """Host memory per GPU of each pool of ``cfg`` (a GPU run; ``est``: its GPU estimate)."""
    est = est or estimate(cfg, model, sizes)
    train = cfg.resources.train_pool
    rollout = cfg.resources.rollout_pool
    return HostEstimate(
        train=PoolHost(train.nnodes, train.gpus_per_node,
                       tuple(_train_gpu(cfg, model, sizes, est))),
        rollout=None if cfg.rollout.colocate or rollout is None else PoolHost(
            rollout.nnodes, rollout.gpus_per_node,
            (HostPart("processes", ENGINE_PROCESS_BYTES),)))


# ---------------------------------------------------------------------------------------------
# What lowers it


OFFLOAD_SWITCHES = (
    ("actor.offload.optimizer_offload", "actor optimizer"),
    ("actor.offload.param_offload", "actor params"),
    ("ref.offload.param_offload", "ref params"),
    ("critic.offload.optimizer_offload", "critic optimizer"),
    ("critic.offload.param_offload", "critic params"),
)
"""The offload switches and the part each puts in host memory."""


def with_values(cfg: RunConfig, values: dict[str, Any]) -> RunConfig:
    """A copy of ``cfg`` with the dotted fields of ``values`` set."""
    copy = cfg.model_copy(deep=True)
    for dotted, value in values.items():
        *path, name = dotted.split(".")
        section: Any = copy
        for key in path:
            section = getattr(section, key)
        setattr(section, name, value)
    return copy


def _gpu_room(cfg: RunConfig, model: ModelInfo, sizes: DerivedSizes, field: str,
              gpu_free: int | None) -> str | None:
    """The advice to switch ``field`` off, when the GPU phases still fit ``gpu_free`` bytes
    (lowering a colocated engine's memory fraction where only generation does not); None when
    they cannot."""
    changed = with_values(cfg, {field: False})
    est = estimate(changed, model, sizes)
    phases = phase_estimates(est)
    need = max(phases.values())
    if gpu_free is None:
        return f"{field}=false if a GPU has ~{size(need)} for its phases"
    if need <= gpu_free:
        return f"{field}=false (the GPU phases then need ~{size(need)} of {size(gpu_free)})"
    engine = est.engine
    if [name for name in phases if phases[name] > gpu_free] != ["gen"] or (
            engine is None or not engine.free_at_load):
        return None
    # the engine takes the fraction of what is free when it loads (the GPU less what the train
    # roles keep; SGLang's sizing): gen needs fraction x (GPU - kept) + kept
    free_at_load = engine.free_at_load
    fraction = math.floor((gpu_free - engine.train_resident) / free_at_load * 20) / 20
    if fraction * free_at_load <= engine.weights:  # no room left for a KV cache
        return None
    lowered = with_values(changed, {"rollout.gpu_memory_utilization": fraction})
    if max(phase_estimates(estimate(lowered, model, sizes)).values()) > gpu_free:
        return None
    return (f"{field}=false with rollout.gpu_memory_utilization={fraction:.2f} (the GPU phases "
            f"then fit {size(gpu_free)})")


def host_fixes(cfg: RunConfig, model: ModelInfo, sizes: DerivedSizes, host: HostEstimate,
               node: NodeHost, available: int | None, gpu_free: int | None) -> list[str]:
    """What lowers ``node``'s host memory, each naming its fields: an offload switched off
    where the GPUs have room (``gpu_free`` bytes; None = unknown), the merged LoRA sync instead
    of the adapter sync, the distributed optimizer, fewer train GPUs per node (as many as fit
    ``available``). A part that frees less than a quarter of what is missing is not offered."""
    missing = 0 if available is None else node.total - available
    parts = {p.name: p for p in node.parts if p.total * 4 >= missing}
    fixes = []
    for field, part in OFFLOAD_SWITCHES:
        if part in parts:
            room = _gpu_room(cfg, model, sizes, field, gpu_free)
            if room is not None:
                fixes.append(f"{room}, freeing {size(parts[part].total)} here")
    if "engine weights" in parts:
        fixes.append("actor.lora.sync=merged (the engines then drop released weights instead of "
                     f"keeping them in host memory), freeing {size(parts['engine weights'].total)}")
    if not cfg.actor.use_distributed_optimizer and "actor optimizer" in parts:
        fixes.append("actor.use_distributed_optimizer=true (shards the optimizer state over the "
                     "data-parallel ranks)")
    per_gpu = host.train.gpu_total
    if node.train_gpus and available is not None:
        rollout = node.total - node.train_gpus * per_gpu - NODE_BYTES
        fit = (available - NODE_BYTES - rollout) // per_gpu
        if 1 <= fit < host.train.gpus_per_node:
            fixes.append(f"resources.train_pool.gpus_per_node={fit} (~{size(per_gpu)} per train "
                         "GPU; raise resources.train_pool.nnodes to keep the GPUs)")
    return fixes


# ---------------------------------------------------------------------------------------------
# Display


def host_rows(cfg: RunConfig, model: ModelInfo | None,
              sizes: DerivedSizes) -> list[tuple[str, str]]:
    """``megarl config show``'s rows of host memory per node (after the GPU rows)."""
    if model is None:
        return []
    if cfg.resources.device == "cpu":
        return [("host memory", ("CPU run: the roles' state is host memory (the rows above); "
                                 "offload moves nothing"))]
    host = host_estimate(cfg, model, sizes)
    rows = [("host memory", f"train node: {_node_text(host.on_node())}")]
    if host.rollout is not None:
        rows.append(("", f"rollout node: {_node_text(host.place(0, 1))}"))
    return rows


def _node_text(node: NodeHost) -> str:
    return f"{node.breakdown()} = {size(node.total)}"
