"""The actor's training forward and backward replayed from CUDA graphs.

On a GPU the native spec's step is bound by the host: megatron's layers issue thousands of small
kernels per micro-batch, and Python launches them slower than the GPU runs them. With no host
synchronisation in the step (see :mod:`megarl.megatron.native_layers`) the whole forward of a
model chunk and its backward can be captured once per micro-batch shape and replayed.

:class:`GraphedChunk` does that for packed (THD) micro-batches:

- a micro-batch of ``T`` tokens in ``n`` sequences is laid into static buffers of a *bucket*:
  ``T`` rounded up to ``bucket_tokens`` (the extra tokens form one more, separate sequence whose
  outputs are dropped) and the sequence offsets padded to a power of two with empty sequences,
  so that few shapes need a graph;
- per bucket, the forward and the backward (gradients of every trainable parameter for a given
  output gradient) are captured after two warm-up iterations on a side stream, all buckets in
  one memory pool;
- :meth:`GraphedChunk.__call__` returns the logits of the micro-batch as a tensor in the
  autograd graph: its backward replays the backward graph and hands the parameter gradients to
  autograd, so megatron's DDP hooks accumulate them into ``main_grad`` as in eager mode.

The graphs run the chunk on *leaf aliases* of its trainable parameters (tensors that share each
parameter's storage, made per bucket), not on the parameters themselves, and capture on one side
stream that also runs the warm-up. With torch 2.11 on the H200 every capture failed
(``cudaErrorStreamCaptureInvalidated`` at the backward's first weight gradient), next to torch's
warning that "the AccumulateGrad node's stream does not match the stream of the node that
produced the incoming gradient": autograd hands a leaf's gradient over on the stream its
``AccumulateGrad`` node was made on, and megatron's DDP keeps the parameters' nodes alive from the
model build, on the default stream, which a capture cannot wait on. The aliases' nodes are made
on the capture stream.

Because buckets share one pool, a micro-batch's backward must run before the next forward (the
order of megatron's no-pipelining schedule); :class:`GraphedChunk` checks it. Pipeline
parallelism, dropout and router replay are not graphed (:func:`graph_unsupported_reason`).
``emulate=True`` runs the same buffers and autograd plumbing without CUDA graphs (CPU tests).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megarl.megatron.native_layers import clear_rotary_tables
from megarl.megatron.packing import PackedBatch
from megarl.megatron.wgrad_fusion import unfuse_weight_gradients

logger = logging.getLogger(__name__)


def graph_unsupported_reason(config: Any, pipeline_size: int, router_replay: bool) -> str | None:
    """Why the actor's micro-batches cannot be replayed from CUDA graphs (None when they can)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    if pipeline_size > 1:
        return "pipeline parallelism (several forwards are in flight)"
    if router_replay:
        return "router replay (routes change per micro-batch outside the graph)"
    if getattr(config, "hidden_dropout", 0.0) or getattr(config, "attention_dropout", 0.0):
        return "dropout"
    if getattr(config, "context_parallel_size", 1) > 1:
        return "context parallelism"
    if getattr(config, "recompute_granularity", None) is not None:
        return "activation recompute (its backward re-runs the forward outside the graphs)"
    return None


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclass
class _Bucket:
    """Static buffers, graphs and outputs of one micro-batch shape."""

    tokens: int
    sequences: int
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    leaves: dict[str, torch.Tensor] | None = None
    """Leaf aliases of the trainable parameters the bucket's graphs run on (module docstring)."""
    forward: Callable[[], None] | None = None
    backward: Callable[[], None] | None = None
    output: torch.Tensor | None = None
    grad_output: torch.Tensor | None = None
    grads: tuple[torch.Tensor | None, ...] = ()
    graphs: tuple[torch.cuda.CUDAGraph, ...] = ()


