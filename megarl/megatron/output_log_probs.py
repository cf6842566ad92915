"""Log-probs and entropy straight from the last hidden states, a chunk of rows at a time.

The log-prob path of the update, the old-log-prob pass and the reference pass need one number
per token (its log-prob, and the entropy), not the logits. Materialising the output layer's
``[T, V_local]`` logits for a micro-batch costs ``T x V_local`` in the model dtype, and the same
again for their gradient: 151,936 columns x 16k tokens is 5 GB of bf16 each way. Here one
autograd function runs the output layer's matmul for a chunk of rows (:data:`CHUNK_ELEMENTS` fp32
elements of logits), reduces it to the chunk's log-probs and entropies
(:func:`~megarl.megatron.vocab_parallel.chunk_log_probs`, over the TP group), and drops it; the
backward recomputes each chunk's logits from the saved hidden states and weight and turns their
gradient into the hidden states' and the weight's.

:func:`hidden_output` makes megatron's GPTModel return the hidden states it would hand its output
layer (after the final norm; under sequence parallelism this rank's slice of the sequence), and
:func:`output_log_probs` does the rest: the same gather (SP) or copy (TP) into the vocabulary-
parallel region that megatron's ColumnParallelLinear does, then the chunked function.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from megatron.core import parallel_state as mpu
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

from megarl.megatron.parallel import unwrap_chunk
from megarl.megatron.vocab_parallel import _row_chunks, chunk_log_probs, chunk_logits_grad
from megarl.megatron.wgrad_fusion import accumulate_weight_grad, accumulates_into


@contextmanager
def hidden_output(chunk: torch.nn.Module) -> Iterator[None]:
    """While active, the last stage's GPTModel returns ``[b, s, H]`` hidden states (its output
    layer's input) in place of logits."""
    model = unwrap_chunk(chunk)
    layer = getattr(model, "output_layer", None) if getattr(model, "post_process", False) else None
    if layer is None:
        yield
        return

    def passthrough(hidden_states, weight=None, runtime_gather_output=None):
        return hidden_states, None

    layer.forward = passthrough
    try:
        yield
    finally:
        del layer.forward  # back to the class's forward


def output_weight(chunk: torch.nn.Module) -> torch.Tensor:
    """The weight the last stage's output layer multiplies with (the embedding when tied)."""
    model = unwrap_chunk(chunk)
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight


def output_log_probs(chunk: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, *,
                     vocab_size: int, temperature: float = 1.0
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(log_probs, entropy) ``[T]`` of ``targets [T]`` from the hidden states ``[1, T', H]`` that
    :func:`hidden_output` made the last stage return (``T' = T / tp`` under sequence
    parallelism)."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: must be > 0")
    model = unwrap_chunk(chunk)
    h = hidden[0]
    group = mpu.get_tensor_model_parallel_group()
    if model.output_layer.sequence_parallel:
        h = gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True, group=group)
    else:
        h = copy_to_tensor_model_parallel_region(h, group=group)
    weight = output_weight(chunk)
    local_vocab = weight.shape[0]
    vocab_start = mpu.get_tensor_model_parallel_rank() * local_vocab
    valid_cols = max(0, min(local_vocab, vocab_size - vocab_start))
    # an untied weight under DDP takes its gradient straight into its fp32 buffer; a tied one
    # (the embedding's) also gets the embedding's gradient in the same accumulation
    fuse = (not model.share_embeddings_and_output_weights and weight.requires_grad
            and hasattr(weight, "grad_added_to_main_grad") and accumulates_into(weight))
    return _OutputLogProbs.apply(h, weight, targets.reshape(-1), vocab_start, valid_cols,
                                 float(temperature), group, fuse)


class _OutputLogProbs(torch.autograd.Function):
    """``hidden [T, H] @ weight[:valid].T`` -> (log_probs, entropy) ``[T]``, chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, target, vocab_start, valid_cols, temperature, group, fuse):
        """Each chunk's logits exist only while its statistics are taken."""
        rows = hidden.shape[0]
        w = weight[:valid_cols]
        local_index = target - vocab_start
        in_shard = (local_index >= 0) & (local_index < valid_cols)
        local_index = local_index.clamp(0, max(valid_cols - 1, 0))
        out = torch.empty(3, rows, dtype=torch.float32, device=hidden.device)
        for start, end in _row_chunks(rows, max(valid_cols, 1)):
            z = hidden[start:end] @ w.t()
            lp, ent, log_z = chunk_log_probs(z, local_index[start:end], in_shard[start:end],
                                             temperature, group)
            out[0, start:end], out[1, start:end], out[2, start:end] = lp, ent, log_z
        ctx.save_for_backward(hidden, weight, out[2], out[1], local_index, in_shard)
        ctx.valid_cols, ctx.temperature, ctx.fuse = valid_cols, temperature, fuse
        return out[0], out[1]

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        """Recompute each chunk's logits; the hidden states' and the weight's gradients (this
        rank's vocabulary columns; the TP reduction of the hidden states' gradient is the
        region function's backward). With ``fuse`` the weight's gradient is added into its
        fp32 ``main_grad`` chunk by chunk (megatron's gradient-accumulation fusion: DDP's hook
        then skips the placeholder returned)."""
        hidden, weight, log_z, entropy, local_index, in_shard = ctx.saved_tensors
        valid_cols, temperature = ctx.valid_cols, ctx.temperature
        w = weight[:valid_cols]
        want_w = ctx.needs_input_grad[1]  # a frozen output layer (LoRA) needs none
        fuse = want_w and ctx.fuse
        grad_hidden = torch.zeros_like(hidden)
        if fuse:
            grad_w = weight.main_grad[:valid_cols]
        else:
            grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if want_w else None
        for start, end in _row_chunks(hidden.shape[0], valid_cols) if valid_cols > 0 else []:
            rows = slice(start, end)
            z = hidden[rows] @ w.t()
            grad_z = chunk_logits_grad(z, rows, log_z, entropy, local_index, in_shard,
                                       grad_log_probs, grad_entropy, temperature)
            grad_hidden[rows] = grad_z @ w
            if fuse:
                accumulate_weight_grad(grad_w, grad_z, hidden[rows])
            elif want_w:
                grad_w += (grad_z.t() @ hidden[rows]).float()
        grad_weight = None
        if fuse:
            weight.grad_added_to_main_grad = True
            grad_weight = torch.empty_like(weight)  # a placeholder DDP's hook skips
        elif want_w:
            grad_weight = torch.zeros_like(weight)
            grad_weight[:valid_cols] = grad_w.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None
