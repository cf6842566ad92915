"""One actor update step against the same step taken on the HF transformers model.

The reference is written out here: HF log-probs, the PPO clipped surrogate with dual clip, the
entropy bonus and the k3 KL, token-mean over the whole mini-batch, then plain SGD (or AdamW).
megatron's new weights (exported to HF names through the bridge) must equal the reference's,
whatever the parallel layout and however the mini-batch is split into micro-batches or ranks.
"""

from __future__ import annotations

import pytest
import torch

from megarl.megatron.parallel import ParallelSizes

LENGTHS = (9, 14, 6, 11)
PROMPT = 3  # the first tokens of each sequence are the prompt (not trained on)
CLIP_LOW, CLIP_HIGH, CLIP_C = 0.2, 0.28, 3.0
ENTROPY_COEFF, KL_COEF = 0.01, 0.1
SGD_LR = 1.0
ATOL = 2e-5


def make_batch(model_dir: str) -> list[dict]:
    """Sequences with old/ref log-probs near the model's own (ratios near 1, some clipped)."""
    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batch = []
    for n in LENGTHS:
        tokens = torch.randint(0, 128, (n,), generator=g)
        with torch.no_grad():
            lp = hf_log_probs(model, tokens)
        mask = torch.zeros(n)
        mask[PROMPT:] = 1
        batch.append(
            {
                "tokens": tokens,
                "loss_mask": mask,
                "old_log_probs": lp + 0.3 * torch.randn(n, generator=g),
                "ref_log_probs": lp + 0.2 * torch.randn(n, generator=g),
                "advantages": torch.randn(n, generator=g),
            }
        )
    return batch


def hf_log_probs(model, tokens: torch.Tensor, with_entropy: bool = False):
    """Target-aligned log-probs (and entropies) of one sequence under an HF model."""
    logp = torch.log_softmax(model(tokens[None]).logits[0].float(), dim=-1)
    lp = torch.cat([torch.zeros(1), logp[:-1].gather(-1, tokens[1:, None])[:, 0]])
    if not with_entropy:
        return lp
    ent = torch.cat([torch.zeros(1), -(logp.exp() * logp).sum(-1)[:-1]])
    return lp, ent


def reference_step(model_dir: str, batch: list[dict], optimizer: str, grad_clip: float) -> dict:
    """The update computed on the HF model: new weights by checkpoint name, loss, grad norm."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    terms = []
    for s in batch:
        lp, ent = hf_log_probs(model, s["tokens"], with_entropy=True)
        ratio = torch.exp(lp - s["old_log_probs"])
        adv = s["advantages"]
        surrogate = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH))
        surrogate = torch.where(adv < 0, torch.minimum(surrogate, -adv * CLIP_C), surrogate)
        d = s["ref_log_probs"] - lp
        kl = torch.exp(d) - d - 1
        terms.append((surrogate, ent, kl, s["loss_mask"]))
    tokens = sum(m.sum() for *_, m in terms)
    pg = sum((x * m).sum() for x, _, _, m in terms) / tokens
    ent = sum((e * m).sum() for _, e, _, m in terms) / tokens
    kl = sum((k * m).sum() for _, _, k, m in terms) / tokens
    (pg - ENTROPY_COEFF * ent + KL_COEF * kl).backward()
    grad_norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters())).item()
    if grad_clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    opt.step()
    out = f"{model_dir}.ref_{optimizer}"
    model.save_pretrained(out)
    return {
        "weights": load_file(f"{out}/model.safetensors"),
        "pg_loss": pg.item(),
        "entropy": ent.item(),
        "kl_loss": kl.item(),
        "grad_norm": grad_norm,
    }


def update_on_rank(
    model_dir,
    sizes,
    batch,
    optimizer="sgd",
    grad_clip=0.0,
    budget=None,
    dp_split=False,
    use_distributed_optimizer=None,
    dtype=torch.float32,
    graph_bucket=None,
    graph_emulate=True,
):
    """Run on each rank: one train_step; returns metrics and (rank 0) the exported weights.
    With ``graph_bucket`` the micro-batches run through :class:`GraphedChunk`'s static buckets
    of that many tokens (``graph_emulate``: its buffers and autograd plumbing without CUDA)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from megarl.megatron.model import build_actor_model
    from megarl.megatron.optimizer import OptimizerSettings, TrainableActor
    from megarl.megatron.update import LossSettings, TrainSequence, train_step

    model = build_actor_model(model_dir, sizes, dtype)
    if use_distributed_optimizer is None:  # megatron shards Adam only
        use_distributed_optimizer = optimizer == "adam"
    actor = TrainableActor(
        model,
        OptimizerSettings(
            lr=SGD_LR if optimizer == "sgd" else 1e-3,
            weight_decay=0.0,
            grad_clip=grad_clip,
            optimizer=optimizer,
            use_distributed_optimizer=use_distributed_optimizer,
        ),
    )
    if dp_split:
        batch = batch[mpu.get_data_parallel_rank() :: mpu.get_data_parallel_world_size()]
    settings = LossSettings(
        clip_ratio_low=CLIP_LOW,
        clip_ratio_high=CLIP_HIGH,
        clip_ratio_c=CLIP_C,
        entropy_coeff=ENTROPY_COEFF,
        use_kl_loss=True,
        kl_loss_coef=KL_COEF,
        kl_loss_type="low_var_kl",
    )
    graphed = None
    if graph_bucket is not None:
        from megarl.megatron.cuda_graphs import GraphedChunk

        graphed = GraphedChunk(model.chunks[0], bucket_tokens=graph_bucket,
                               emulate=graph_emulate)
    metrics = train_step(
        actor, [TrainSequence(**s) for s in batch], settings, max_tokens_per_micro_batch=budget,
        graphed=graphed,
    )
    if graphed is not None:  # the test must exercise the graphed path, with padded buckets
        assert graphed.failed is None, graphed.failed
        assert graphed.buckets and any(b.tokens > 16 for b in graphed.buckets.values())
    weights = {
        name: t.detach().cpu().clone() for name, t in model.bridge.export_weights(model.chunks)
    }
    return metrics, weights if dist.get_rank() == 0 else None


