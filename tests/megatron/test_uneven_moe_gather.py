"""TP=2, expert-TP=2, EP=2 on 4 gloo ranks with routing skewed onto one EP rank's experts.

The alltoall token dispatcher all-gathers (and reduce-scatters) tokens within the expert-TP group
with per-rank split sizes that differ when routing is uneven; gloo needs equal sizes, so the CPU
layer pads them (megarl.megatron.cpu_compat, touchpoint 8). Log-probs must match HF transformers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_logprob_parity import TEMPERATURE, hf_reference, score_on_rank, sequences

from megarl.megatron.parallel import ParallelSizes

TOLERANCE = 1e-5
NUM_EXPERTS = 8  # 4 per EP rank
SMALL = 0.5  # scale of EP rank 1's router rows


def skew_router(model_dir: Path) -> None:
    """Route every token's top-2 to the experts of EP rank 0 (experts 0-3).

    Experts 0/1 get rows w/-w and 2/3 get v/-v, scaled up: one of each pair always has a positive
    logit, so the experts of EP rank 1 (smaller random rows) win a slot only now and then. Routing
    that is skewed but not total makes the per-rank token counts differ (all-or-nothing routing
    would make them equal again).
    """
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    weights = load_file(path)
    g = torch.Generator().manual_seed(1)
    for name, w in weights.items():
        if name.endswith("mlp.gate.weight"):
            rows = torch.randn(2, w.shape[1], generator=g)
            w[:4] = torch.stack([rows[0], -rows[0], rows[1], -rows[1]]) * 2.0
            w[4:] = SMALL * torch.randn(4, w.shape[1], generator=g)
    save_file(weights, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def skewed_moe(tmp_path_factory) -> str:
    """A tiny Qwen3-MoE (8 experts, top-2) whose routers prefer EP rank 0's experts."""
    from megarl.data.tiny_model import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("skewed") / "m", "qwen3_moe",
                           seed=3, num_experts=NUM_EXPERTS)
    skew_router(path)
    return str(path)


def test_routing_is_skewed(skewed_moe):
    """The HF model sends most, not all, routed slots to experts 0-3 (EP rank 0)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(skewed_moe, dtype=torch.float32).eval()
    chosen = []
    for seq in sequences():
        with torch.no_grad():
            out = model(seq[None], output_router_logits=True)
        chosen += [logits.topk(2, dim=-1).indices.flatten() for logits in out.router_logits]
    share = (torch.cat(chosen) < NUM_EXPERTS // 2).float().mean().item()
    assert 0.7 < share < 1.0, share


def test_tp2_etp2_ep2_uneven_routing(skewed_moe):
    """The forward runs on gloo and its log-probs and entropies match HF transformers."""
    from dist_utils import run_on_ranks

    ref_lp, ref_ent = hf_reference(skewed_moe, sequences())
    sizes = ParallelSizes(tp=2, etp=2, ep=2)
    results = run_on_ranks(4, score_on_rank, skewed_moe, sizes)
    for rank, (indices, log_probs, entropies) in enumerate(results):
        for i, lp, ent in zip(indices, log_probs, entropies):
            assert (torch.tensor(lp) - ref_lp[i]).abs().max().item() <= TOLERANCE, (rank, i)
            assert (torch.tensor(ent) - ref_ent[i]).abs().max().item() <= TOLERANCE, (rank, i)
    assert all(r == results[0] for r in results), "ranks disagree"
    assert TEMPERATURE > 0


def uneven_collectives_on_rank() -> tuple[list, list]:
    """On each of 2 ranks: gather rank-sized pieces (0 and 3 rows) and reduce-scatter them back."""
    import torch.distributed as dist

    from megarl.megatron import cpu_compat

    cpu_compat.enable()
    rank, rows = dist.get_rank(), [0, 3]
    mine = torch.full((rows[rank], 2), float(rank + 1))
    pieces = list(torch.empty(sum(rows), 2).split(rows))
    dist.all_gather(pieces, mine)
    full = torch.cat(pieces)
    out = torch.empty(rows[rank], 2)
    dist.reduce_scatter(out, list(full.split(rows)))
    return full.tolist(), out.tolist()


def test_uneven_all_gather_and_reduce_scatter_on_gloo():
    """Pieces of different row counts (one empty) gather and reduce-scatter like on NCCL."""
    from dist_utils import run_on_ranks

    results = run_on_ranks(2, uneven_collectives_on_rank)
    for full, _ in results:
        assert full == [[2.0, 2.0]] * 3
    assert results[0][1] == [] and results[1][1] == [[4.0, 4.0]] * 3
