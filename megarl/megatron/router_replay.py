"""Router replay for MoE models: record which experts each token was routed to during a forward
pass, and route later passes (log-probs, update steps) with given routes (R2/R3).

megatron-core's ``RouterReplay`` (on with ``TransformerConfig.moe_enable_routing_replay``; pass
:data:`ROUTER_REPLAY_OVERRIDES` to ``build_actor_model``) does the routing inside each
``TopKRouter``: ``RECORD`` keeps the top-k indices it computed, ``REPLAY_FORWARD`` routes with
the indices it was given, ``REPLAY_BACKWARD`` routes a forward recomputed during backward
(activation recompute) with the indices of the matching forward, first in first out. megarl
drives the routers of one model (found in its chunks, not through megatron's process-wide list
of instances) and aligns the routes with how the forward sees the tokens:

- packing: per-sequence routes ``[L_i, num_moe_layers, top_k]`` <-> the packed row of each
  micro-batch, grouped exactly as ``compute_log_probs`` / ``train_step`` group them
  (:func:`~megarl.megatron.logprobs.make_micro_batches`); padding rows route natively;
- context parallelism: a CP rank routes its chunks of every sequence; recorded rows are
  all-gathered over CP back into each sequence's order, replayed rows follow the chunks;
- sequence parallelism: each TP rank routes a contiguous ``1/tp`` slice of the row; recorded
  slices are all-gathered over TP, replayed routes are sliced;
- pipeline stages (and virtual stages): each rank runs the MoE layers of its chunks, found by
  their global layer numbers; recorded layers are summed over the pipeline group, so every
  rank returns all MoE layers;
- micro-batches: a forward pre-hook hands micro-batch ``m``'s routes to the ``m``-th forward
  call of each router (a recompute inside backward is told apart by autograd's graph task id).

A replayed row of ``-1`` (e.g. the last generated token, for which the rollout engine reports no
route) is routed natively; ``replay_routes(..., record=True)`` also returns the routes a replayed
forward used (the given rows, and the model's own choice on the ``-1`` rows). Rows must not repeat an expert: megatron's all-to-all dispatcher
sizes its buffers as ``tokens * top_k`` and would mis-route duplicates.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from megarl.megatron import cpu_compat
from megarl.megatron.context_parallel import gather_context_parallel, rows_of_this_rank
from megarl.megatron.logprobs import make_micro_batches
from megarl.megatron.model import ActorModel
from megarl.megatron.native_spec import moe_layer_pattern
from megarl.megatron.packing import PackedBatch
from megarl.megatron.parallel import unwrap_chunk

ROUTER_REPLAY_OVERRIDES: dict[str, Any] = {"moe_enable_routing_replay": True}
"""``build_actor_model(..., config_overrides=ROUTER_REPLAY_OVERRIDES)`` gives routers that can
record and replay."""

NATIVE_ROUTE = -1
"""A replayed row of this value is routed by the model itself."""


class NativeRowsRouterReplay(RouterReplay):
    """megatron's ``RouterReplay``, where replayed rows of ``-1`` keep the model's own top-k,
    and a replayed forward records the indices it routed with (as ``RECORD`` does)."""

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fill the ``-1`` rows of the target indices with the computed top-k, then replay."""
        action = self.router_replay_action
        if action is RouterReplayAction.REPLAY_FORWARD:
            target = self.target_topk_idx
        elif action is RouterReplayAction.REPLAY_BACKWARD:
            target = self.replay_backward_list[0]
        else:
            return super().get_replay_topk(
                scores, topk, num_groups, group_topk, default_compute_topk
            )
        native = target[:, 0] == NATIVE_ROUTE
        if bool(native.any()):
            _, computed = default_compute_topk(
                scores, topk, num_groups=num_groups, group_topk=group_topk
            )
            filled = torch.where(native[:, None], computed, target.to(computed.device))
            if action is RouterReplayAction.REPLAY_FORWARD:
                self.target_topk_idx = filled
                self.replay_backward_list[-1] = filled
            else:
                self.replay_backward_list[0] = filled
        probs, indices = super().get_replay_topk(
            scores, topk, num_groups, group_topk, default_compute_topk
        )
        if action is RouterReplayAction.REPLAY_FORWARD:
            self.record_indices(indices)
        return probs, indices