@pytest.fixture(scope="module")
def batches(tiny_models) -> dict[str, list[dict]]:
    """The mini-batch per model."""
    return {name: make_batch(tiny_models[name]) for name in ("qwen3", "qwen3_moe")}


@pytest.fixture(scope="module")
def sgd_references(tiny_models, batches) -> dict[str, dict]:
    """Reference SGD steps per model."""
    return {
        name: reference_step(tiny_models[name], batch, "sgd", 0.0)
        for name, batch in batches.items()
    }


def assert_same_update(results, reference, atol=ATOL) -> None:
    """Rank 0's exported weights equal the reference's; the metrics match on every rank."""
    metrics, weights = results[0]
    assert set(weights) == set(reference["weights"])
    moved = 0.0
    for name, ref in reference["weights"].items():
        torch.testing.assert_close(weights[name], ref, atol=atol, rtol=0, msg=name)
        moved = max(moved, (ref - weights[name]).abs().max().item())
    for key in ("pg_loss", "entropy", "kl_loss", "grad_norm"):
        assert metrics[f"actor/{key}"] == pytest.approx(reference[key], rel=1e-4, abs=1e-6), key
    assert metrics["actor/update_skipped"] == 0.0
    assert all(r[0] == metrics for r in results), "ranks report different metrics"


def test_update_changes_weights(tiny_models, sgd_references):
    """The reference step really moves the weights (else equality would prove nothing)."""
    from safetensors.torch import load_file

    before = load_file(f"{tiny_models['qwen3']}/model.safetensors")
    after = sgd_references["qwen3"]["weights"]
    assert max((after[k] - before[k]).abs().max().item() for k in before) > 1e-3


@pytest.mark.parametrize("budget", [None, 20])
def test_single_rank_sgd(pool1, tiny_models, batches, sgd_references, budget):
    results = pool1.run(
        update_on_rank, tiny_models["qwen3"], ParallelSizes(), batches["qwen3"], budget=budget
    )
    assert_same_update(results, sgd_references["qwen3"])


