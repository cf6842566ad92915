"""Context parallelism on four real gloo ranks: cp=2 equals cp=1 (log-probs, entropy, one
update, router replay), alone (with dp=2) and with tp=2 (sequence parallel), ep=2 and pp=2.

Sequences have odd lengths, so every one is padded to a multiple of 2 x cp (x tp) and cut into
chunks that the two CP ranks hold out of order (chunks 0 and 3 on one, 1 and 2 on the other).
The cp=1 results come from the same pool laid out as dp=4, every rank scoring every sequence.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import RankPool
from test_update import make_batch, update_on_rank

from megarl.megatron.packing import (
    context_parallel_positions,
    pack_sequences,
    split_for_context_parallel,
)
from megarl.megatron.parallel import ParallelSizes

LENGTHS = (9, 13, 5, 11, 7)
TOLERANCE = 1e-5
CP_LAYOUTS = {  # model -> layouts with cp=2 on four ranks (qwen3_moe's cp=2 and tp=2 x cp=2
    # log-probs are checked by the router replay test)
    "qwen3": [ParallelSizes(cp=2), ParallelSizes(tp=2, cp=2), ParallelSizes(pp=2, cp=2)],
    "qwen3_moe": [ParallelSizes(ep=2, cp=2)],
}


@pytest.fixture(scope="module")
def pool4():
    """Four gloo ranks on 127.0.0.1, for this module's tests."""
    pool = RankPool(4)
    yield pool
    pool.close()


def test_split_follows_megatron_chunk_order():
    """Rank r holds chunks r and 2cp-1-r of every padded sequence, positions included, and the
    gather index puts the ranks' tokens back in row order."""
    seqs = [torch.arange(100, 100 + n) for n in (5, 9)]  # padded to 8 and 12 for cp=2
    packed = pack_sequences(seqs, align=4)
    assert packed.cu_seqlens_padded.tolist() == [0, 8, 20]
    assert context_parallel_positions([0, 8, 20], 2, 0).tolist() == [0, 1, 6, 7, 8, 9, 10, 17,
                                                                      18, 19]
    parts = [split_for_context_parallel(packed, 2, r) for r in range(2)]
    assert parts[1].input_ids[0].tolist() == [102, 103, 104, 0, 103, 104, 105, 106, 107, 108]
    assert parts[1].position_ids[0].tolist() == [2, 3, 4, 5, 3, 4, 5, 6, 7, 8]
    gathered = torch.cat([p.input_ids[0] for p in parts])
    assert torch.equal(gathered[parts[0].cp_gather_index], packed.input_ids[0])


def sequences(vocab: int = 128) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (n,), generator=g) for n in LENGTHS]


def score_on_rank(model_dir: str, sizes: ParallelSizes, budget: int | None):
    """Log-probs and entropies of every sequence on this rank."""
    from megarl.megatron.logprobs import compute_log_probs
    from megarl.megatron.model import build_actor_model

    model = build_actor_model(model_dir, sizes, torch.float32, spec="native")
    out = compute_log_probs(model, sequences(), temperature=0.9, with_entropy=True,
                            max_tokens_per_micro_batch=budget)
    return [t.clone() for t in out.log_probs], [t.clone() for t in out.entropy]


def assert_close_results(results, expected) -> None:
    for rank, (log_probs, entropies) in enumerate(results):
        for i, n in enumerate(LENGTHS):
            assert log_probs[i].shape == (n,)
            torch.testing.assert_close(log_probs[i], expected[0][i], atol=TOLERANCE, rtol=0,
                                       msg=f"rank {rank} seq {i} log-probs")
            torch.testing.assert_close(entropies[i], expected[1][i], atol=TOLERANCE, rtol=0,
                                       msg=f"rank {rank} seq {i} entropy")


