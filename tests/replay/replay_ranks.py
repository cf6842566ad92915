"""Functions the replay tests run on every gloo rank: an fp32 ActorWorker with routers that can
record and replay, driven the way the trainer drives it."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from megarl.megatron.parallel import ParallelSizes

TOKEN_BUDGET = 96  # several micro-batches per forward: routes must follow sequences, not packing


def make_worker(model_dir: str, sizes: ParallelSizes, lr: float = 1e-3, budget: int = TOKEN_BUDGET):
    """An fp32 ActorWorker on this rank (Adam, no distributed optimizer, router replay on)."""
    from megarl.megatron.optimizer import OptimizerSettings
    from megarl.megatron.update import LossSettings
    from megarl.megatron.worker import ActorSpec, ActorWorker

    spec = ActorSpec(
        model_path=model_dir, dtype="float32", sizes=sizes,
        optim=OptimizerSettings(lr=lr, weight_decay=0.0, use_distributed_optimizer=False),
        loss=LossSettings(), with_ref=False, temperature=1.0,
        max_tokens_per_micro_batch=budget, seed=1, router_replay=True)
    return ActorWorker(spec)


def r3_forwards(model_dir: str, sizes: ParallelSizes, sequences: list[list[int]],
                engine_routes: list[torch.Tensor],
                response_only_routes: list[torch.Tensor]) -> dict[str, Any]:
    """Old-log-prob forwards as R3 runs them: without replay (recording), replaying the
    engine's routes, and replaying routes that lack the prompt rows (-1)."""
    worker = make_worker(model_dir, sizes)
    return {
        "native": worker.compute_log_probs(sequences, record_routes=True),
        "replayed": worker.compute_log_probs(sequences, routes=engine_routes, record_routes=True),
        "response_only": worker.compute_log_probs(sequences, routes=response_only_routes,
                                                  record_routes=True),
    }


def r2_update(model_dir: str, sizes: ParallelSizes, shares: list[list[int]],
              records: list[dict[str, Any]], replay: bool) -> dict[str, Any]:
    """R2 on this DP rank's share: record routes in the old-log-prob forward, then two
    mini-batch updates (a different packing, and the second after a large step), replaying the
    recorded routes when ``replay``; returns the old routes and the routes each update used."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    worker = make_worker(model_dir, sizes, lr=0.05)
    mine = shares[mpu.get_data_parallel_rank()]
    old = worker.compute_log_probs([records[i]["tokens"] for i in mine], record_routes=True)
    batch = [dict(records[i], old_log_probs=lp) for i, lp in zip(mine, old["log_probs"])]
    if replay:
        batch = [dict(r, routes=routes) for r, routes in zip(batch, old["routes"])]
    half = len(batch) // 2
    # a smaller token budget than the old-log-prob pass: other micro-batches, other packing
    worker.spec = dataclasses.replace(worker.spec, max_tokens_per_micro_batch=40)
    metrics, used = worker.update_recording_routes([batch[:half], batch[half:]])
    return {"rank": dist.get_rank(), "indices": mine, "old": old["routes"],
            "used": used[0] + used[1], "metrics": metrics}


def log_prob_budgets(model_dir: str, sizes: ParallelSizes,
                     sequences: list[list[int]]) -> dict[str, Any]:
    """The old-log-prob forward with the training budget, then with its own
    (``log_prob_max_tokens_per_micro_batch``); the budgets the forwards were given."""
    from megarl.megatron import worker as worker_module

    worker = make_worker(model_dir, sizes)
    real, budgets = worker_module.compute_log_probs, []

    def spy(*args: Any, **kwargs: Any) -> Any:
        budgets.append(kwargs["max_tokens_per_micro_batch"])
        return real(*args, **kwargs)

    worker_module.compute_log_probs = spy
    try:
        default = worker.compute_log_probs(sequences)["log_probs"]
        worker.spec = dataclasses.replace(worker.spec, log_prob_max_tokens_per_micro_batch=40)
        own = worker.compute_log_probs(sequences)["log_probs"]
    finally:
        worker_module.compute_log_probs = real
    return {"budgets": budgets, "default": default, "own": own}
