"""Every actor.policy_loss.loss_mode reaches its loss function through the update's
per-micro-batch loss, with the options of LossSettings (no engine needed)."""

from __future__ import annotations

import types

import pytest
import torch

from megarl.algo import (
    POLICY_LOSSES,
    SEQUENCE_LEVEL_LOSSES,
    aggregate_loss,
    loss_counts,
    policy_loss_options,
)
from megarl.megatron.update import LossSettings, _loss_terms


def _micro_batch(seed: int = 0, rows: int = 4, width: int = 9):
    """A fake micro-batch: packed log-probs [P] gathered into [rows, width]."""
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(width)[None] < torch.tensor([0, 9, 5, 7])[:, None]).float()
    mask[:, 0] = 0
    old = -torch.rand(rows, width, generator=g) * 2 - 0.05
    tensors = {"loss_mask": mask, "old_log_probs": old,
               "advantages": torch.randn(rows, 1, generator=g).expand(rows, width).clone(),
               "ref_log_probs": None, "rollout_is_weights": None}
    packed = (old + 0.3 * torch.randn(rows, width, generator=g)).clamp(max=-0.01).flatten()
    index = torch.arange(rows * width).view(rows, width)
    return types.SimpleNamespace(tensors=tensors, gather_index=index), packed


@pytest.mark.parametrize("loss_mode", sorted(POLICY_LOSSES))
def test_each_loss_mode_runs_with_its_options(loss_mode: str) -> None:
    mb, packed = _micro_batch()
    mask = mb.tensors["loss_mask"]
    agg_mode = ("seq-mean-token-mean" if loss_mode in SEQUENCE_LEVEL_LOSSES
                else "seq-mean-token-sum-norm")
    settings = LossSettings(loss_mode=loss_mode, loss_agg_mode=agg_mode, norm_len=16.0,
                            clip_cov_lb=-10.0, clip_cov_ub=10.0, kl_cov_ratio=0.1)
    log_probs = packed.clone().requires_grad_()
    loss, metrics = _loss_terms(mb, log_probs, torch.zeros_like(packed), settings,
                                loss_counts(mask))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(log_probs.grad).all()
    assert log_probs.grad.abs().sum() > 0
    if loss_mode != "clip_cov":  # clip_cov draws its tokens: checked in tests/algo
        expected, _ = POLICY_LOSSES[loss_mode](
            packed.view(mask.shape), mb.tensors["old_log_probs"], mb.tensors["advantages"], mask,
            **{name: getattr(settings, name) for name in policy_loss_options(loss_mode)})
        want = aggregate_loss(expected, mask, agg_mode, norm_len=16.0)
        assert metrics["pg_loss"].item() == pytest.approx(want.item(), rel=1e-6)