def test_cp2_log_probs_equal_cp1(pool4, tiny_models):
    """The dense model in every layout, several micro-batches (token budget 24)."""
    cp1 = pool4.run(score_on_rank, tiny_models["qwen3"], ParallelSizes(), 24)[0]
    # the values are real log-probs, not a constant both layouts would share
    assert min(lp[1:].min().item() for lp in cp1[0]) < -1.0
    for sizes in CP_LAYOUTS["qwen3"]:
        assert_close_results(pool4.run(score_on_rank, tiny_models["qwen3"], sizes, 24), cp1)


@pytest.mark.parametrize("name", list(CP_LAYOUTS))
def test_cp2_update_step_equals_cp1(pool4, tiny_models, name):
    """One SGD step (PPO clip + entropy + KL loss, two micro-batches) under cp=2 moves the
    weights exactly as cp=1 does (whose step test_update.py checks against HF's)."""
    model_dir = tiny_models[name]
    batch = make_batch(model_dir)
    cp1 = pool4.run(update_on_rank, model_dir, ParallelSizes(), batch, budget=20)
    for sizes in CP_LAYOUTS[name]:
        cp2 = pool4.run(update_on_rank, model_dir, sizes, batch, budget=20)
        weights1, weights2 = cp1[0][1], cp2[0][1]
        for key, w in weights1.items():
            torch.testing.assert_close(weights2[key], w, atol=TOLERANCE, rtol=0,
                                       msg=f"{sizes}: {key}")
        for key in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/grad_norm"):
            expected = cp1[0][0][key]
            assert all(abs(r[0][key] - expected) <= 1e-5 * max(1.0, abs(expected))
                       for r in cp2), (sizes, key)


def test_cp2_router_replay_equals_cp1(pool4, tiny_models):
    """R2 under cp=2: the routes recorded in the old-log-prob forward equal cp=1's exactly,
    replaying them reproduces the log-probs bit for bit, and an update with replayed (rotated)
    routes moves the weights as cp=1's does (so replayed rows follow the chunk permutation)."""
    from test_router_replay import replay_on_rank, train_on_rank

    path = tiny_models["qwen3_moe"]
    cp1 = pool4.run(replay_on_rank, path, ParallelSizes())[0]
    # tp=2 adds sequence parallelism: each TP rank routes a slice of the CP rank's chunks
    cp2 = [res for sizes in (ParallelSizes(cp=2), ParallelSizes(tp=2, cp=2))
           for res in pool4.run(replay_on_rank, path, sizes)]
    for rank, res in enumerate(cp2):
        for i, (mine, ref) in enumerate(zip(res["routes"], cp1["routes"])):
            assert torch.equal(mine, ref), f"rank {rank} seq {i}: routes differ from cp=1"
        for i, recorded in enumerate(res["recorded"]):
            assert torch.equal(res["replayed"][i], recorded), f"rank {rank} seq {i}"
            assert torch.equal(res["all_native"][i], recorded), f"rank {rank} seq {i}"
            torch.testing.assert_close(recorded, cp1["recorded"][i], atol=TOLERANCE, rtol=0)
            torch.testing.assert_close(res["rotated"][i], cp1["rotated"][i], atol=TOLERANCE,
                                       rtol=0)
    rotated1 = pool4.run(train_on_rank, path, ParallelSizes(), "rotated", False)[0]
    rotated2 = pool4.run(train_on_rank, path, ParallelSizes(cp=2), "rotated", False)[0]
    # Padding (token id 0) appended for the 2 x cp chunks gets a gradient of ~2e-5 through the
    # MoE layers; tp=2 with sequence parallelism pads and shows the same on main, cp=1 has no
    # padding: the padding token's embedding row is left out of the comparison.
    rotated1[1]["model.embed_tokens.weight"][0] = rotated2[1]["model.embed_tokens.weight"][0]
    diff = {k: (rotated2[1][k] - rotated1[1][k]).abs().max().item() for k in rotated1[1]}
    assert max(diff.values()) <= TOLERANCE, diff
    # the rotated routes really steer the forward (else the equalities prove little)
    change = max((a - b).abs().max().item() for a, b in zip(cp1["rotated"], cp1["recorded"]))
    assert change > 1e-2
