"""The train-pool role: one ``ActorWorker`` per train rank, driven by the trainer.

Each worker joins the train pool's ``torch.distributed`` group, builds its shard of the Megatron
actor (and of the reference model when a KL term needs one) from the HF directory, and serves the
trainer's calls: log-probs of sequences, PPO updates on mini-batches, and streaming the updated
weights to the rollout engines. Data travels as plain Python lists so it crosses Ray cheaply;
the trainer gives every rank of one data-parallel group the same share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from megarl.cluster.worker import Worker
from megarl.megatron.logprobs import compute_log_probs
from megarl.megatron.model import ActorModel, build_actor_model
from megarl.megatron.optimizer import OptimizerSettings, TrainableActor
from megarl.megatron.parallel import ParallelSizes
from megarl.megatron.update import LossSettings, TrainSequence, train_step

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ActorSpec:
    """What an ActorWorker needs to know, taken from the run config by the trainer."""

    model_path: str
    dtype: str
    sizes: ParallelSizes
    optim: OptimizerSettings
    loss: LossSettings
    with_ref: bool
    temperature: float
    max_tokens_per_micro_batch: int | None
    seed: int


def _as_tensor(values: list[float] | None) -> torch.Tensor | None:
    return None if values is None else torch.tensor(values, dtype=torch.float32)


class ActorWorker(Worker):
    """One rank of the Megatron actor (plus reference model) on the train pool."""

    def __init__(self, spec: ActorSpec) -> None:
        self.init_distributed()
        torch.manual_seed(spec.seed)
        self.spec = spec
        dtype = DTYPES[spec.dtype]
        model = build_actor_model(spec.model_path, spec.sizes, dtype, seed=spec.seed)
        self.actor = TrainableActor(model, spec.optim)
        self.ref: ActorModel | None = None
        if spec.with_ref:
            self.ref = build_actor_model(spec.model_path, spec.sizes, dtype, seed=spec.seed)
        self.weight_group: dist.ProcessGroup | None = None

    def layout(self) -> dict[str, int]:
        """This rank's data-parallel coordinates and whether it reports results for its group."""
        first_of_group = (mpu.get_tensor_model_parallel_rank() == 0
                          and mpu.get_pipeline_model_parallel_rank() == 0
                          and mpu.get_context_parallel_rank() == 0)
        return {"dp_rank": mpu.get_data_parallel_rank(), "dp_size": mpu.get_data_parallel_world_size(),
                "reports": int(first_of_group)}

    def compute_log_probs(self, sequences: list[list[int]], use_ref: bool = False,
                          with_entropy: bool = False) -> dict[str, list[list[float]]]:
        """Log-probs (and entropy) of every token of this rank's sequences (entry 0 is 0)."""
        model = self.ref if use_ref else self.actor.model
        assert model is not None, "reference model requested but not built"
        for chunk in model.chunks:
            chunk.eval()
        with torch.no_grad():
            out = compute_log_probs(
                model, [torch.tensor(s, dtype=torch.long) for s in sequences],
                temperature=self.spec.temperature, with_entropy=with_entropy,
                max_tokens_per_micro_batch=self.spec.max_tokens_per_micro_batch)
        result = {"log_probs": [lp.float().tolist() for lp in out.log_probs]}
        if with_entropy and out.entropy is not None:
            result["entropy"] = [e.float().tolist() for e in out.entropy]
        return result

    def update(self, mini_batches: list[list[dict[str, Any]]]) -> list[dict[str, float]]:
        """One optimizer step per mini-batch of this rank's sequences; metrics per step."""
        metrics = []
        for mini_batch in mini_batches:
            sequences = [
                TrainSequence(
                    tokens=torch.tensor(s["tokens"], dtype=torch.long),
                    loss_mask=torch.tensor(s["loss_mask"], dtype=torch.float32),
                    old_log_probs=_as_tensor(s["old_log_probs"]),
                    advantages=_as_tensor(s["advantages"]),
                    ref_log_probs=_as_tensor(s.get("ref_log_probs")),
                    rollout_is_weights=_as_tensor(s.get("rollout_is_weights")),
                )
                for s in mini_batch
            ]
            metrics.append(train_step(
                self.actor, sequences, self.spec.loss,
                max_tokens_per_micro_batch=self.spec.max_tokens_per_micro_batch,
                temperature=self.spec.temperature))
        return metrics

    def _export(self):
        return self.actor.model.bridge.export_weights(self.actor.model.chunks)

    def weight_specs(self) -> list[tuple[str, list[int]]]:
        """HF names and shapes of every exported tensor, in export order (collective)."""
        return [(name, list(tensor.shape)) for name, tensor in self._export()]

    def weight_group_address(self) -> tuple[str, int]:
        """This node's IP and a free port for the weight-update group's rendezvous."""
        from megarl.rollout.process import free_port

        return self.info.node_ip, free_port("0.0.0.0")

    def open_weight_group(self, master_address: str, master_port: int, world_size: int,
                          backend: str) -> None:
        """Rank 0 creates the weight-update group as its rank 0; the engines join it."""
        if self.rank != 0:
            return
        from megarl.rollout.weight_group import open_weight_update_group

        self.weight_group = open_weight_update_group(
            master_address, master_port, rank=0, world_size=world_size, backend=backend)

    def broadcast_weights(self, dtype: str) -> int:
        """Export HF-named tensors (collective over the train pool) and broadcast each one from
        rank 0 over the weight group in export order; returns the bytes sent."""
        sent = 0
        target = DTYPES[dtype]
        for _, tensor in self._export():
            if self.rank != 0:
                continue
            payload = tensor.detach().to(target).contiguous()
            dist.broadcast(payload, src=0, group=self.weight_group)
            sent += payload.numel() * payload.element_size()
        return sent

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model in HF names (rank 0's copy; for tests and checks on tiny models)."""
        return {name: tensor.detach().cpu().clone() for name, tensor in self._export()}