@dataclass
class MoERouter:
    """A router of this rank's model chunks."""

    moe_index: int
    """Index of its layer among the model's MoE layers (the middle axis of a route tensor)."""
    router: torch.nn.Module
    """The ``TopKRouter`` (its ``router_replay`` is a :class:`NativeRowsRouterReplay`)."""


def num_moe_layers(model: ActorModel) -> int:
    """MoE layers of the whole model (all pipeline stages): the middle axis of route tensors."""
    return sum(moe_layer_pattern(model.config))


def moe_routers(model: ActorModel) -> list[MoERouter]:
    """The routers of this rank's chunks, with replay handlers that megarl drives.

    Replaces each router's ``RouterReplay`` by a :class:`NativeRowsRouterReplay` on first use and
    keeps both out of megatron's process-wide instance list (several models may live in one
    process; megarl never uses the global list).
    """
    if not model.config.moe_enable_routing_replay:
        raise ValueError(
            "router replay: the model was built without moe_enable_routing_replay; pass "
            "config_overrides=ROUTER_REPLAY_OVERRIDES to build_actor_model"
        )
    moe_layers = [i for i, is_moe in enumerate(moe_layer_pattern(model.config)) if is_moe]
    moe_index = {layer: i for i, layer in enumerate(moe_layers)}
    routers = []
    for chunk in model.chunks:
        for layer in unwrap_chunk(chunk).decoder.layers:
            router = getattr(layer.mlp, "router", None)
            if router is None:
                continue
            if not isinstance(router.router_replay, NativeRowsRouterReplay):
                _forget_instance(router.router_replay)
                router.router_replay = NativeRowsRouterReplay()
                _forget_instance(router.router_replay)
            routers.append(MoERouter(moe_index[layer.layer_number - 1], router))
    return routers


def _forget_instance(replay: RouterReplay | None) -> None:
    instances = RouterReplay.global_router_replay_instances
    if replay is not None and any(r is replay for r in instances):
        instances.remove(replay)


def _in_backward() -> bool:
    """True inside autograd's backward (where activation recompute re-runs forwards)."""
    return torch._C._current_graph_task_id() != -1


def _sp_split(model: ActorModel) -> tuple[int, int]:
    """(number of row slices, this rank's slice) of the packed row a router sees."""
    if not model.config.sequence_parallel:
        return 1, 0
    return mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()


@dataclass
class RouteRecording:
    """Filled when the :func:`record_routes` block exits."""

    routes: list[torch.Tensor] = field(default_factory=list)
    """Per sequence, ``[L_i, num_moe_layers, top_k]`` int16 expert ids (global ids)."""


@contextlib.contextmanager
def record_routes(
    model: ActorModel,
    sequences: Sequence[torch.Tensor],
    *,
    max_tokens_per_micro_batch: int | None = None,
) -> Iterator[RouteRecording]:
    """Record the routes of the one forward pass run inside the block over ``sequences`` (pass
    the forward the same sequences and token budget); every rank of the model-parallel group
    gets all MoE layers."""
    cpu_compat.enable()
    routers = moe_routers(model)
    batches, groups = make_micro_batches(model, sequences, max_tokens_per_micro_batch)
    calls, after_forward = _call_recorder(routers)
    recording = RouteRecording()
    with _hooks(routers, RouterReplayAction.RECORD, forward_hook=after_forward):
        yield recording
    recording.routes = _finish_recording(model, routers, calls, batches, groups, "record_routes")


def _call_recorder(routers: list[MoERouter]) -> tuple[dict[int, list[torch.Tensor]], Any]:
    """Per router, the indices of each forward call (not the recomputes inside backward), and
    the forward hook that collects them."""
    calls: dict[int, list[torch.Tensor]] = {id(r.router): [] for r in routers}

    def after_forward(router: torch.nn.Module, inputs: Any, output: Any) -> None:
        if not _in_backward():
            calls[id(router)].append(router.router_replay.get_recorded_indices())

    return calls, after_forward


