"""The Megatron critic on real gloo ranks: values against HF transformers' body, TP/PP/EP/DP
parity of values and of one update against one rank, an update that lowers the value loss, and
the trainer's GAE path end to end.

References are written here: the HF model's last hidden states times the head's weights, the
clipped value loss and GAE as plain loops.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from critic_ranks import (
    CLIP,
    LENGTHS,
    PROMPT,
    sequences,
    sgd_update,
    trainer_gae_step,
    values_and_head,
)

from megarl.megatron.parallel import ParallelSizes

TOLERANCE = 1e-4
SGD_LR = 0.05
DEMO_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny-moe-cpu.yaml"


def naive_value_loss(vpreds: list[list[float]], old: list[list[float]],
                     returns: list[list[float]]) -> tuple[float, float]:
    """0.5 * token-mean over response tokens of max((v-R)^2, (clip(v, old+-CLIP)-R)^2), and
    the fraction of tokens where the clipped error is larger."""
    total, clipped, count = 0.0, 0, 0
    for v_row, o_row, r_row in zip(vpreds, old, returns):
        for t in range(PROMPT, len(v_row)):
            v, o, r = v_row[t], o_row[t], r_row[t]
            vc = min(max(v, o - CLIP), o + CLIP)
            total += max((v - r) ** 2, (vc - r) ** 2)
            clipped += (vc - r) ** 2 > (v - r) ** 2
            count += 1
    return 0.5 * total / count, clipped / count


def assert_close(got: list[list[float]], want: list[list[float]], tol: float = TOLERANCE) -> None:
    """Per-sequence lists equal within ``tol``."""
    assert [len(g) for g in got] == [len(w) for w in want]
    worst = max(float((torch.tensor(g) - torch.tensor(w)).abs().max()) for g, w in zip(got, want))
    assert worst < tol, f"max difference {worst}"


@pytest.fixture(scope="module")
def one_rank(pool1, dense_dir, moe_dir) -> dict[str, dict]:
    """Single-rank results: values + head, and the SGD update, for the dense and MoE models."""
    return {
        "head": pool1.run(values_and_head, dense_dir)[0],
        "dense": pool1.run(sgd_update, dense_dir, ParallelSizes(), SGD_LR)[0],
        "moe": pool1.run(sgd_update, moe_dir, ParallelSizes(), SGD_LR)[0],
    }


def test_values_are_the_head_on_the_hf_body(one_rank, dense_dir):
    from transformers import AutoModelForCausalLM

    got = one_rank["head"]
    weight, bias = got["weight"], got["bias"]
    assert weight.shape == (1, 64) and bias.shape == (1,)
    hf = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32).eval()
    want = []
    for seq in sequences():
        with torch.no_grad():
            hidden = hf.model(seq[None]).last_hidden_state[0]
        per_position = (hidden @ weight.T + bias)[:, 0]
        # token j's value is read at position j - 1; token 0 has none
        want.append(torch.cat([torch.zeros(1), per_position[:-1]]).tolist())
    assert [len(v) for v in got["values"]] == list(LENGTHS)
    assert all(v[0] == 0.0 for v in got["values"])
    assert_close(got["values"], want)


def test_update_metrics_match_the_naive_loss_and_lower_it(one_rank):
    run = one_rank["dense"]
    loss_before, clipfrac = naive_value_loss(run["before"], run["before"], run["targets"])
    metrics = run["metrics"]
    assert metrics["critic/vf_loss"] == pytest.approx(loss_before, rel=1e-5)
    # before the step the predictions are the old values: nothing is clipped
    assert clipfrac == 0.0 and metrics["critic/vf_clipfrac"] == 0.0
    assert metrics["critic/lr"] == SGD_LR and metrics["critic/update_skipped"] == 0.0
    assert metrics["critic/grad_norm"] > 0
    response_values = [v for row in run["before"] for v in row[PROMPT:]]
    assert metrics["critic/vpred_mean"] == pytest.approx(
        sum(response_values) / len(response_values), rel=1e-5)
    loss_after, clipfrac_after = naive_value_loss(run["after"], run["before"], run["targets"])
    assert loss_after < 0.9 * loss_before
    assert clipfrac_after > 0  # the step was large enough for clipping to matter


LAYOUTS = {
    "tp2": ("dense", ParallelSizes(tp=2)),
    "pp2": ("dense", ParallelSizes(pp=2)),
    "dp2": ("dense", ParallelSizes()),
    "ep2": ("moe", ParallelSizes(ep=2)),
    "cp2": ("dense", ParallelSizes(cp=2)),  # context parallel: chunks of odd-length sequences
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_one_rank(name, one_rank, pool2, dense_dir, moe_dir):
    model, sizes = LAYOUTS[name]
    reference = one_rank[model]
    results = pool2.run(sgd_update, dense_dir if model == "dense" else moe_dir, sizes, SGD_LR)
    moved = max(abs(a - b) for row_a, row_b in zip(reference["after"], reference["before"])
                for a, b in zip(row_a, row_b))
    assert moved > 1e-2  # the update changed the values: the parity below means something
    for rank_result in results:
        assert_close(rank_result["before"], reference["before"])
        assert_close(rank_result["after"], reference["after"], tol=5 * TOLERANCE)
        for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean",
                    "critic/grad_norm"):
            assert rank_result["metrics"][key] == pytest.approx(
                reference["metrics"][key], rel=1e-4, abs=1e-6), key


def naive_gae(scores: list[float], values: list[list[float]], gamma: float,
              lam: float) -> tuple[list[list[float]], list[list[float]]]:
    """GAE per row with the score on the last token; advantages whitened over all tokens."""
    advantages, returns = [], []
    for score, row in zip(scores, values):
        adv, last = [0.0] * len(row), 0.0
        for t in reversed(range(len(row))):
            reward = score if t == len(row) - 1 else 0.0
            next_value = row[t + 1] if t + 1 < len(row) else 0.0
            last = reward + gamma * next_value - row[t] + gamma * lam * last
            adv[t] = last
        advantages.append(adv)
        returns.append([a + v for a, v in zip(adv, row)])
    flat = [a for row in advantages for a in row]
    mean = sum(flat) / len(flat)
    var = sum((a - mean) ** 2 for a in flat) / (len(flat) - 1)
    whitened = [[(a - mean) / math.sqrt(var + 1e-8) for a in row] for row in advantages]
    return whitened, returns


def gae_config(dense_dir: str, *overrides: str) -> Any:
    """The demo config with a GAE critic on the dense tiny model."""
    from megarl.config import load_config

    cfg, _ = load_config(str(DEMO_CONFIG), [
        f"model.path={dense_dir}", "model.dtype=float32", "algorithm.adv_estimator=gae",
        "algorithm.gamma=0.9", "algorithm.lam=0.8", "data.train_batch_size=3", "rollout.n=2",
        "actor.ppo_mini_batch_size=3", "actor.loss_agg_mode=token-mean", "actor.parallel.tp=1",
        "actor.parallel.pp=1", "actor.parallel.ep=1", "critic.optim.lr=1e-3",
        "critic.optim.weight_decay=0.0", f"critic.cliprange_value={CLIP}",
        "trainer.seed=7", "trainer.total_steps=2", *overrides])
    return cfg


def test_trainer_gae_on_the_critic_values(one_rank, pool2, dense_dir):
    cfg = gae_config(dense_dir)
    assert cfg.critic.enabled
    scores = [1.0, 0.0, 0.5, 1.0, 0.0, -1.0]
    results = pool2.run(trainer_gae_step, cfg, scores, 0.9, 0.8)
    reference = [row[PROMPT:] for row in one_rank["head"]["values"]]
    want_adv, want_ret = naive_gae(scores, reference, 0.9, 0.8)
    for got in results:
        assert got["dp_size"] == 2
        assert_close(got["values"], reference)
        width = max(len(r) for r in reference)
        assert got["advantages"].shape == (len(scores), width)
        assert_close([a[:len(r)].tolist() for a, r in zip(got["advantages"], reference)],
                     want_adv)
        assert_close([a[:len(r)].tolist() for a, r in zip(got["returns"], reference)],
                     want_ret)
        for name in ("vf_loss", "vf_clipfrac", "vpred_mean", "grad_norm", "lr"):
            assert math.isfinite(got["first"][f"critic/{name}"]), name
        assert got["second"]["critic/vf_loss"] < got["first"]["critic/vf_loss"]
        assert got["data"]["critic/returns/mean"] == pytest.approx(
            sum(map(sum, want_ret)) / sum(map(len, want_ret)), rel=1e-4)


def test_critic_offload_keeps_the_state_on_the_host_between_phases(pool2, dense_dir):
    """critic.offload: param, grad and optimizer state in host memory after every phase; the
    values and updates are exactly those without offload."""
    scores = [1.0, 0.0, 0.5, 1.0, 0.0, -1.0]
    plain = pool2.run(trainer_gae_step, gae_config(dense_dir), scores, 0.9, 0.8)[0]
    offload = [f"critic.offload.{part}_offload=true" for part in ("param", "grad", "optimizer")]
    offloaded = pool2.run(trainer_gae_step, gae_config(dense_dir, *offload), scores, 0.9, 0.8)[0]
    assert plain["offloaded"] == [[], [], []]
    assert offloaded["offloaded"] == [["grad", "optimizer", "param"]] * 3
    assert offloaded["values"] == plain["values"]
    for step in ("first", "second"):
        assert offloaded[step]["critic/vf_loss"] == plain[step]["critic/vf_loss"]
