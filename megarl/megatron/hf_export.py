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

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from megarl.megatron.parallel import unwrap_chunk

if TYPE_CHECKING:
    from megarl.megatron.model import ActorModel


def one_rank_layout(bridge) -> bool:
    """Whether the model-parallel group is this rank alone (no shard to gather)."""
    mpu = bridge.mpu
    return mpu.tp_size == 1 and mpu.pp_size == 1 and mpu.ep_size == 1 and mpu.etp_size == 1


def export_hf_weights(model: ActorModel) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, tensor)`` for every HF tensor, in mbridge's export order (collective over
    the model-parallel groups unless :func:`one_rank_layout`)."""
    bridge = model.bridge
    if not one_rank_layout(bridge):
        yield from bridge.export_weights(model.chunks)
        return
    for chunk in model.chunks:
        yield from _chunk_tensors(bridge, unwrap_chunk(chunk))


def _chunk_tensors(bridge, module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """One chunk's parameters, then the router ``expert_bias`` buffers that megatron keeps out of
    ``named_parameters`` (the keys mbridge adds from ``state_dict``), as HF tensors."""
    to_global = bridge._weight_name_mapping_mcore_local_to_global(module, consider_ep=False)
    seen = set()
    for name, param in module.named_parameters():
        seen.add(name)
        yield from zip(*bridge._weight_to_hf_format(to_global[name], param))
    state = module.state_dict()
    for name in state:
        if "_extra_state" not in name and "expert_bias" in name and name not in seen:
            yield from zip(*bridge._weight_to_hf_format(to_global[name], state[name]))