def _finish_recording(
    model: ActorModel,
    routers: list[MoERouter],
    calls: dict[int, list[torch.Tensor]],
    batches: list[PackedBatch],
    groups: list[list[int]],
    caller: str,
) -> list[torch.Tensor]:
    """Check one forward call per micro-batch, then assemble the per-sequence routes."""
    for r in routers:
        if len(calls[id(r.router)]) != len(batches):
            raise RuntimeError(
                f"{caller}: MoE layer {r.moe_index} ran {len(calls[id(r.router)])} "
                f"forward passes for {len(batches)} micro-batches; run exactly one forward over "
                "the same sequences and max_tokens_per_micro_batch inside the block"
            )
    num_sequences = sum(len(g) for g in groups)
    return _assemble(model, routers, calls, batches, groups, num_sequences)


@contextlib.contextmanager
def _hooks(
    routers: list[MoERouter],
    action: RouterReplayAction,
    *,
    forward_hook: Any = None,
    pre_hook: Any = None,
) -> Iterator[None]:
    handles = []
    for r in routers:
        r.router.router_replay.clear_indices()
        r.router.router_replay.set_router_replay_action(action)
        if forward_hook is not None:
            handles.append(r.router.register_forward_hook(forward_hook))
        if pre_hook is not None:
            handles.append(r.router.register_forward_pre_hook(pre_hook))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for r in routers:
            r.router.router_replay.clear_router_replay_action()
            r.router.router_replay.clear_indices()


def _assemble(
    model: ActorModel,
    routers: list[MoERouter],
    calls: dict[int, list[torch.Tensor]],
    batches: list[PackedBatch],
    groups: list[list[int]],
    num_sequences: int,
) -> list[torch.Tensor]:
    """Recorded slices -> per-sequence ``[L_i, num_moe_layers, top_k]`` on every rank."""
    top_k = model.config.moe_router_topk
    device = batches[0].input_ids.device
    total = sum(b.num_tokens for b in batches)
    routes = torch.zeros(total, num_moe_layers(model), top_k, dtype=torch.int32, device=device)
    if routers:
        columns = torch.tensor([r.moe_index for r in routers], device=device)
        routes[:, columns] = _gather_sequence_slices(model, routers, calls, batches)
    if mpu.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(routes, group=mpu.get_pipeline_model_parallel_group())
    out: list[torch.Tensor | None] = [None] * num_sequences
    for batch, group, packed in zip(batches, groups, routes.split([b.num_tokens for b in batches])):
        packed = gather_context_parallel(packed, batch)  # the whole row, under CP
        for i, seq in zip(group, batch.unpack(packed)):
            out[i] = seq.to("cpu", torch.int16)
    return out


