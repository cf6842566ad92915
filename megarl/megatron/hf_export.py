"""HF-named tensors of an :class:`~megarl.megatron.model.ActorModel`: what the weight sync sends.

mbridge's ``export_weights`` serves every layout the same way: for each parameter it gathers the
name and the tensor's spec as Python objects over the pipeline group, broadcasts the tensor over
it, gathers tensor-parallel and expert shards, and only then converts to HF names and layouts.
On a model-parallel group of one rank (TP = PP = EP = ETP = 1: one GPU, or pure data
parallelism) every one of those collectives is an identity, yet each costs a pickle, a device
copy of the pickled bytes and a synchronisation: about 2 ms per HF tensor on the CPU, thousands
of tensors for an MoE model. :func:`export_hf_weights` takes the parameters directly there, in
mbridge's order and through its own name and layout conversion (``_weight_to_hf_format``), so
the tensors are the same (views of the parameters where the layout allows); every other layout
goes through mbridge.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from megarl.megatron.parallel import unwrap_chunk

if TYPE_CHECKING:
    from megarl.megatron.model import ActorModel


def one_rank_layout(bridge) -> bool:
    """Whether the model-parallel group is this rank alone (no shard to gather)."""
    mpu = bridge.mpu
    return mpu.tp_size == 1 and mpu.pp_size == 1 and mpu.ep_size == 1 and mpu.etp_size == 1


def export_hf_weights(model: ActorModel, copies_only: bool = False
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, tensor)`` for every HF tensor, in mbridge's export order (collective over
    the model-parallel groups unless :func:`one_rank_layout`). ``copies_only``: only the
    tensors that are not views of their parameter (a split QKV), for a sync whose engine
    holds the views already (:func:`view_token` says when that holds)."""
    bridge = model.bridge
    if not one_rank_layout(bridge):
        if copies_only:
            raise ValueError("copies_only: the export gathers shards on this layout; every "
                             "tensor is a copy")
        yield from bridge.export_weights(model.chunks)
        return
    for chunk in model.chunks:
        yield from _chunk_tensors(bridge, unwrap_chunk(chunk), copies_only)


def view_token(model: ActorModel) -> tuple | None:
    """What the views of the export depend on: each chunk's recorded plan and where each of
    its parameters and buffers lies (an offload's reload or a rebuilt model changes it); None
    while some chunk has no plan yet (before its first export) or the layout gathers shards.
    Equal tokens mean :func:`export_hf_weights` yields views of the same memory, at the same
    places (``copies_only`` relies on it). Its second item is the set of (data pointer, bytes)
    of their storages.

    The tensors are listed once per plan (walking an MoE chunk's modules costs milliseconds);
    a parameter replaced by a new object under the same plan is not noticed (megarl never does
    that to a built actor: offloads move storages, checkpoints load in place)."""
    if not one_rank_layout(model.bridge):
        return None
    plans, pointers = [], []
    for chunk in model.chunks:
        module = unwrap_chunk(chunk)
        plan = _PLANS.get(module)
        if plan is None:
            return None
        plans.append(id(plan))
        listed = _TENSORS.get(module)
        if listed is None or listed[0] != id(plan):
            listed = (id(plan), list(itertools.chain(module.parameters(), module.buffers())))
            _TENSORS[module] = listed
        # the C method: Parameter.data_ptr goes through Python dispatch, ~5x slower
        pointers.extend(map(torch._C.TensorBase.data_ptr, listed[1]))
    key = (tuple(plans), tuple(pointers))
    if _TOKEN[0] != key:  # the storages only when something moved
        storages = {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
                    for chunk in model.chunks for t in _TENSORS[unwrap_chunk(chunk)][1]}
        _TOKEN[:] = [key, frozenset(storages)]
    return key[0], _TOKEN[1], key[1]


_TOKEN: list = [None, None]
"""The last (plans, pointers) :func:`view_token` saw and its storages."""
_TENSORS: weakref.WeakKeyDictionary[torch.nn.Module, tuple[int, list[torch.Tensor]]] = (
    weakref.WeakKeyDictionary())
"""Per chunk, its parameters and buffers, listed for the plan whose id is first."""


def copy_names(model: ActorModel) -> list[str]:
    """HF names of the tensors that are not views of their parameter, in export order (what
    ``export_hf_weights(model, copies_only=True)`` yields); call after a first export."""
    return [name for name, _ in export_hf_weights(model, copies_only=True)]


