"""Router replay on a tiny Qwen3-MoE under several layouts, on real gloo ranks.

Recorded routes must be the top-k of HF transformers' router logits for the same tokens
(computed here, independently of megarl); replaying them must reproduce the log-probs
bit-for-bit; replaying other routes must change them; and an update step with replayed routes
must be the same with and without activation recompute (megatron's backward replay); routes
megatron cannot replay are rejected with an error naming the sequence, token and layer.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from megarl.megatron.parallel import ParallelSizes

LENGTHS = (9, 16, 5, 12, 7, 11)
TOKEN_BUDGET = 24  # four micro-batches per forward
OTHER_BUDGET = 40  # two (the interleaved pipeline schedule needs at least PP)
NUM_EXPERTS, TOP_K, NUM_LAYERS = 4, 2, 2
LOGIT_GAP = 1e-4  # HF rows whose k-th and (k+1)-th logits are closer are not compared


def sequences() -> list[torch.Tensor]:
    """The token sequences every test routes."""
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 128, (n,), generator=g) for n in LENGTHS]


def hf_routes(model_dir: str, seqs: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sequence: HF's top-k experts ``[L, layers, k]`` (sorted ids) and which rows are
    unambiguous (the k-th logit is clear of the next one in every layer)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for seq in seqs:
        with torch.no_grad():
            logits = torch.stack(model(seq[None], output_router_logits=True).router_logits, 1)
        ordered = logits.sort(-1, descending=True)
        clear = (ordered.values[..., TOP_K - 1] - ordered.values[..., TOP_K] > LOGIT_GAP).all(-1)
        out.append((ordered.indices[..., :TOP_K].sort(-1).values, clear))
    return out


def replay_on_rank(model_dir: str, sizes: ParallelSizes) -> dict[str, list]:
    """Run on each rank: record routes in a forward, replay them, replay rotated routes."""
    from megarl.megatron.logprobs import compute_log_probs
    from megarl.megatron.model import build_actor_model
    from megarl.megatron.router_replay import (
        ROUTER_REPLAY_OVERRIDES,
        record_routes,
        replay_routes,
    )

    model = build_actor_model(
        model_dir, sizes, torch.float32, spec="native", config_overrides=ROUTER_REPLAY_OVERRIDES
    )
    seqs = sequences()

    def log_probs(routes=None, budget=TOKEN_BUDGET):
        if routes is None:
            return compute_log_probs(model, seqs, max_tokens_per_micro_batch=budget).log_probs
        with replay_routes(model, seqs, routes, max_tokens_per_micro_batch=budget):
            return compute_log_probs(model, seqs, max_tokens_per_micro_batch=budget).log_probs

    with record_routes(model, seqs, max_tokens_per_micro_batch=TOKEN_BUDGET) as recording:
        recorded_lp = compute_log_probs(model, seqs, max_tokens_per_micro_batch=TOKEN_BUDGET)
    routes = recording.routes
    rotated = [((r.long() + 1) % NUM_EXPERTS).to(torch.int16) for r in routes]
    results = {
        "routes": routes,
        "recorded": recorded_lp.log_probs,
        "replayed": log_probs(routes),
        # two micro-batches instead of four: routes follow the sequences, not the packing
        "replayed_other_split": log_probs(routes, budget=OTHER_BUDGET),
        # the last token's route affects no log-prob; -1 rows route natively
        "without_last_row": log_probs([r[:-1] for r in routes]),
        "all_native": log_probs([torch.full_like(r, -1) for r in routes]),
        "rotated": log_probs(rotated),
    }
    return {k: [t.clone() for t in v] for k, v in results.items()}


def check_replay(rank_results: list[dict], reference: list, num_layers: int = NUM_LAYERS) -> None:
    """Routes match HF's top-k; replay reproduces; other routes change the log-probs."""
    for rank, res in enumerate(rank_results):
        for i, (routes, (hf_top, clear)) in enumerate(zip(res["routes"], reference)):
            assert routes.dtype == torch.int16
            assert routes.shape == (LENGTHS[i], num_layers, TOP_K)
            assert clear.float().mean() > 0.9, "too few unambiguous rows to compare"
            mine = routes.long().sort(-1).values
            assert torch.equal(mine[clear], hf_top[clear]), f"rank {rank} seq {i}: routes differ"
        for i, recorded in enumerate(res["recorded"]):
            for key in ("replayed", "without_last_row", "all_native"):
                assert torch.equal(res[key][i], recorded), f"rank {rank} seq {i}: {key}"
            torch.testing.assert_close(res["replayed_other_split"][i], recorded, atol=1e-6, rtol=0)
        change = max((a - b).abs().max().item() for a, b in zip(res["rotated"], res["recorded"]))
        assert change > 1e-2, f"rank {rank}: rotated routes changed log-probs by only {change}"
    for res in rank_results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(res["routes"], rank_results[0]["routes"]))


