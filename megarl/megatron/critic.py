"""The critic (value model) of GAE on megatron-core: the actor's GPT body with a scalar head.

:func:`build_critic_model` builds the HF model's chunks exactly as the actor's
(:func:`~megarl.megatron.model.build_actor_model`, body weights from the HF safetensors), then
gives the last pipeline stage a :class:`ValueHead` instead of the vocabulary-parallel output
layer and unties the embedding from it. The head is one ``hidden -> 1`` linear, replicated on
every tensor-parallel rank (a one-wide output cannot be split over the vocabulary); under
sequence parallelism it first gathers the hidden states of the whole sequence, so every TP rank
predicts every position and computes the same loss, as the actor's log-probs do.

Alignment: the value of token ``j`` is the head's output at position ``j - 1``, the state from
which token ``j`` was generated (verl's ``values[:, -response_length - 1:-1]``); entry 0 is 0.

:func:`compute_values` is the forward-only pass (packed micro-batches, pipeline schedule,
broadcast from the last stage); :func:`critic_train_step` is one optimizer step on the clipped
value loss of :func:`megarl.algo.value_loss.value_loss`, split-invariant over micro-batches and
data-parallel ranks like the actor's update.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer import TransformerConfig

from megarl.algo.aggregation import loss_counts
from megarl.algo.value_loss import value_loss
from megarl.megatron import cpu_compat
from megarl.megatron.context_parallel import gather_context_parallel
from megarl.megatron.logprobs import gpt_forward, make_micro_batches
from megarl.megatron.model import ActorModel, RecomputeSettings, SpecChoice, build_actor_model
from megarl.megatron.optimizer import TrainableActor
from megarl.megatron.packing import PackedBatch
from megarl.megatron.parallel import ParallelSizes
from megarl.megatron.settings import ValueLossSettings

_METRICS = ("vf_loss", "vf_clipfrac", "vpred_sum", "tokens")


class ValueHead(torch.nn.Module):
    """``hidden -> 1`` linear on the last stage, the same on every tensor-parallel rank.

    Called as megatron's output layer: ``head(hidden [s, b, h], weight=None)`` returns
    ``(values [S, b, 1], None)`` with S the whole sequence (gathered under sequence parallelism).
    """

    def __init__(self, config: TransformerConfig, seed: int, device: torch.device) -> None:
        super().__init__()
        # one generator seeded the same way on every rank: the replicas start equal, under any
        # TP/PP layout, so layouts are comparable
        generator = torch.Generator().manual_seed(seed)
        weight = torch.empty(1, config.hidden_size).normal_(
            0.0, config.init_method_std, generator=generator)
        self.weight = torch.nn.Parameter(weight.to(device=device, dtype=config.params_dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, device=device, dtype=config.params_dtype))
        self.gather_sequence = config.sequence_parallel and config.tensor_model_parallel_size > 1
        for param in (self.weight, self.bias):
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)

    def forward(self, hidden_states: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        """Values of every position (``weight`` and ``runtime_gather_output`` are megatron's
        output-layer arguments, unused by a head that is not vocabulary-parallel)."""
        if self.gather_sequence:
            # each rank's loss covers every position, so the backward only keeps this rank's
            # slice of the gradient (no reduce-scatter sum over identical copies)
            hidden_states = tensor_parallel.gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False,
                group=mpu.get_tensor_model_parallel_group())
        return torch.nn.functional.linear(hidden_states, self.weight, self.bias), None


def build_critic_model(
    hf_path: str | Path,
    sizes: ParallelSizes,
    dtype: torch.dtype = torch.bfloat16,
    *,
    spec: SpecChoice = "auto",
    seed: int = 1234,
    recompute: RecomputeSettings | None = None,
    trust_remote_code: bool = False,
) -> ActorModel:
    """This rank's critic chunks: the HF model's body (weights loaded) under ``sizes``, with a
    :class:`ValueHead` (seeded by ``seed``) on the last pipeline stage."""
    overrides = recompute.config_overrides() if recompute is not None else None
    model = build_actor_model(hf_path, sizes, dtype, spec=spec, load_weights=True, seed=seed,
                              config_overrides=overrides, trust_remote_code=trust_remote_code)
    for chunk in model.chunks:
        # the embedding is the body's own; finalize_model_grads must not tie it to the head
        chunk.share_embeddings_and_output_weights = False
        if chunk.post_process:
            device = next(chunk.parameters()).device
            chunk.output_layer = ValueHead(model.config, seed, device)
    return model


@dataclass
class ValueSequence:
    """One sequence of a critic mini-batch; per-token tensors ``[L]`` aligned with ``tokens``
    (entry ``j`` concerns token ``j``; entry 0 is never trained on)."""

    tokens: torch.Tensor
    """Prompt and response token ids."""
    loss_mask: torch.Tensor
    """1 on the tokens whose value is trained (the response), else 0."""
    old_values: torch.Tensor
    """The values GAE used (the clipping centre)."""
    returns: torch.Tensor
    """The regression targets (GAE advantages + values)."""


def _head_values(output: torch.Tensor) -> torch.Tensor:
    """``[1, T, 1]`` head output -> ``[T]`` fp32 values per packed position."""
    return output[0, :, 0].float()


def compute_values(
    model: ActorModel,
    sequences: Sequence[torch.Tensor],
    *,
    max_tokens_per_micro_batch: int | None = None,
) -> list[torch.Tensor]:
    """Per sequence ``[L_i]`` fp32 values aligned with its tokens (entry 0 is 0); all ranks of
    the model-parallel group pass the same sequences and get the same values."""
    cpu_compat.enable()
    batches, groups = make_micro_batches(model, sequences, max_tokens_per_micro_batch)

    def forward_step(data_iterator, chunk):
        batch = next(data_iterator)
        return gpt_forward(chunk, batch), lambda out: (out.new_zeros(()),
                                                       {"values": _head_values(out)})

    was_training = [c.training for c in model.chunks]
    for chunk in model.chunks:
        chunk.eval()
    try:
        with torch.no_grad():
            results = _schedule(model, batches, forward_step,
                                max(b.num_tokens for b in batches), forward_only=True)
    finally:
        for chunk, training in zip(model.chunks, was_training):
            chunk.train(training)
    flat = _broadcast_values(results, batches)
    values: list[torch.Tensor | None] = [None] * len(sequences)
    for batch, group, part in zip(batches, groups, flat.split([b.num_tokens for b in batches])):
        part = gather_context_parallel(part, batch)
        for i, seq_values in zip(group, batch.unpack_shifted(part)):
            values[i] = seq_values
    return values


def _schedule(model: ActorModel, items: Sequence[Any], forward_step: Any, seq_length: int,
              forward_only: bool) -> list[dict[str, torch.Tensor]]:
    """megatron's pipeline schedule over micro-batches (one iterator per chunk); ``seq_length``
    is the longest packed row."""
    iterators = [iter(items) for _ in model.chunks]
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(iterators) > 1 else iterators[0],
        model=model.chunks,
        num_microbatches=len(items),
        seq_length=seq_length,
        micro_batch_size=1,
        forward_only=forward_only,
    )


def _broadcast_values(results: list[dict[str, torch.Tensor]],
                      batches: list[PackedBatch]) -> torch.Tensor:
    """The last stage's per-position values of all batches, ``[sum T]``, on every stage."""
    if mpu.is_pipeline_last_stage():
        flat = torch.cat([r["values"] for r in results]).contiguous()
    else:
        total = sum(b.num_tokens for b in batches)
        flat = torch.empty(total, dtype=torch.float32, device=batches[0].input_ids.device)
    if mpu.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(flat, src=mpu.get_pipeline_model_parallel_last_rank(),
                       group=mpu.get_pipeline_model_parallel_group())
    return flat


