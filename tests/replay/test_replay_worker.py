"""Router replay through megarl's ActorWorker on real gloo ranks, with routes and log-probs from
a real embedded engine running the model in bf16 while the trainer runs it in fp32.

R3: without replay the trainer routes some token-layers differently from the engine; replaying
the engine's routes makes every one agree (EP, TP with sequence parallelism, PP), brings the
trainer's log-probs closer to the engine's, and gives the same log-probs on every layout.
Prompt rows the engine did not return are routed by the trainer itself. R2: the update forwards
(other micro-batches, after an optimizer step) use exactly the routes recorded in the
old-log-prob forward of each sequence; without replay they drift.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from replay_ranks import r2_update, r3_forwards

from megarl.algo import rollout_probs_diff_metrics, router_agreement
from megarl.batch import StepBatch, even_shares
from megarl.megatron.parallel import ParallelSizes

LAYOUTS = {"ep2": ParallelSizes(ep=2), "tp2_sp": ParallelSizes(tp=2, sequence_parallel=True),
           "pp2": ParallelSizes(pp=2)}


def probs_diff(batch: StepBatch, log_probs: list[list[float]]) -> float:
    """Mean |p_trainer - p_engine| over the response tokens."""
    responses = [batch.response_slice(lp, i) for i, lp in enumerate(log_probs)]
    return float(rollout_probs_diff_metrics(batch.padded(responses), batch.rollout_log_probs(),
                                            batch.response_mask())["rollout_probs_diff_mean"])


@pytest.fixture(scope="module")
def r3_results(pool2, moe_dir, bf16_batch) -> dict[str, dict]:
    """Rank 0's R3 forwards on every layout."""
    response_only = StepBatch(samples=[
        dataclasses.replace(s, routed_experts=s.routed_experts[len(s.prompt_ids):])
        for s in bf16_batch.samples], prompts=bf16_batch.prompts, n=bf16_batch.n)
    args = (bf16_batch.sequences(), bf16_batch.engine_routes(), response_only.engine_routes())
    return {name: pool2.run(r3_forwards, moe_dir, sizes, *args)[0]
            for name, sizes in LAYOUTS.items()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_r3_replays_the_engine_routes(r3_results, bf16_batch, layout, record_property):
    engine = bf16_batch.engine_routes()
    native, replayed = r3_results[layout]["native"], r3_results[layout]["replayed"]
    for routes, seq in zip(replayed["routes"], bf16_batch.sequences()):
        assert routes.dtype == torch.int16 and routes.shape == (len(seq), 2, 2)
    agreement = float(router_agreement(engine, native["routes"]))
    assert 0.9 < agreement < 1.0, "bf16 vs fp32 should flip a few near-tied routes"
    assert float(router_agreement(engine, replayed["routes"])) == 1.0
    without, with_r3 = (probs_diff(bf16_batch, r["log_probs"]) for r in (native, replayed))
    assert with_r3 < without
    record_property("numbers", {"router_agreement_no_replay": agreement,
                                "probs_diff_no_replay": without, "probs_diff_r3": with_r3})


def test_r3_log_probs_agree_across_layouts(r3_results):
    reference = r3_results["ep2"]["replayed"]["log_probs"]
    for name in ("tp2_sp", "pp2"):
        for a, b in zip(reference, r3_results[name]["replayed"]["log_probs"]):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=2e-5, rtol=0)


def test_prompt_rows_without_engine_routes_are_routed_by_the_trainer(r3_results, bf16_batch):
    """The engine returned response rows only: prompt tokens route as the trainer's own forward
    routes them (their hidden states depend on prompt tokens only), response rows as the
    engine's; the recorded routes (replayed later in the update) hold both."""
    result = r3_results["ep2"]
    engine = bf16_batch.engine_routes()
    for i, s in enumerate(bf16_batch.samples):
        p = len(s.prompt_ids)
        used = result["response_only"]["routes"][i]
        assert torch.equal(used[:p], result["native"]["routes"][i][:p])
        assert torch.equal(used[p:-1].long().sort(-1).values, engine[i][p:].long().sort(-1).values)


def r2_records(batch: StepBatch) -> list[dict]:
    """Update records of every sample: response tokens trained on, random advantages."""
    gen = torch.Generator().manual_seed(3)
    records = []
    for s in batch.samples:
        tokens = list(s.prompt_ids) + list(s.response_ids)
        mask = [0.0] * len(s.prompt_ids) + [1.0] * len(s.response_ids)
        records.append({"tokens": tokens, "loss_mask": mask,
                        "advantages": torch.randn(len(tokens), generator=gen).tolist()})
    return records


@pytest.mark.parametrize("replay", [True, False], ids=["R2", "no_replay"])
def test_r2_update_routes_equal_the_old_log_prob_routes(pool2, moe_dir, bf16_batch, replay,
                                                        record_property):
    records = r2_records(bf16_batch)
    shares = [list(r) for r in even_shares(len(records), 2)]
    ranks = pool2.run(r2_update, moe_dir, ParallelSizes(ep=2), shares, records, replay)
    assert sorted(i for r in ranks for i in r["indices"]) == list(range(len(records)))
    first, second = [], []
    for r in ranks:
        half = len(r["indices"]) // 2
        assert all(len(u) == len(records[i]["tokens"]) for i, u in zip(r["indices"], r["used"]))
        first.append(float(router_agreement(r["old"][:half], r["used"][:half])))
        second.append(float(router_agreement(r["old"][half:], r["used"][half:])))
        assert all(m["actor/update_skipped"] == 0.0 for m in r["metrics"])
    # the first mini-batch runs on the old weights: same routes either way
    assert first == [1.0, 1.0]
    if replay:
        assert second == [1.0, 1.0]
        for r in ranks:
            assert all(torch.equal(o, u) for o, u in zip(r["old"], r["used"]))
    else:
        assert max(second) < 1.0, "a large step should move some routes"
    record_property("numbers", {"second_minibatch_agreement": second})
