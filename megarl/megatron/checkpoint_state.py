"""What an actor checkpoint holds, for the save and the load alike: the model's architecture
fingerprint, the megatron layout, and the sharded state (model chunks as global tensors, the
distributed optimizer's state in its ``fully_reshardable`` format, one RNG state per rank) that
megatron-core's dist-checkpointing writes and reads (:mod:`megarl.megatron.checkpoint`)."""

from __future__ import annotations

import contextlib
import gc
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.distributed import DistributedDataParallel
from megatron.core.tensor_parallel import get_cuda_rng_tracker

from megarl.megatron.model import ActorModel
from megarl.megatron.optimizer import TrainableActor

OPTIMIZER_METADATA = {
    "distrib_optim_sharding_type": "fully_reshardable",
    # parameter-keyed optimizer state, the same whichever sub-optimizer holds a parameter
    "chained_optim_avoid_prefix": True,
}
# HF config fields that fix the shapes and meaning of the weights
_ARCHITECTURE_FIELDS = (
    "model_type",
    "architectures",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "n_shared_experts",
    "first_k_dense_replace",
    "decoder_sparse_step",
    "mlp_only_layers",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
)


def model_fingerprint(hf_config: Any) -> dict[str, Any]:
    """The architecture fields of an HF config (those present), which a checkpoint must match."""
    config = getattr(hf_config, "text_config", None) or hf_config
    values = config.to_dict()
    return {name: values[name] for name in _ARCHITECTURE_FIELDS if values.get(name) is not None}


def current_layout() -> dict[str, int | None]:
    """This process's megatron layout and world size (recorded in each checkpoint)."""
    return {
        "world_size": dist.get_world_size(),
        "tp": mpu.get_tensor_model_parallel_world_size(),
        "pp": mpu.get_pipeline_model_parallel_world_size(),
        "vpp": mpu.get_virtual_pipeline_model_parallel_world_size(),
        "ep": mpu.get_expert_model_parallel_world_size(),
        "etp": mpu.get_expert_tensor_parallel_world_size(),
        "cp": mpu.get_context_parallel_world_size(),
        "dp": mpu.get_data_parallel_world_size(),
    }


def chunk_modules(model: ActorModel) -> list[torch.nn.Module]:
    """The GPT modules of the chunks (without their DDP wrapper, whose names add ``module.``)."""
    return [c.module if isinstance(c, DistributedDataParallel) else c for c in model.chunks]


def sharded_model_state(model: ActorModel) -> dict[str, Any]:
    """The model chunks' sharded state dict (``model``, or ``model0``, ``model1``... with VPP)."""
    modules = chunk_modules(model)
    if len(modules) == 1:
        return {"model": modules[0].sharded_state_dict()}
    return {f"model{i}": m.sharded_state_dict() for i, m in enumerate(modules)}


def _rng_state() -> dict[str, Any]:
    state = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Set Python's, NumPy's, torch's (and CUDA's) RNGs and megatron's tracker to ``state``."""
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _rng_sharded_object(state: Any) -> ShardedObject:
    """One RNG state per global rank."""
    world = dist.get_world_size()
    return ShardedObject("megarl.rng_state", state, (world,), (dist.get_rank(),), replica_id=0)


@contextlib.contextmanager
def _collections_see_only_new_objects() -> Iterator[None]:
    """Inside, a full ``gc.collect()`` scans only the objects created inside.

    megatron-core's ``DistributedOptimizer.sharded_state_dict`` ends with ``gc.collect()`` (for
    the garbage of its own state conversion). In a rank, which holds the half million objects of
    torch, megatron-core and Ray, that collection takes 0.25-0.3 s of CPU at every save and
    load. ``gc.freeze`` sets the objects that exist before the call aside for that collection;
    ``gc.unfreeze`` hands them back to the collector, so nothing is kept alive that would
    otherwise be freed. In a worker that set its long-lived objects aside at setup
    (:func:`megarl.memory.settle_long_lived_objects`) the collection already skips them, and
    this changes nothing (an unfreeze would hand those back too)."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def sharded_actor_state(
    target: ActorModel | TrainableActor, with_optimizer: bool, with_rng: bool, loading: bool
) -> dict[str, Any]:
    """The sharded state dict of the model, with the optimizer's and this rank's RNG state when
    asked; ``loading``: the request a load fills in (no RNG state to save)."""
    model = target.model if isinstance(target, TrainableActor) else target
    state = sharded_model_state(model)
    if with_optimizer:
        with _collections_see_only_new_objects():
            state["optimizer"] = target.optimizer.sharded_state_dict(
                state, is_loading=loading, metadata=dict(OPTIMIZER_METADATA)
            )
    if with_rng:
        state["rng_state"] = _rng_sharded_object(None if loading else _rng_state())
    return state