@dataclass
class _Param:
    """How one parameter (or ``expert_bias`` buffer) of a chunk becomes HF tensors."""

    name: str
    global_name: str
    buffer: bool
    layout: tuple = ()
    """The parameter's (shape, stride) when recorded: the views hold while it is unchanged."""
    views: list[tuple[str, tuple[int, ...], tuple[int, ...], int]] | None = None
    """(HF name, size, stride, offset from the parameter's own) of each HF tensor, when every one
    is a view of the parameter; None: mbridge computes them at every export."""


_PLANS: weakref.WeakKeyDictionary[torch.nn.Module, list[_Param]] = weakref.WeakKeyDictionary()
"""Per chunk, the :class:`_Param` of each parameter in export order, learnt on its first export."""


def _chunk_tensors(bridge, module: torch.nn.Module, copies_only: bool = False
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """One chunk's parameters, then the router ``expert_bias`` buffers that megatron keeps out of
    ``named_parameters`` (the keys mbridge adds from ``state_dict``), as HF tensors.

    mbridge's conversion (names, and splitting fused QKV and gate/up) costs tens of microseconds
    of Python per parameter, thousands of times for an MoE model. The first export records which
    HF tensors are views of their parameter (all but a split QKV: embeddings, norms, projections,
    each expert's gate and up halves); later exports rebuild those views with ``as_strided`` of
    the tensor ``named_parameters`` yields then (a LoRA merge yields a new one) and call mbridge
    only for the rest. ``copies_only`` yields only the rest, from the recorded plan, without
    looking at the views' parameters (:func:`view_token` tells whether those moved)."""
    plan = _PLANS.get(module)
    if copies_only:  # the views are not looked at: view_token says whether they moved
        if plan is None:
            raise ValueError("copies_only: export every tensor once first (no plan is recorded)")
        for entry in plan:
            if entry.views is None:
                tensor = (module.get_buffer(entry.name) if entry.buffer
                          else module.get_parameter(entry.name))
                yield from zip(*bridge._weight_to_hf_format(entry.global_name, tensor))
        return
    params = dict(module.named_parameters())  # what it yields now (LoRA merges through it)
    if plan is None or [e.name for e in plan if not e.buffer] != list(params):
        plan = []
        yield from _recorded(bridge, module, plan)
        if all(not e.buffer or _has_buffer(module, e.name) for e in plan):
            _PLANS[module] = plan
        return
    for entry in plan:
        tensor = module.get_buffer(entry.name) if entry.buffer else params[entry.name]
        base = tensor.detach()
        if entry.views is None or (base.shape, base.stride()) != entry.layout:
            yield from zip(*bridge._weight_to_hf_format(entry.global_name, tensor))
            continue
        offset = base.storage_offset()
        for name, size, stride, rel in entry.views:
            yield name, base.as_strided(size, stride, offset + rel)


def _recorded(bridge, module: torch.nn.Module, plan: list[_Param]
              ) -> Iterator[tuple[str, torch.Tensor]]:
    """Export through mbridge, appending each parameter's :class:`_Param` to ``plan``."""
    to_global = bridge._weight_name_mapping_mcore_local_to_global(module, consider_ep=False)
    sources = [(name, param, False) for name, param in module.named_parameters()]
    seen = {name for name, _, _ in sources}
    state = module.state_dict()
    sources += [(name, state[name], True) for name in state
                if "_extra_state" not in name and "expert_bias" in name and name not in seen]
    for name, tensor, buffer in sources:
        names, tensors = bridge._weight_to_hf_format(to_global[name], tensor)
        base = tensor.detach()
        entry = _Param(name, to_global[name], buffer, (base.shape, base.stride()), [])
        for hf_name, hf_tensor in zip(names, tensors):
            if not _is_view_of(hf_tensor, base):
                entry.views = None
            elif entry.views is not None:
                entry.views.append((hf_name, tuple(hf_tensor.shape), hf_tensor.stride(),
                                    hf_tensor.storage_offset() - base.storage_offset()))
        plan.append(entry)
        yield from zip(names, tensors)


def _has_buffer(module: torch.nn.Module, name: str) -> bool:
    try:
        module.get_buffer(name)
    except AttributeError:
        return False
    return True


def _is_view_of(tensor: torch.Tensor, base: torch.Tensor) -> bool:
    """Whether ``tensor`` is a view of ``base``'s memory in its dtype."""
    return (tensor.dtype == base.dtype and tensor.device == base.device and base.numel() > 0
            and tensor.untyped_storage().data_ptr() == base.untyped_storage().data_ptr())
