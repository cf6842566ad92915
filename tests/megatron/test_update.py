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
ADAM_LR, ADAM_EPS = 1e-3, 1e-8  # AdamW as megatron's OptimizerConfig and torch default it
# Two fp32 gradients of the same loss, summed in different orders (threads, DP ranks, packed
# micro-batches), differ by rounding: measured up to 3.3e-6 of the tensor's largest gradient
# element (qwen3_moe, 1 vs 2 threads, DP=2 vs 1); the bound allows 10x that.
GRAD_RTOL = 3e-5
WEIGHT_ROUNDING = 1e-6  # the weights' own rounding when w - lr * u is formed in another order


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


def reference_loss_terms(model, batch: list[dict]):
    """Token-mean PPO surrogate (dual clip), entropy and k3 KL of ``batch`` under an HF model."""
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
    return pg, ent, kl


def reference_step(model_dir: str, batch: list[dict], optimizer: str, grad_clip: float) -> dict:
    """The update computed on the HF model: new weights by checkpoint name, loss, grad norm."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    pg, ent, kl = reference_loss_terms(model, batch)
    (pg - ENTROPY_COEFF * ent + KL_COEF * kl).backward()
    grad_norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters())).item()
    if grad_clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=ADAM_LR, eps=ADAM_EPS, weight_decay=0.0)
    grads = checkpoint_named_grads(model, f"{model_dir}.ref_{optimizer}_grads")
    opt.step()
    out = f"{model_dir}.ref_{optimizer}"
    model.save_pretrained(out)
    return {
        "weights": load_file(f"{out}/model.safetensors"),
        "pg_loss": pg.item(),
        "entropy": ent.item(),
        "kl_loss": kl.item(),
        "grad_norm": grad_norm,
        "grads": grads,
    }


@torch.no_grad()
def checkpoint_named_grads(model, out: str) -> dict[str, torch.Tensor]:
    """``model``'s gradients under its checkpoint names (HF may fuse experts in memory and
    split them on save): written by ``save_pretrained`` in place of the weights."""
    from safetensors.torch import load_file

    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    for p in model.parameters():
        p.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
    model.save_pretrained(out)
    for name, p in model.named_parameters():
        p.copy_(weights[name])
    return load_file(f"{out}/model.safetensors")


def adam_first_step_bound(grad: torch.Tensor) -> torch.Tensor:
    """Per element, how far two AdamW first steps may land apart when their gradients are this
    ``grad`` up to fp32 rounding (``|g' - g| <= GRAD_RTOL * max|g|``).

    With bias correction the first step moves each weight by ``lr * g / (|g| + eps)``: the
    gradient divided by its own magnitude. f(x) = x / (|x| + eps) is odd and increasing, so over
    ``[g - d, g + d]`` it spans exactly ``f(|g| + d) - f(|g| - d)``: about ``2 d eps / g^2``
    (nothing) where the gradient is clear of its rounding, and up to 2 (a full step each way)
    where the gradient is no larger than its rounding and its sign is noise. A gradient that is
    exactly zero summed only zeros (the embedding row of a token not in the batch, an expert
    no token reached): no order rounds it, and its weight must not move.
    """
    d = GRAD_RTOL * grad.abs().max()
    a = grad.abs()
    f = lambda x: x / (x.abs() + ADAM_EPS)
    return torch.where(a > 0, ADAM_LR * (f(a + d) - f(a - d)), 0.0) + WEIGHT_ROUNDING


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
            lr=SGD_LR if optimizer == "sgd" else ADAM_LR,
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
        assert graphed.buckets and graphed.padding_tokens > 0
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
    """Rank 0's exported weights equal the reference's (within ``atol``, or with ``atol="adam"``
    within :func:`adam_first_step_bound` of each element's reference gradient); the metrics
    match on every rank."""
    metrics, weights = results[0]
    assert set(weights) == set(reference["weights"])
    for name, ref in reference["weights"].items():
        if atol == "adam":
            bound = adam_first_step_bound(reference["grads"][name])
            excess = (weights[name] - ref).abs() - bound
            worst = int(excess.argmax())
            assert excess.max() <= 0, (
                f"{name}[{worst}]: {weights[name].flatten()[worst]:.9g} vs the reference "
                f"{ref.flatten()[worst]:.9g}, beyond the AdamW bound {bound.flatten()[worst]:.3g}"
                f" of its gradient {reference['grads'][name].flatten()[worst]:.3g}")
        else:
            torch.testing.assert_close(weights[name], ref, atol=atol, rtol=0, msg=name)
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


def expert_layout_on_rank(model_dir, use_distributed_optimizer):
    """For each grouped expert layer of a DDP-wrapped actor: whether its weights and their
    ``main_grad`` are one [E, out, in] view in expert order, and whether its weight gradients
    are fused."""
    from megarl.megatron.model import build_actor_model
    from megarl.megatron.native_modules import _GroupedLinear
    from megarl.megatron.optimizer import OptimizerSettings, TrainableActor
    from megarl.megatron.wgrad_fusion import stacked_main_grads, stacked_view

    model = build_actor_model(model_dir, ParallelSizes(), torch.float32)
    TrainableActor(model, OptimizerSettings(
        lr=ADAM_LR, optimizer="adam" if use_distributed_optimizer else "sgd",
        use_distributed_optimizer=use_distributed_optimizer))
    layout = []
    for module in model.chunks[0].modules():
        if isinstance(module, _GroupedLinear):
            weights = module._weights()
            params, grads = stacked_view(weights), stacked_main_grads(weights)
            layout.append((params is not None and not params[1],
                           grads is not None and not grads[1], module.fuse_wgrad))
    return layout


def test_ddp_lays_out_each_expert_layer_as_one_tensor_in_expert_order(pool1, tiny_models):
    """The grouped GEMMs take the experts' weights as a view of DDP's parameter buffer (with
    the distributed optimizer) and add the weight gradients through one view of its gradient
    buffer, in expert order (no stacked or reversed copy)."""
    sharded, = pool1.run(expert_layout_on_rank, tiny_models["qwen3_moe"], True)
    plain, = pool1.run(expert_layout_on_rank, tiny_models["qwen3_moe"], False)
    assert len(sharded) == 2 * 2  # fc1 and fc2 of two layers
    assert sharded == [(True, True, True)] * 4
    # without a parameter buffer each weight keeps its own tensor: stacked per GEMM
    assert plain == [(False, True, True)] * 4


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


@pytest.fixture(scope="module")
def adam_references(tiny_models, batches) -> list[dict]:
    """The qwen3_moe AdamW reference step with torch on 1 and on 2 threads: their reductions
    run in other orders, so their gradients differ by rounding (what made the DP=2 test fail
    after test modules that set the test process to 1 thread, issue 28)."""
    threads = torch.get_num_threads()
    refs = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            refs.append(reference_step(tiny_models["qwen3_moe"], batches["qwen3_moe"], "adam",
                                       0.0))
    finally:
        torch.set_num_threads(threads)
    return refs


def test_adam_first_step_turns_the_rounding_of_tiny_gradients_into_weight_steps():
    """Why a fixed tolerance cannot hold AdamW's first step: a gradient whose size is near its
    own rounding error moves its weight by up to lr either way. Two gradients that differ by
    3e-6 of the largest element (rounding, as between thread counts) give updates 1e-4 apart;
    the per-element bound covers them, and is at the weights' rounding where the gradient
    is clear."""
    grad = torch.tensor([2e-2, -3e-4, 1e-6, 3.6e-9, -2e-9, 0.0])
    noisy = grad + torch.tensor([6e-8, -6e-8, 6e-8, -6e-8, 6e-8, 0.0])  # |noise| <= 3e-6 max|g|
    steps = []
    for g in (grad, noisy):
        w = torch.nn.Parameter(torch.zeros(6))
        w.grad = g.clone()
        torch.optim.AdamW([w], lr=ADAM_LR, eps=ADAM_EPS, weight_decay=0.0).step()
        steps.append(w.detach())
    diff = (steps[0] - steps[1]).abs()
    bound = adam_first_step_bound(grad)
    assert diff.max() > 1e-4  # a plain atol=1e-4 fails on rounding alone
    assert (diff <= bound).all(), (diff, bound)
    assert (bound[:2] <= WEIGHT_ROUNDING + 1e-9).all()  # tight where the gradient is clear
    assert (bound[3:5] > 1.5 * ADAM_LR).all()  # a full step either way where it is noise
    assert bound[5] == WEIGHT_ROUNDING  # an exact zero summed zeros: it has no rounding


@pytest.mark.parametrize("distributed", [True, False])
def test_adam_step_with_data_parallel(pool2, tiny_models, batches, adam_references,
                                      distributed):
    """AdamW, DP=2, with and without the distributed (sharded) optimizer, against the
    reference taken on 1 and on 2 threads (their gradients differ by rounding)."""
    results = pool2.run(
        update_on_rank,
        tiny_models["qwen3_moe"],
        ParallelSizes(),
        batches["qwen3_moe"],
        optimizer="adam",
        dp_split=True,
        use_distributed_optimizer=distributed,
    )
    for ref in adam_references:
        assert_same_update(results, ref, atol="adam")


def test_non_finite_loss_skips_the_step(pool1, tiny_models, batches):
    from safetensors.torch import load_file

    bad = [dict(s) for s in batches["qwen3"]]
    bad[1] = dict(bad[1], advantages=torch.full_like(bad[1]["advantages"], float("nan")))
    ((metrics, weights),) = pool1.run(update_on_rank, tiny_models["qwen3"], ParallelSizes(), bad)
    assert metrics["actor/update_skipped"] == 1.0
    before = load_file(f"{tiny_models['qwen3']}/model.safetensors")
    for name, value in before.items():
        assert torch.equal(weights[name], value), name
