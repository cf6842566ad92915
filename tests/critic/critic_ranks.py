"""Functions the critic tests run on every gloo rank: the Megatron value model driven directly,
and the trainer-side critic functions driven through the no-Ray worker group."""

from __future__ import annotations

from typing import Any

import torch

from megarl.megatron.parallel import ParallelSizes

SEED = 7
LENGTHS = (9, 14, 6, 11, 8, 13)
PROMPT = 3  # the first tokens of each sequence are the prompt
TOKEN_BUDGET = 24  # several micro-batches per call
CLIP = 0.2


def sequences(vocab: int = 128) -> list[torch.Tensor]:
    """The token sequences every test scores."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=g) for n in LENGTHS]


def targets(values: list[torch.Tensor]) -> list[torch.Tensor]:
    """Fixed regression targets: the values moved by up to +-1 (some beyond the clip range)."""
    g = torch.Generator().manual_seed(2)
    return [v + 2 * torch.rand(len(v), generator=g) - 1 for v in values]


def loss_mask(n: int) -> torch.Tensor:
    """1 on the response tokens of a sequence of length ``n``."""
    mask = torch.zeros(n)
    mask[PROMPT:] = 1
    return mask


def values_and_head(model_dir: str) -> dict[str, Any]:
    """One rank: the critic's values of the sequences and its head's weights."""
    from megarl.megatron.critic import build_critic_model, compute_values

    model = build_critic_model(model_dir, ParallelSizes(), torch.float32, spec="native",
                               seed=SEED)
    values = compute_values(model, sequences(), max_tokens_per_micro_batch=TOKEN_BUDGET)
    head = model.chunks[-1].output_layer
    return {"values": [v.tolist() for v in values], "weight": head.weight.detach().clone(),
            "bias": head.bias.detach().clone()}


def sgd_update(model_dir: str, sizes: ParallelSizes, lr: float) -> dict[str, Any]:
    """Values, one SGD critic step on this DP rank's share of the sequences (targets from the
    values), values again; every rank returns the values of all sequences."""
    from megatron.core import parallel_state as mpu

    from megarl.batch import even_shares
    from megarl.megatron.critic import (
        ValueLossSettings,
        ValueSequence,
        build_critic_model,
        compute_values,
        critic_train_step,
    )
    from megarl.megatron.optimizer import OptimizerSettings, TrainableActor

    model = build_critic_model(model_dir, sizes, torch.float32, spec="native", seed=SEED)
    critic = TrainableActor(model, OptimizerSettings(
        lr=lr, weight_decay=0.0, optimizer="sgd", use_distributed_optimizer=False,
        grad_clip=0.0))
    seqs = sequences()
    before = compute_values(model, seqs, max_tokens_per_micro_batch=TOKEN_BUDGET)
    goals = targets(before)
    share = even_shares(len(seqs), mpu.get_data_parallel_world_size())[
        mpu.get_data_parallel_rank()]
    batch = [ValueSequence(tokens=seqs[i], loss_mask=loss_mask(len(seqs[i])),
                           old_values=before[i], returns=goals[i]) for i in share]
    metrics = critic_train_step(critic, batch, ValueLossSettings(cliprange_value=CLIP),
                                max_tokens_per_micro_batch=TOKEN_BUDGET)
    after = compute_values(model, seqs, max_tokens_per_micro_batch=TOKEN_BUDGET)
    return {"before": [v.tolist() for v in before], "after": [v.tolist() for v in after],
            "targets": [t.tolist() for t in goals], "metrics": metrics}


def make_batch(scores: list[float]):
    """The sequences as a StepBatch: ``PROMPT`` prompt tokens, the rest the response; 2
    samples per prompt row."""
    from megarl.batch import StepBatch
    from megarl.rollout.interface import RolloutSample

    samples = [RolloutSample(prompt_index=i // 2, sample_index=i % 2,
                             prompt_ids=s[:PROMPT].tolist(), response_ids=s[PROMPT:].tolist(),
                             log_probs=None, finish_reason="stop", weight_version="0")
               for i, s in enumerate(sequences())]
    prompts = [{"data_source": "t", "ground_truth": ""} for _ in range(len(samples) // 2)]
    return StepBatch(samples=samples, prompts=prompts, n=2,
                     scores=torch.tensor(scores, dtype=torch.float32))


def trainer_gae_step(cfg: Any, scores: list[float], gamma: float, lam: float) -> dict[str, Any]:
    """The trainer's critic calls on a no-Ray critic group: values, GAE, two updates, values."""
    from megarl.cluster import init_naive
    from megarl.trainer.critic import (
        compute_values,
        critic_data_metrics,
        gae_advantages_of,
        start_critic,
        update_critic,
    )

    init_naive()
    critic = start_critic(cfg)
    batch = make_batch(scores)
    offloaded = [critic.group.execute_all("offloaded_parts")[0]]
    values = compute_values(critic, batch)
    offloaded.append(critic.group.execute_all("offloaded_parts")[0])
    advantages, goals = gae_advantages_of(batch, values, gamma=gamma, lam=lam)
    first = update_critic(critic, batch, goals, cfg)
    second = update_critic(critic, batch, goals, cfg)
    offloaded.append(critic.group.execute_all("offloaded_parts")[0])
    return {"values": values, "advantages": advantages, "returns": goals.returns,
            "first": first, "second": second, "offloaded": offloaded,
            "data": critic_data_metrics(goals, batch.response_mask()),
            "dp_size": critic.dp_size}