@pytest.fixture(scope="module")
def reference(tiny_models) -> list:
    """HF transformers' routes for the test sequences."""
    return hf_routes(tiny_models["qwen3_moe"], sequences())


def test_replay_single_rank(pool1, tiny_models, reference):
    check_replay(pool1.run(replay_on_rank, tiny_models["qwen3_moe"], ParallelSizes()), reference)


LAYOUTS = [ParallelSizes(ep=2), ParallelSizes(tp=2), ParallelSizes(pp=2)]


@pytest.mark.parametrize("sizes", LAYOUTS, ids=[str(s) for s in LAYOUTS])
def test_replay_two_ranks(pool2, tiny_models, reference, sizes):
    check_replay(pool2.run(replay_on_rank, tiny_models["qwen3_moe"], sizes), reference)


def test_replay_virtual_pipeline(pool2, tmp_path_factory):
    """4 MoE layers on PP=2 x VPP=2: each rank holds layers {0, 2} or {1, 3}."""
    from megarl.data.tiny_model import make_tiny_model

    path = str(make_tiny_model(tmp_path_factory.mktemp("moe4"), "qwen3_moe", num_hidden_layers=4))
    results = pool2.run(replay_on_rank, path, ParallelSizes(pp=2, vpp=2))
    check_replay(results, hf_routes(path, sequences()), num_layers=4)


RECOMPUTE = {
    "recompute_granularity": "full",
    "recompute_method": "uniform",
    "recompute_num_layers": 1,
}


def train_on_rank(model_dir: str, sizes: ParallelSizes, routes: str, recompute: bool):
    """Run on each rank: one SGD train_step with ``routes`` = "native" (no replay), "recorded"
    or "rotated" routes replayed; returns rank 0's new weights and the metrics."""
    import torch.distributed as dist

    from megarl.megatron.logprobs import compute_log_probs
    from megarl.megatron.model import build_actor_model
    from megarl.megatron.optimizer import OptimizerSettings, TrainableActor
    from megarl.megatron.router_replay import (
        ROUTER_REPLAY_OVERRIDES,
        record_routes,
        replay_routes,
    )
    from megarl.megatron.update import LossSettings, TrainSequence, train_step

    overrides = {**ROUTER_REPLAY_OVERRIDES, **(RECOMPUTE if recompute else {})}
    model = build_actor_model(
        model_dir, sizes, torch.float32, spec="native", config_overrides=overrides
    )
    seqs = sequences()
    with record_routes(model, seqs, max_tokens_per_micro_batch=TOKEN_BUDGET) as recording:
        old = compute_log_probs(model, seqs, max_tokens_per_micro_batch=TOKEN_BUDGET).log_probs
    actor = TrainableActor(
        model,
        OptimizerSettings(
            lr=1.0,
            weight_decay=0.0,
            grad_clip=0.0,
            optimizer="sgd",
            use_distributed_optimizer=False,
        ),
    )
    g = torch.Generator().manual_seed(5)
    batch = [
        TrainSequence(
            tokens=s,
            loss_mask=(torch.arange(len(s)) >= 2).float(),
            old_log_probs=lp + 0.1 * torch.randn(len(s), generator=g),
            advantages=torch.randn(len(s), generator=g),
        )
        for s, lp in zip(seqs, old)
    ]
    replayed = {
        "native": None,
        "recorded": recording.routes,
        "rotated": [(r.long() + 1) % NUM_EXPERTS for r in recording.routes],
    }[routes]
    with contextlib.ExitStack() as stack:
        if replayed is not None:
            stack.enter_context(
                replay_routes(model, seqs, replayed, max_tokens_per_micro_batch=TOKEN_BUDGET)
            )
        metrics = train_step(actor, batch, LossSettings(), max_tokens_per_micro_batch=TOKEN_BUDGET)
    weights = {n: t.detach().clone() for n, t in model.bridge.export_weights(model.chunks)}
    return metrics, weights if dist.get_rank() == 0 else None


