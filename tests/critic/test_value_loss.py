"""The clipped value loss against a loop written here, and its split invariance."""

from __future__ import annotations

import pytest
import torch

from megarl.algo.aggregation import loss_counts
from megarl.algo.value_loss import value_loss

CLIP = 0.3


def make_inputs(seed: int = 0, rows: int = 5, width: int = 7) -> dict[str, torch.Tensor]:
    """Predictions near the old values (some beyond the clip range), random returns, ragged
    masks with one empty row."""
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(rows, width, generator=g)
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    lengths[2] = 0
    mask = (torch.arange(width)[None] < lengths[:, None]).float()
    return {"vpreds": old + 0.6 * torch.randn(rows, width, generator=g), "old_values": old,
            "returns": torch.randn(rows, width, generator=g), "response_mask": mask}


def naive(inputs: dict[str, torch.Tensor]) -> tuple[float, float, float]:
    """Loss, clip fraction and mean prediction by looping over the valid tokens."""
    total, clipped, preds, count = 0.0, 0, 0.0, 0
    rows, width = inputs["vpreds"].shape
    for i in range(rows):
        for t in range(width):
            if not inputs["response_mask"][i, t]:
                continue
            v, o, r = (float(inputs[k][i, t]) for k in ("vpreds", "old_values", "returns"))
            vc = min(max(v, o - CLIP), o + CLIP)
            total += max((v - r) ** 2, (vc - r) ** 2)
            clipped += (vc - r) ** 2 > (v - r) ** 2
            preds += v
            count += 1
    return 0.5 * total / count, clipped / count, preds / count


def test_matches_the_naive_formula():
    inputs = make_inputs()
    loss, metrics = value_loss(**inputs, cliprange_value=CLIP)
    want_loss, want_clipfrac, want_mean = naive(inputs)
    assert float(loss) == pytest.approx(want_loss, rel=1e-6)
    assert 0 < want_clipfrac < 1
    assert float(metrics["vf_clipfrac"]) == pytest.approx(want_clipfrac, rel=1e-6)
    assert float(metrics["vpred_mean"]) == pytest.approx(want_mean, rel=1e-6)


def test_gradient_is_zero_where_the_clipped_error_wins():
    inputs = make_inputs(seed=1)
    vpreds = inputs.pop("vpreds").requires_grad_(True)
    value_loss(vpreds, **inputs, cliprange_value=CLIP)[0].backward()
    o, r, m = inputs["old_values"], inputs["returns"], inputs["response_mask"].bool()
    v = vpreds.detach()
    outside = (v - o).abs() > CLIP
    clipped_wins = ((v.clamp(o - CLIP, o + CLIP) - r) ** 2 > (v - r) ** 2) & outside
    assert clipped_wins[m].any()
    assert torch.all(vpreds.grad[clipped_wins & m] == 0)
    # elsewhere d/dv of 0.5 * (v - r)^2 / N
    free = m & ~clipped_wins & ~outside
    n = m.sum()
    torch.testing.assert_close(vpreds.grad[free], ((v - r) / n)[free])


def test_split_over_micro_batches_sums_to_the_whole():
    inputs = make_inputs(seed=2, rows=6)
    whole, _ = value_loss(**inputs, cliprange_value=CLIP, loss_agg_mode="seq-mean-token-mean")
    halves = [{k: t[s] for k, t in inputs.items()} for s in (slice(0, 4), slice(4, 6))]
    counts = sum(loss_counts(h["response_mask"]) for h in halves)
    parts = [value_loss(**h, cliprange_value=CLIP, loss_agg_mode="seq-mean-token-mean",
                        global_counts=counts)[0] for h in halves]
    assert float(sum(parts)) == pytest.approx(float(whole), rel=1e-6)


def test_rejects_mismatched_shapes():
    inputs = make_inputs()
    inputs["returns"] = inputs["returns"][:, :-1]
    with pytest.raises(ValueError, match="returns"):
        value_loss(**inputs, cliprange_value=CLIP)


def test_seq_mean_token_sum_norm_divides_by_the_constant():
    inputs = make_inputs(seed=3)
    norm_len = 16.0
    loss, _ = value_loss(**inputs, cliprange_value=CLIP, loss_agg_mode="seq-mean-token-sum-norm",
                         norm_len=norm_len)
    rows = [i for i in range(inputs["vpreds"].shape[0]) if inputs["response_mask"][i].sum() > 0]
    total = 0.0
    for i in rows:
        for t in range(inputs["vpreds"].shape[1]):
            if inputs["response_mask"][i, t]:
                v, o, r = (float(inputs[k][i, t]) for k in ("vpreds", "old_values", "returns"))
                vc = min(max(v, o - CLIP), o + CLIP)
                total += max((v - r) ** 2, (vc - r) ** 2)
    assert float(loss) == pytest.approx(0.5 * total / norm_len / len(rows), rel=1e-6)
