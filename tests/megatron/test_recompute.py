"""Activation recomputation (``actor.recompute``) on the native spec on CPU: the setting reaches
the built TransformerConfig, one update's gradients are those without recompute, and the
activations saved for backward shrink."""

from __future__ import annotations

import pytest
import torch

from megarl.megatron.model import RecomputeSettings
from megarl.megatron.parallel import ParallelSizes

FULL = RecomputeSettings(granularity="full", method="uniform", num_layers=1)
SELECTIVE = RecomputeSettings(granularity="selective", modules=("core_attn", "mlp"))
MOE = RecomputeSettings(granularity="selective", modules=("moe",))


def _batch() -> list[dict]:
    """Four sequences with advantages and old log-probs (ratios near 1)."""
    g = torch.Generator().manual_seed(3)
    batch = []
    for n in (9, 14, 6, 11):
        mask = torch.zeros(n)
        mask[3:] = 1
        batch.append({"tokens": torch.randint(0, 128, (n,), generator=g), "loss_mask": mask,
                      "old_log_probs": -5.0 + 0.1 * torch.randn(n, generator=g),
                      "advantages": torch.randn(n, generator=g)})
    return batch


def assert_same_grads(ours: dict, theirs: dict) -> None:
    """Equal to 1e-6 of each gradient's scale (the reentrant recompute's own backward sums the
    residual stream's gradients in another order: ~4e-7 relative on the embedding)."""
    assert ours.keys() == theirs.keys()
    for name, grad in theirs.items():
        diff = (ours[name] - grad).abs().max().item()
        assert diff <= 1e-6 * max(1.0, grad.abs().max().item()), (name, diff)


def grads_on_rank(model_dir: str, sizes: ParallelSizes, recompute: RecomputeSettings) -> dict:
    """Run on each rank: one SGD train_step; returns the config's recompute fields and this
    rank's gradients by parameter name."""
    from megarl.megatron.model import build_actor_model
    from megarl.megatron.optimizer import OptimizerSettings, TrainableActor
    from megarl.megatron.update import LossSettings, TrainSequence, train_step

    model = build_actor_model(model_dir, sizes, torch.float32, spec="native",
                              config_overrides=recompute.config_overrides())
    actor = TrainableActor(model, OptimizerSettings(lr=1e-3, weight_decay=0.0, grad_clip=0.0,
                                                    optimizer="sgd",
                                                    use_distributed_optimizer=False))
    train_step(actor, [TrainSequence(**s) for s in _batch()], LossSettings(),
               max_tokens_per_micro_batch=None)
    cfg = model.chunks[0].config
    grads = {name: p.main_grad.detach().clone() for chunk in model.chunks
             for name, p in chunk.named_parameters()}
    return {"config": (cfg.recompute_granularity, cfg.recompute_method,
                       cfg.recompute_num_layers, cfg.recompute_modules,
                       model.config.recompute_granularity),
            "grads": grads}


def saved_bytes_on_rank(model_dir: str, recompute: RecomputeSettings) -> int:
    """Run on one rank: bytes autograd saves for backward during a training forward."""
    from megarl.megatron.model import build_actor_model

    model = build_actor_model(model_dir, ParallelSizes(), torch.float32, spec="native",
                              config_overrides=recompute.config_overrides())
    chunk = model.chunks[0]
    chunk.train()
    tokens = torch.randint(0, 128, (1, 64), generator=torch.Generator().manual_seed(0))
    position_ids = torch.arange(64)[None]
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        # parameters are not activations; a storage saved twice is held once
        if not isinstance(t, torch.nn.Parameter):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = chunk(tokens, position_ids, None)
    out.float().sum().backward()  # the recomputing backward runs on the CPU too
    return sum(saved.values())


@pytest.mark.parametrize("model,recompute", [("qwen3_4layers", FULL),
                                             ("qwen3_4layers", SELECTIVE), ("qwen3_moe", MOE)],
                         ids=["full", "selective", "moe"])
def test_recompute_reaches_config_and_keeps_gradients(pool1, tiny_models, model, recompute):
    model_dir = tiny_models[model]
    (plain,) = pool1.run(grads_on_rank, model_dir, ParallelSizes(), RecomputeSettings())
    (rc,) = pool1.run(grads_on_rank, model_dir, ParallelSizes(), recompute)
    assert plain["config"][0] is None
    if recompute.granularity == "full":
        assert rc["config"] == ("full", "uniform", 1, ["core_attn"], "full")
    else:
        assert rc["config"] == ("selective", None, None, list(recompute.modules), "selective")
    assert_same_grads(rc["grads"], plain["grads"])
    assert any(g.abs().sum() > 0 for g in plain["grads"].values())


@pytest.mark.parametrize("sizes", [ParallelSizes(tp=2, sequence_parallel=True),
                                   ParallelSizes(pp=2)], ids=["tp2", "pp2"])
def test_full_block_recompute_keeps_gradients_over_two_ranks(pool2, tiny_models, sizes):
    model_dir = tiny_models["qwen3_4layers"]
    plain = pool2.run(grads_on_rank, model_dir, sizes, RecomputeSettings())
    rc = pool2.run(grads_on_rank, model_dir, sizes,
                   RecomputeSettings(granularity="full", method="block", num_layers=2))
    for ours, theirs in zip(rc, plain, strict=True):
        assert ours["config"][:3] == ("full", "block", 2)
        assert_same_grads(ours["grads"], theirs["grads"])


def test_full_recompute_saves_fewer_activations(pool1, tiny_models):
    model_dir = tiny_models["qwen3_4layers"]
    (plain,) = pool1.run(saved_bytes_on_rank, model_dir, RecomputeSettings())
    (full,) = pool1.run(saved_bytes_on_rank, model_dir, FULL)
    (selective,) = pool1.run(saved_bytes_on_rank, model_dir, SELECTIVE)
    assert full < 0.5 * plain, (full, plain)
    assert selective < 0.8 * plain, (selective, plain)


def critic_config_on_rank(model_dir: str) -> tuple:
    """Run on one rank: the recompute fields of the built critic's chunk config."""
    from megarl.megatron.critic import build_critic_model

    model = build_critic_model(model_dir, ParallelSizes(), torch.float32, spec="native",
                               recompute=FULL)
    cfg = model.chunks[0].config
    return cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers


def test_critic_build_receives_recompute(pool1, tiny_models):
    (got,) = pool1.run(critic_config_on_rank, tiny_models["qwen3"])
    assert got == ("full", "uniform", 1)