UPDATE_LAYOUTS = [
    ("qwen3", ParallelSizes(tp=2), {"budget": 16}),
    ("qwen3", ParallelSizes(pp=2), {"budget": 16}),
    ("qwen3", ParallelSizes(), {"dp_split": True}),
    ("qwen3_moe", ParallelSizes(), {}),
    ("qwen3_moe", ParallelSizes(tp=2), {"budget": 20}),
    ("qwen3_moe", ParallelSizes(tp=2, etp=1), {"budget": 20}),
    ("qwen3_moe", ParallelSizes(ep=2), {"budget": 16}),
    ("qwen3_moe", ParallelSizes(ep=2), {"dp_split": True}),
    # the ranks' sequences (9+6 and 14+11 tokens) need 1 and 2 micro-batches of 16 tokens: the
    # first rank splits its one to match, else its expert all-to-alls would wait forever
    ("qwen3_moe", ParallelSizes(ep=2), {"dp_split": True, "budget": 16}),
]


@pytest.mark.parametrize(
    "name,sizes,kw", UPDATE_LAYOUTS, ids=[f"{n}-{s}-{k}" for n, s, k in UPDATE_LAYOUTS]
)
def test_sgd_step_matches_reference(
    pool1, pool2, tiny_models, batches, sgd_references, name, sizes, kw
):
    pool = pool1 if sizes == ParallelSizes() and not kw.get("dp_split") else pool2
    results = pool.run(update_on_rank, tiny_models[name], sizes, batches[name], **kw)
    assert_same_update(results, sgd_references[name])


GRAPHED_LAYOUTS = [
    ("qwen3", ParallelSizes(), {"budget": 20, "graph_bucket": 16}),
    ("qwen3_moe", ParallelSizes(), {"graph_bucket": 24}),
    ("qwen3_moe", ParallelSizes(ep=2), {"budget": 16, "graph_bucket": 32}),
    ("qwen3_moe", ParallelSizes(tp=2), {"budget": 20, "graph_bucket": 16}),
]


@pytest.mark.parametrize(
    "name,sizes,kw", GRAPHED_LAYOUTS, ids=[f"{n}-{s}-{k}" for n, s, k in GRAPHED_LAYOUTS]
)
def test_graphed_buckets_match_reference(
    pool1, pool2, tiny_models, batches, sgd_references, name, sizes, kw
):
    """Micro-batches padded into CUDA-graph buckets (an extra tail sequence, empty sequences in
    the offsets) train exactly like the eager step."""
    pool = pool1 if sizes == ParallelSizes() else pool2
    results = pool.run(update_on_rank, tiny_models[name], sizes, batches[name], **kw)
    assert_same_update(results, sgd_references[name])


def test_gradient_clipping(pool2, tiny_models, batches):
    """Clipping at half the gradient norm halves the SGD update (DP=2, TP layout)."""
    ref = reference_step(tiny_models["qwen3"], batches["qwen3"], "sgd", 0.0)
    clip = ref["grad_norm"] / 2
    clipped = reference_step(tiny_models["qwen3"], batches["qwen3"], "sgd", clip)
    results = pool2.run(
        update_on_rank,
        tiny_models["qwen3"],
        ParallelSizes(tp=2),
        batches["qwen3"],
        grad_clip=clip,
        budget=20,
    )
    assert_same_update(results, clipped)


@pytest.mark.parametrize("distributed", [True, False])
def test_adam_step_with_data_parallel(pool2, tiny_models, batches, distributed):
    """AdamW, DP=2, with and without the distributed (sharded) optimizer."""
    ref = reference_step(tiny_models["qwen3_moe"], batches["qwen3_moe"], "adam", 0.0)
    results = pool2.run(
        update_on_rank,
        tiny_models["qwen3_moe"],
        ParallelSizes(),
        batches["qwen3_moe"],
        optimizer="adam",
        dp_split=True,
        use_distributed_optimizer=distributed,
    )
    assert_same_update(results, ref, atol=1e-4)


def test_non_finite_loss_skips_the_step(pool1, tiny_models, batches):
    from safetensors.torch import load_file

    bad = [dict(s) for s in batches["qwen3"]]
    bad[1] = dict(bad[1], advantages=torch.full_like(bad[1]["advantages"], float("nan")))
    ((metrics, weights),) = pool1.run(update_on_rank, tiny_models["qwen3"], ParallelSizes(), bad)
    assert metrics["actor/update_skipped"] == 1.0
    before = load_file(f"{tiny_models['qwen3']}/model.safetensors")
    for name, value in before.items():
        assert torch.equal(weights[name], value), name