class GraphedChunk:
    """Forward + backward of one model chunk on packed micro-batches from CUDA graphs (module
    docstring); a drop-in for ``gpt_forward(chunk, batch)`` in training."""

    def __init__(self, chunk: torch.nn.Module, *, bucket_tokens: int = 1024,
                 max_buckets: int = 8, emulate: bool = False) -> None:
        if bucket_tokens < 1:
            raise ValueError(f"bucket_tokens={bucket_tokens}: must be >= 1")
        self.module = getattr(chunk, "module", chunk)  # through megatron's DDP wrapper
        self.names = [n for n, p in self.module.named_parameters() if p.requires_grad]
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.bucket_tokens = bucket_tokens
        self.max_buckets = max_buckets
        self.emulate = emulate
        self.buckets: dict[tuple[int, int], _Bucket] = {}
        self._pool = None
        self._stream: torch.cuda.Stream | None = None
        self._pending: _Bucket | None = None
        self.padding_tokens = 0
        """Tokens replayed past the micro-batches' ends (the buckets' tails), summed."""
        self.failed: str | None = None
        """Why a capture failed (the chunk then runs eagerly), None while graphs work."""
        # a parameter under megatron's DDP hands its gradient to main_grad at once (its hook
        # sets .grad to None), so the graph's static gradient can be given to autograd as is;
        # otherwise autograd would keep it as .grad and the next replay would overwrite it
        self._alias_grads = all(hasattr(p, "main_grad") for p in self.params)
        # the graphed backward differentiates leaf copies: no main_grad to accumulate into
        unfuse_weight_gradients(self.module)

    # ----- shapes -----
    def bucket_of(self, batch: PackedBatch) -> tuple[int, int]:
        """(tokens, sequences) of the bucket that holds ``batch``."""
        tokens = -(-batch.num_tokens // self.bucket_tokens) * self.bucket_tokens
        sequences = len(batch.lengths) + (tokens > batch.num_tokens)
        return tokens, sequences if sequences == 1 else _next_power_of_two(sequences)

    def _new_bucket(self, key: tuple[int, int], device: torch.device) -> _Bucket:
        tokens, sequences = key
        return _Bucket(
            tokens=tokens, sequences=sequences,
            input_ids=torch.zeros(1, tokens, dtype=torch.long, device=device),
            position_ids=torch.zeros(1, tokens, dtype=torch.long, device=device),
            cu_seqlens=torch.zeros(sequences + 1, dtype=torch.int32, device=device),
            cu_seqlens_padded=torch.zeros(sequences + 1, dtype=torch.int32, device=device))

    @staticmethod
    def _fill(bucket: _Bucket, batch: PackedBatch) -> None:
        """Copy ``batch`` into the bucket's buffers; the tokens past it form one more sequence
        (positions from 0) and the remaining offsets are empty sequences at the end."""
        t, n = batch.num_tokens, len(batch.lengths)
        bucket.input_ids[:, :t].copy_(batch.input_ids)
        bucket.position_ids[:, :t].copy_(batch.position_ids)
        if bucket.tokens > t:
            bucket.input_ids[:, t:].zero_()
            torch.arange(bucket.tokens - t, out=bucket.position_ids[0, t:])
        for static, offsets in ((bucket.cu_seqlens, batch.cu_seqlens),
                                (bucket.cu_seqlens_padded, batch.cu_seqlens_padded)):
            static[: n + 1].copy_(offsets)
            static[n + 1:].fill_(bucket.tokens)
        # RoPE tables are cached by the identity of the offsets tensor, whose values changed
        clear_rotary_tables()

    def _leaves(self) -> dict[str, torch.Tensor]:
        """Fresh leaf tensors on the trainable parameters' storage, by parameter name."""
        return {name: p.detach().requires_grad_(True) for name, p in zip(self.names, self.params)}

    def _run_forward(self, bucket: _Bucket) -> torch.Tensor:
        cu, padded = bucket.cu_seqlens, bucket.cu_seqlens_padded
        params = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=padded,
            cu_seqlens_kv_padded=padded, max_seqlen_q=bucket.tokens,
            max_seqlen_kv=bucket.tokens)
        return torch.func.functional_call(
            self.module, bucket.leaves, (bucket.input_ids, bucket.position_ids, None),
            {"packed_seq_params": params}, tie_weights=True, strict=False)

    def _run_backward(self, bucket: _Bucket, output: torch.Tensor,
                      grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return torch.autograd.grad(output, list(bucket.leaves.values()), grad_output,
                                   allow_unused=True)

    # ----- capture -----
    def _capture(self, bucket: _Bucket) -> None:
        """Warm up, then capture the bucket's forward and backward graphs."""
        bucket.leaves = self._leaves()
        if self.emulate:
            self._emulate(bucket)
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                out = self._run_forward(bucket)
                self._run_backward(bucket, out, torch.zeros_like(out))
                del out
        torch.cuda.current_stream().wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        # tables cached by an eager forward would be read, not recomputed, by the graph
        clear_rotary_tables()
        forward, backward = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        # thread_local: CUDA calls of other threads (the NCCL watchdog polling its events) do
        # not invalidate the capture
        mode = "thread_local"
        try:
            with torch.cuda.graph(forward, pool=self._pool, stream=stream,
                                  capture_error_mode=mode):
                output = self._run_forward(bucket)
            grad_output = torch.empty_like(output)
            with torch.cuda.graph(backward, pool=self._pool, stream=stream,
                                  capture_error_mode=mode):
                grads = self._run_backward(bucket, output, grad_output)
        finally:
            clear_rotary_tables()
        bucket.forward, bucket.backward = forward.replay, backward.replay
        bucket.output, bucket.grad_output, bucket.grads = output.detach(), grad_output, grads
        bucket.graphs = (forward, backward)

    def _emulate(self, bucket: _Bucket) -> None:
        """The same buffers and autograd plumbing, each "replay" running eagerly."""
        state: dict[str, torch.Tensor] = {}

        def forward() -> None:
            with torch.enable_grad():
                state["out"] = self._run_forward(bucket)
            bucket.output = state["out"].detach()

        def backward() -> None:
            bucket.grads = self._run_backward(bucket, state.pop("out"), bucket.grad_output)

        forward()
        bucket.grad_output = torch.empty_like(bucket.output)
        bucket.forward, bucket.backward = forward, backward

    # ----- use -----
    def supports(self, batch: PackedBatch) -> bool:
        """Whether ``batch`` runs from a graph (its bucket exists or may still be captured)."""
        if self.failed is not None:
            return False
        key = self.bucket_of(batch)
        return key in self.buckets or len(self.buckets) < self.max_buckets

    def __call__(self, batch: PackedBatch) -> torch.Tensor:
        """Logits ``[1, T, V]`` of ``batch`` (training forward; backward through the graph)."""
        if not torch.is_grad_enabled():
            raise RuntimeError("GraphedChunk is for training forwards (grad mode on)")
        if self._pending is not None:
            raise RuntimeError("GraphedChunk: the previous micro-batch's backward has not run; "
                               "graphs share memory, so forward and backward must alternate")
        key = self.bucket_of(batch)
        bucket = self.buckets.get(key)
        new = bucket is None
        if new:
            bucket = self._new_bucket(key, batch.input_ids.device)
        self._fill(bucket, batch)
        if new:
            try:
                self._capture(bucket)
            except RuntimeError as err:  # the update goes on eagerly
                self.failed = f"{type(err).__name__}: {err}"
                logger.warning("actor.cuda_graphs: capturing %d tokens / %d sequences failed; "
                               "the update runs eagerly from now on (%s)", *key, self.failed)
                torch.cuda.synchronize()
                return self._eager(batch)
            self.buckets[key] = bucket
            logger.info("captured the actor's CUDA graphs for %d tokens / %d sequences",
                        *key)
        self._pending = bucket
        self.padding_tokens += bucket.tokens - batch.num_tokens
        out = _Replay.apply(self, bucket, *self.params)
        return out[:, : batch.num_tokens]

    def _eager(self, batch: PackedBatch) -> torch.Tensor:
        from megarl.megatron.logprobs import gpt_forward

        return gpt_forward(self.module, batch)

    def _backward_done(self) -> None:
        self._pending = None


class _Replay(torch.autograd.Function):
    """The bucket's forward graph as an autograd node whose backward replays its backward
    graph; the parameters are inputs so that autograd routes their gradients."""

    @staticmethod
    def forward(ctx, graphed: GraphedChunk, bucket: _Bucket, *params: torch.Tensor):
        """Replay the forward; the static output (detached) is the result."""
        bucket.forward()
        ctx.graphed, ctx.bucket = graphed, bucket
        return bucket.output.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        """Replay the backward for ``grad``; the parameters' gradients."""
        graphed, bucket = ctx.graphed, ctx.bucket
        bucket.grad_output.copy_(grad)
        bucket.backward()
        graphed._backward_done()
        alias = graphed._alias_grads and not graphed.emulate
        grads = tuple(None if g is None else (g.detach() if alias else g.clone())
                      for g in bucket.grads)
        return (None, None, *grads)
