"""Per-token log-probs (and entropy) of sequences under the actor's megatron model.

Sequences are packed into THD micro-batches (grouped by a token budget), run through megatron's
pipeline schedule (``get_forward_backward_func``, forward only), and turned into log-probs on
the last pipeline stage by :func:`vocab_parallel_log_probs` on the vocabulary-parallel logits.
The results are then broadcast over the pipeline group and, under context parallelism, gathered
over the CP group back into each sequence's order, so every rank of the model-parallel group
returns the same values.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func

from megarl.megatron import cpu_compat
from megarl.megatron.context_parallel import gather_context_parallel
from megarl.megatron.model import ActorModel
from megarl.megatron.output_log_probs import hidden_output, output_log_probs
from megarl.megatron.packing import (
    PackedBatch,
    pack_sequences,
    split_by_token_budget,
    split_for_context_parallel,
    split_further,
)
from megarl.megatron.vocab_parallel import vocab_parallel_log_probs


@dataclass
class TokenLogProbs:
    """Per-sequence results, aligned with the input tokens."""

    log_probs: list[torch.Tensor]
    """``[L_i]`` fp32: entry ``j`` is log p(token_j | tokens_<j); entry 0 is 0."""
    entropy: list[torch.Tensor] | None
    """``[L_i]`` fp32: entropy of the distribution that predicted token ``j``; entry 0 is 0."""


def sequence_alignment(model: ActorModel) -> int:
    """The multiple each packed sequence is padded to: ``2 x cp`` chunks under context
    parallelism, each a multiple of the TP size under sequence parallelism."""
    config = model.config
    tp = config.tensor_model_parallel_size if config.sequence_parallel else 1
    cp = config.context_parallel_size
    return tp * (2 * cp if cp > 1 else 1)


def make_micro_batches(
    model: ActorModel, sequences: Sequence[torch.Tensor], max_tokens: int | None
) -> tuple[list[PackedBatch], list[list[int]]]:
    """Pack ``sequences`` into micro-batches of at most ``max_tokens`` tokens (one if None);
    returns the batches (on the model's device) and the sequence indices of each. Under context
    parallelism each batch holds this CP rank's chunks of every sequence
    (:func:`split_for_context_parallel`) and ``max_tokens`` counts the whole row."""
    lengths = [len(s) for s in sequences]
    device = next(model.chunks[0].parameters()).device
    groups = (
        [list(range(len(sequences)))]
        if max_tokens is None
        else _same_count_over_data_parallel(lengths, split_by_token_budget(lengths, max_tokens),
                                            device)
    )
    align = sequence_alignment(model)
    cp_size = model.config.context_parallel_size
    batches = []
    for g in groups:
        packed = pack_sequences([sequences[i] for i in g], align)
        max_len = packed.packed_seq_params().max_seqlen_q  # from host tensors: no device sync
        if cp_size > 1:
            packed = split_for_context_parallel(packed, cp_size, mpu.get_context_parallel_rank())
        batches.append(packed.to(device))
        _remember_max_len(batches[-1], max_len)
    return batches, groups


def _same_count_over_data_parallel(lengths: list[int], groups: list[list[int]],
                                   device: torch.device) -> list[list[int]]:
    """The token-budget micro-batches of this rank, split further to the largest count of any
    data-parallel rank: with expert parallelism every micro-batch's forward and backward take
    part in all-to-alls with the other ranks, so ranks whose sequences are longer (more
    micro-batches) would otherwise wait forever for the others."""
    if not (torch.distributed.is_initialized() and mpu.model_parallel_is_initialized()):
        return groups
    group = mpu.get_data_parallel_group()
    if torch.distributed.get_world_size(group) == 1:
        return groups
    count = torch.tensor([len(groups)], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX, group=group)
    return split_further(lengths, groups, int(count.item()))


# id(batch) -> (weak reference to the batch, its longest padded sequence), for batches made by
# make_micro_batches; the entry goes when the batch does
_MAX_LEN: dict[int, tuple[weakref.ref, int]] = {}


def _remember_max_len(batch: PackedBatch, max_len: int) -> None:
    key = id(batch)
    _MAX_LEN[key] = (weakref.ref(batch, lambda _ref: _MAX_LEN.pop(key, None)), max_len)


def packed_seq_params(batch: PackedBatch) -> PackedSeqParams:
    """megatron's THD descriptor of ``batch``; for batches from :func:`make_micro_batches` the
    longest sequence is known on the host, so no device synchronisation is needed."""
    hit = _MAX_LEN.get(id(batch))
    if hit is None or hit[0]() is not batch:
        return batch.packed_seq_params()
    padded = batch.cu_seqlens_padded
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=batch.cu_seqlens,
        cu_seqlens_kv=batch.cu_seqlens,
        cu_seqlens_q_padded=padded,
        cu_seqlens_kv_padded=padded,
        max_seqlen_q=hit[1],
        max_seqlen_kv=hit[1],
    )


def gpt_forward(chunk: torch.nn.Module, batch: PackedBatch, *, hidden: bool = False
                ) -> torch.Tensor:
    """One model chunk on a packed batch: hidden states, or on the last stage ``[1, T, V_local]``
    logits (with ``hidden``: the output layer's input, for :func:`token_log_probs`)."""
    with hidden_output(chunk) if hidden else nullcontext():
        return chunk(
            batch.input_ids,
            batch.position_ids,
            None,
            packed_seq_params=packed_seq_params(batch),
        )


def token_log_probs(model: ActorModel, output: torch.Tensor, targets: torch.Tensor,
                    temperature: float, *, hidden: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(log_probs ``[T]``, entropy ``[T]``) of the last stage's output: the hidden states of
    ``gpt_forward(..., hidden=True)`` (the output layer runs a chunk of rows at a time, no
    ``[T, V_local]`` logits: :mod:`~megarl.megatron.output_log_probs`) or logits."""
    if hidden:
        return output_log_probs(model.chunks[-1], output, targets[0],
                                vocab_size=model.vocab_size, temperature=temperature)
    return logits_to_log_probs(model, output, targets, temperature)


def logits_to_log_probs(
    model: ActorModel, logits: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[1, T, V_local]`` vocabulary-parallel logits -> (log_probs ``[T]``, entropy ``[T]``)."""
    tp_group = mpu.get_tensor_model_parallel_group()
    vocab_start = mpu.get_tensor_model_parallel_rank() * logits.shape[-1]
    log_probs, entropy = vocab_parallel_log_probs(
        logits[0],
        targets[0],
        vocab_start=vocab_start,
        vocab_size=model.vocab_size,
        temperature=temperature,
        group=tp_group,
    )
    return log_probs, entropy


def compute_log_probs(
    model: ActorModel,
    sequences: Sequence[torch.Tensor],
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    max_tokens_per_micro_batch: int | None = None,
) -> TokenLogProbs:
    """Log-probs of every token of every sequence (all ranks of the model-parallel group pass
    the same sequences and get the same results)."""
    cpu_compat.enable()
    batches, groups = make_micro_batches(model, sequences, max_tokens_per_micro_batch)
    results = _run_forward_only(model, batches, temperature)
    per_batch = _broadcast_from_last_stage(results, batches)
    log_probs: list[torch.Tensor | None] = [None] * len(sequences)
    entropy: list[torch.Tensor | None] = [None] * len(sequences)
    for batch, group, (lp, ent) in zip(batches, groups, per_batch):
        lp, ent = gather_context_parallel(torch.stack([lp, ent], dim=1), batch).unbind(1)
        for i, seq_lp, seq_ent in zip(group, batch.unpack_shifted(lp), batch.unpack_shifted(ent)):
            log_probs[i], entropy[i] = seq_lp, seq_ent
    return TokenLogProbs(log_probs=log_probs, entropy=entropy if with_entropy else None)


def _run_forward_only(
    model: ActorModel, batches: list[PackedBatch], temperature: float
) -> list[dict[str, torch.Tensor]]:
    """megatron's schedule over the micro-batches; on the last stage, one dict per batch."""

    def loss_func(batch: PackedBatch, hidden: torch.Tensor):
        log_probs, entropy = token_log_probs(model, hidden, batch.targets, temperature,
                                             hidden=True)
        return hidden.new_zeros(()), {"log_probs": log_probs, "entropy": entropy}

    def forward_step(data_iterator, chunk):
        batch = next(data_iterator)
        return gpt_forward(chunk, batch, hidden=True), partial(loss_func, batch)

    was_training = [c.training for c in model.chunks]
    for chunk in model.chunks:
        chunk.eval()
    iterators = [iter(batches) for _ in model.chunks]
    try:
        with torch.no_grad():
            return get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iterators if len(iterators) > 1 else iterators[0],
                model=model.chunks,
                num_microbatches=len(batches),
                seq_length=max(b.num_tokens for b in batches),
                micro_batch_size=1,
                forward_only=True,
            )
    finally:
        for chunk, training in zip(model.chunks, was_training):
            chunk.train(training)


def _broadcast_from_last_stage(
    results: list[dict[str, torch.Tensor]], batches: list[PackedBatch]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Send the last stage's (log_probs, entropy) per batch to every pipeline stage."""
    sizes = [b.num_tokens for b in batches]
    if mpu.is_pipeline_last_stage():
        flat = torch.cat(
            [torch.stack([r["log_probs"], r["entropy"]]) for r in results], dim=1
        ).contiguous()
    else:
        device = batches[0].input_ids.device
        flat = torch.empty(2, sum(sizes), dtype=torch.float32, device=device)
    if mpu.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(
            flat,
            src=mpu.get_pipeline_model_parallel_last_rank(),
            group=mpu.get_pipeline_model_parallel_group(),
        )
    return [(part[0], part[1]) for part in flat.split(sizes, dim=1)]