@dataclass
class _ValueMicroBatch:
    """A packed batch, each token's predicting position, and the padded ``[n, L_max]``
    training tensors of its sequences."""

    packed: PackedBatch
    gather_index: torch.Tensor
    loss_mask: torch.Tensor
    old_values: torch.Tensor
    returns: torch.Tensor

    @classmethod
    def build(cls, packed: PackedBatch, seqs: list[ValueSequence]) -> _ValueMicroBatch:
        """Pad the sequences' tensors; token ``j`` is read at packed position start + j - 1."""
        width = max(len(s.tokens) for s in seqs)
        index = torch.zeros(len(seqs), width, dtype=torch.long)
        padded = {k: torch.zeros(len(seqs), width) for k in ("loss_mask", "old_values", "returns")}
        for i, start in enumerate(packed.cu_seqlens_padded[:-1].tolist()):
            n = len(seqs[i].tokens)
            index[i, 1:n] = torch.arange(start, start + n - 1)
            for name, rows in padded.items():
                rows[i, :n] = getattr(seqs[i], name).float()
        padded["loss_mask"][:, 0] = 0
        device = packed.input_ids.device
        return cls(packed=packed, gather_index=index.to(device),
                   **{k: v.to(device) for k, v in padded.items()})


def critic_train_step(
    critic: TrainableActor,
    sequences: Sequence[ValueSequence],
    settings: ValueLossSettings,
    *,
    max_tokens_per_micro_batch: int | None = None,
    before_step: Callable[[], object] | None = None,
) -> dict[str, float]:
    """One optimizer step on this DP rank's share of a mini-batch; returns ``critic/*`` metrics
    (identical on every rank). ``before_step`` runs between the last backward and the optimizer
    step (the worker brings an offloaded optimizer state back there)."""
    cpu_compat.enable()
    model = critic.model
    batches, groups = make_micro_batches(
        model, [s.tokens for s in sequences], max_tokens_per_micro_batch)
    micro = [_ValueMicroBatch.build(b, [sequences[i] for i in g]) for b, g in zip(batches, groups)]
    device = batches[0].input_ids.device
    counts = sum(loss_counts(m.loss_mask) for m in micro).to(device)
    dist.all_reduce(counts, group=mpu.get_data_parallel_group())
    # megatron divides each micro-batch loss by their number and DDP averages over DP ranks
    scale = len(micro) * mpu.get_data_parallel_world_size()

    def loss_func(mb: _ValueMicroBatch, output: torch.Tensor):
        # under CP: the whole row on every CP rank (each back-propagates into its own tokens)
        vpreds = gather_context_parallel(_head_values(output), mb.packed)[mb.gather_index]
        loss, parts = value_loss(vpreds, mb.old_values, mb.returns, mb.loss_mask,
                                 cliprange_value=settings.cliprange_value,
                                 loss_agg_mode=settings.loss_agg_mode, global_counts=counts,
                                 norm_len=settings.norm_len)
        tokens = mb.loss_mask.sum()
        metrics = {"vf_loss": loss.detach(), "vf_clipfrac": parts["vf_clipfrac"] * tokens,
                   "vpred_sum": parts["vpred_mean"] * tokens, "tokens": tokens}
        return loss * scale, metrics

    def forward_step(data_iterator, chunk):
        mb = next(data_iterator)
        return gpt_forward(chunk, mb.packed), partial(loss_func, mb)

    for chunk in model.chunks:
        chunk.train()
    critic.zero_grad()
    per_micro = _schedule(model, micro, forward_step, max(b.num_tokens for b in batches),
                          forward_only=False)
    sums = _reduce_metrics(per_micro, device)
    if before_step is not None:
        before_step()
    result = critic.step(loss_is_finite=math.isfinite(sums["vf_loss"]))
    tokens = max(sums["tokens"], 1.0)
    return {
        "critic/vf_loss": sums["vf_loss"],
        "critic/vf_clipfrac": sums["vf_clipfrac"] / tokens,
        "critic/vpred_mean": sums["vpred_sum"] / tokens,
        "critic/grad_norm": result.grad_norm,
        "critic/lr": result.lr,
        "critic/update_skipped": float(not result.updated),
    }


def _reduce_metrics(per_micro: list[dict], device: torch.device) -> dict[str, float]:
    """Sum the micro-batch metrics on the last stage, send them to every stage, sum over DP."""
    values = torch.zeros(len(_METRICS), dtype=torch.float64, device=device)
    if mpu.is_pipeline_last_stage():
        for m in per_micro:
            values += torch.stack([m[k].double() for k in _METRICS])
    if mpu.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(values, src=mpu.get_pipeline_model_parallel_last_rank(),
                       group=mpu.get_pipeline_model_parallel_group())
    dist.all_reduce(values, group=mpu.get_data_parallel_group())
    return dict(zip(_METRICS, values.tolist()))