def _gather_sequence_slices(
    model: ActorModel,
    routers: list[MoERouter],
    calls: dict[int, list[torch.Tensor]],
    batches: list[PackedBatch],
) -> torch.Tensor:
    """This rank's recorded ``[rows, local MoE layers, top_k]`` -> the rows of every packed
    batch, in order (the sequence-parallel slices all-gathered over TP)."""
    device = batches[0].input_ids.device
    local = torch.stack([torch.cat(calls[id(r.router)]) for r in routers], dim=1)
    local = local.to(device, torch.int32)
    slices, _ = _sp_split(model)
    if slices == 1:
        return local
    pieces = [torch.empty_like(local) for _ in range(slices)]
    dist.all_gather(pieces, local, group=mpu.get_tensor_model_parallel_group())
    # piece r holds slice r of every batch; a batch's rows are its slices in rank order
    sizes = [b.num_tokens // slices for b in batches]
    per_rank = [p.split(sizes) for p in pieces]
    return torch.cat([torch.cat(batch_slices) for batch_slices in zip(*per_rank)])


@contextlib.contextmanager
def replay_routes(
    model: ActorModel,
    sequences: Sequence[torch.Tensor],
    routes: Sequence[torch.Tensor],
    *,
    max_tokens_per_micro_batch: int | None = None,
    record: bool = False,
) -> Iterator[RouteRecording]:
    """Route the forward pass run inside the block (``compute_log_probs`` or ``train_step``,
    with its backward and any recompute) with ``routes``: per sequence ``[L_i, num_moe_layers,
    top_k]`` (or ``L_i - 1`` rows; missing and ``-1`` rows route natively). Pass the forward the
    same sequences and token budget. With ``record``, the yielded recording holds the routes the
    forward used when the block exits (the given ones, and the model's own on native rows)."""
    cpu_compat.enable()
    routers = moe_routers(model)
    batches, groups = make_micro_batches(model, sequences, max_tokens_per_micro_batch)
    packed = [
        _pack_routes(model, batch, [routes[i] for i in group], group)
        for batch, group in zip(batches, groups)
    ]
    slices, slice_rank = _sp_split(model)
    device = batches[0].input_ids.device
    pending = {
        id(r.router): deque(
            rows[:, r.moe_index].chunk(slices)[slice_rank].contiguous().to(device)
            for rows in packed
        )
        for r in routers
    }

    def before_forward(router: torch.nn.Module, inputs: tuple) -> None:
        replay = router.router_replay
        if _in_backward():
            replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
            return
        queue = pending[id(router)]
        if not queue:
            raise RuntimeError(
                "replay_routes: a router ran more forward passes than there are micro-batches; "
                "run one forward over the same sequences and max_tokens_per_micro_batch"
            )
        target = queue.popleft()
        tokens = inputs[0].shape[0] * inputs[0].shape[1]
        if target.shape[0] != tokens:
            raise RuntimeError(
                f"replay_routes: a router got {tokens} tokens but the routes cover "
                f"{target.shape[0]}; pass the same sequences and max_tokens_per_micro_batch"
            )
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        replay.set_target_indices(target)

    calls, after_forward = _call_recorder(routers)
    recording = RouteRecording()
    with _hooks(
        routers,
        RouterReplayAction.REPLAY_FORWARD,
        pre_hook=before_forward,
        forward_hook=after_forward if record else None,
    ):
        yield recording
        unused = max((len(q) for q in pending.values()), default=0)
        if unused:
            raise RuntimeError(
                f"replay_routes: routes of {unused} micro-batches were not used; run one "
                "forward over the same sequences and max_tokens_per_micro_batch inside the block"
            )
    if record:
        recording.routes = _finish_recording(
            model, routers, calls, batches, groups, "replay_routes"
        )


def _pack_routes(
    model: ActorModel, batch: PackedBatch, routes: list[torch.Tensor], indices: list[int]
) -> torch.Tensor:
    """Per-sequence routes -> ``[T, num_moe_layers, top_k]`` int64 rows of the packed batch
    (padding and missing rows are ``-1``); under CP the rows of this rank's chunks."""
    config = model.config
    width = (num_moe_layers(model), config.moe_router_topk)
    out = torch.full((batch.row_tokens, *width), NATIVE_ROUTE, dtype=torch.long)
    starts = batch.cu_seqlens_padded[:-1].tolist()
    for i, seq_routes, start, length in zip(indices, routes, starts, batch.lengths):
        seq_routes = torch.as_tensor(seq_routes).long()
        if seq_routes.shape[1:] != width or seq_routes.shape[0] not in (length, length - 1):
            raise ValueError(
                f"replay_routes: routes of sequence {i} have shape {tuple(seq_routes.shape)}; "
                f"expected [{length} or {length - 1}, {width[0]}, {width[1]}] "
                "(tokens, MoE layers, top_k)"
            )
        _check_rows(seq_routes, config.num_moe_experts, i)
        out[start : start + seq_routes.shape[0]] = seq_routes
    return rows_of_this_rank(out, batch)  # this CP rank's chunks


def _check_rows(routes: torch.Tensor, num_experts: int, index: int) -> None:
    """Each row is all ``-1`` or ``top_k`` distinct expert ids in range."""
    native = (routes == NATIVE_ROUTE).all(-1)
    valid = ((routes >= 0) & (routes < num_experts)).all(-1)
    if not bool((native | valid).all()):
        raise ValueError(
            f"replay_routes: sequence {index} has route rows that are neither all -1 nor expert "
            f"ids in [0, {num_experts})"
        )
    ordered = routes.sort(-1).values
    repeated = (ordered[..., 1:] == ordered[..., :-1]).any(-1) & valid
    if bool(repeated.any()):
        token, layer = (int(x) for x in repeated.nonzero()[0])
        raise ValueError(
            f"replay_routes: sequence {index}, token {token}, MoE layer {layer} routes to the same "
            "expert twice; megatron's token dispatcher needs top_k distinct experts per token"
        )
