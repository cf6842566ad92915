"""The critic role on the train pool: one ``CriticWorker`` per train rank, driven by the trainer.

Each worker joins its group's ``torch.distributed`` world (its own Ray worker group; under
torchrun the processes the actor runs in, with the actor's layout), builds its shard of the
Megatron value model (:mod:`megarl.megatron.critic`) from the HF directory, and serves the
trainer's calls: values of sequences, and value-loss updates on mini-batches. What
``critic.offload`` switches on stays in host memory between those calls (the actor's
StateOffloader). Data travels as
plain Python lists; the trainer gives every rank of one data-parallel group the same share.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from functools import partial
from typing import Any

import torch
from megatron.core import parallel_state as mpu

from megarl.cluster.worker import Worker
from megarl.megatron.checkpoint import load_checkpoint, save_checkpoint
from megarl.megatron.critic import (
    ValueSequence,
    build_critic_model,
    compute_values,
    critic_train_step,
)
from megarl.megatron.offload import PARTS, StateOffloader
from megarl.megatron.optimizer import TrainableActor
from megarl.megatron.settings import CriticSpec
from megarl.megatron.worker import DTYPES
from megarl.memory import free_cached_memory, settle_long_lived_objects


def _first_of_group() -> bool:
    """Whether this rank reports results for its data-parallel group (TP, PP and CP rank 0)."""
    return (mpu.get_tensor_model_parallel_rank() == 0
            and mpu.get_pipeline_model_parallel_rank() == 0
            and mpu.get_context_parallel_rank() == 0)


class CriticWorker(Worker):
    """One rank of the Megatron value model on the train pool."""

    def __init__(self, spec: CriticSpec) -> None:
        self.init_distributed()
        torch.manual_seed(spec.seed)
        self.spec = spec
        model = build_critic_model(spec.model_path, spec.sizes, DTYPES[spec.dtype],
                                   seed=spec.seed, recompute=spec.recompute,
                                   trust_remote_code=spec.trust_remote_code)
        self.critic = TrainableActor(model, spec.optim)
        self.offloader = StateOffloader(model.chunks, self.critic.optimizer,
                                        stream_bytes=spec.offload.stream_bytes)
        self.offloader.offload(spec.offload.parts())
        settle_long_lived_objects()  # later hand-offs and saves collect only newer objects

    @contextlib.contextmanager
    def _on_device(self, parts: Sequence[str]) -> Iterator[None]:
        """``parts`` of the critic's state on the device inside the block; afterwards what
        ``critic.offload`` switches on goes back to host memory until the next phase."""
        self.offloader.reload(parts)
        try:
            yield
        finally:
            self.offloader.offload(self.spec.offload.parts())

    def free_cache(self) -> dict[str, int]:
        """Hand this process's cached, unused device blocks back to the driver (colocated: before
        the engines resume); the bytes it held ``before`` and ``after``."""
        return free_cached_memory()

    def offloaded_parts(self) -> list[str]:
        """The parts of the critic's state in host memory now (:data:`PARTS` names)."""
        return sorted(self.offloader.offloaded)

    def layout(self) -> dict[str, int]:
        """This rank's data-parallel coordinates and whether it reports results for its group."""
        return {"dp_rank": mpu.get_data_parallel_rank(),
                "dp_size": mpu.get_data_parallel_world_size(),
                "reports": int(_first_of_group())}

    def compute_values(self, sequences: list[list[int]]) -> list[list[float]]:
        """Values of every token of this rank's sequences, aligned with the tokens (entry ``j``:
        the value of the state before token ``j``; entry 0 is 0)."""
        tokens = [torch.tensor(s, dtype=torch.long) for s in sequences]
        with self._on_device(["param"]):
            values = compute_values(self.critic.model, tokens,
                                    max_tokens_per_micro_batch=self.spec.max_tokens_per_micro_batch)
        return [v.tolist() for v in values]

    def update(self, mini_batches: list[list[dict[str, Any]]]) -> list[dict[str, float]]:
        """One optimizer step per mini-batch of this rank's records (``tokens``, ``loss_mask``,
        ``values``, ``returns``: per-token lists over prompt + response); metrics per step."""
        deferred = self.spec.offload.optimizer_offload  # on the device for the steps only
        metrics = []
        with self._on_device(self.spec.offload.update_parts()):
            for index, mini_batch in enumerate(mini_batches):
                if deferred and index:
                    self.offloader.offload(["optimizer"])
                metrics.append(self._update_one(mini_batch, deferred))
        return metrics

    def _update_one(self, mini_batch: list[dict[str, Any]], deferred: bool) -> dict[str, float]:
        """One optimizer step on one mini-batch of records; ``deferred``: the optimizer state
        comes back after the last backward."""
        sequences = [
            ValueSequence(
                tokens=torch.tensor(r["tokens"], dtype=torch.long),
                loss_mask=torch.tensor(r["loss_mask"], dtype=torch.float32),
                old_values=torch.tensor(r["values"], dtype=torch.float32),
                returns=torch.tensor(r["returns"], dtype=torch.float32),
            )
            for r in mini_batch
        ]
        return critic_train_step(
            self.critic, sequences, self.spec.loss,
            max_tokens_per_micro_batch=self.spec.max_tokens_per_micro_batch,
            before_step=(partial(self.offloader.reload_for_step, ["optimizer"]) if deferred
                         else None))

    def save_checkpoint(self, root: str, step: int, extra: dict[str, Any],
                        keep_last: int | None) -> str:
        """Save the value model, optimizer, LR schedule and RNG states at ``step`` under ``root``
        (collective; a root of its own, next to the actor's). Returns the directory."""
        with self._on_device(PARTS):
            return str(save_checkpoint(root, self.critic, step, extra=extra,
                                       keep_last=keep_last))

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        """Restore the critic from a checkpoint (a directory or a root's latest); collective."""
        with self._on_device(PARTS):
            loaded = load_checkpoint(path, self.critic)
        return {"path": str(loaded.path), "step": loaded.step, "extra": loaded.extra}