def test_replay_in_update_step(pool2, tiny_models):
    """EP=2, several micro-batches: replayed routes steer the update, identically with
    activation recompute (megatron replays the recorded routes in the recomputed forward)."""
    path, sizes = tiny_models["qwen3_moe"], ParallelSizes(ep=2)
    runs = {
        (routes, recompute): pool2.run(train_on_rank, path, sizes, routes, recompute)[0]
        for routes, recompute in [
            ("native", False),
            ("recorded", False),
            ("rotated", False),
            ("rotated", True),
        ]
    }

    def max_diff(a, b):
        wa, wb = runs[a][1], runs[b][1]
        return max((wa[k] - wb[k]).abs().max().item() for k in wa)

    assert max_diff(("native", False), ("recorded", False)) == 0.0
    assert max_diff(("rotated", False), ("rotated", True)) < 1e-6
    assert max_diff(("native", False), ("rotated", False)) > 1e-3
    rotated, recomputed = runs[("rotated", False)][0], runs[("rotated", True)][0]
    assert rotated["actor/pg_loss"] == pytest.approx(recomputed["actor/pg_loss"], abs=1e-7)


def invalid_routes_on_rank(model_dir: str) -> dict[str, str]:
    """Run on one rank: the errors for routes megatron cannot replay and for a model built
    without routing replay."""
    from megarl.megatron.logprobs import compute_log_probs
    from megarl.megatron.model import build_actor_model
    from megarl.megatron.parallel import destroy_parallel
    from megarl.megatron.router_replay import ROUTER_REPLAY_OVERRIDES, replay_routes

    def error(model, routes, forward: bool = True) -> str:
        try:
            with replay_routes(model, sequences(), routes):
                if forward:
                    compute_log_probs(model, sequences())
        except (ValueError, RuntimeError) as e:
            return str(e)
        return "no error"

    model = build_actor_model(
        model_dir, ParallelSizes(), torch.float32, config_overrides=ROUTER_REPLAY_OVERRIDES
    )
    good = [torch.tensor([0, 1]).repeat(n, NUM_LAYERS, 1) for n in LENGTHS]
    repeated = [r.clone() for r in good]
    repeated[2][3, 1] = torch.tensor([3, 3])
    out_of_range = [r.clone() for r in good]
    out_of_range[0][0, 0, 0] = NUM_EXPERTS
    errors = {
        "good": error(model, good),
        "repeated": error(model, repeated),
        "out_of_range": error(model, out_of_range),
        "short": error(model, [r[:-2] for r in good]),
        "unused": error(model, good, forward=False),
    }
    destroy_parallel()
    plain = build_actor_model(model_dir, ParallelSizes(), torch.float32)
    errors["no_replay"] = error(plain, good)
    return errors


def test_invalid_routes_are_rejected(pool1, tiny_models):
    errors = pool1.run(invalid_routes_on_rank, tiny_models["qwen3_moe"])[0]
    assert errors["good"] == "no error"
    assert "sequence 2, token 3, MoE layer 1 routes to the same expert twice" in errors["repeated"]
    assert "neither all -1 nor expert ids in [0, 4)" in errors["out_of_range"]
    assert "expected [9 or 8, 2, 2]" in errors["short"]
    assert "routes of 1 micro-batches were not used" in errors["unused"]
    assert "ROUTER_REPLAY_OVERRIDES" in errors["no_replay"]
