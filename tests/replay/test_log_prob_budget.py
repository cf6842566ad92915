"""The old-log-prob forward packs by its own budget (``actor.log_prob_micro_batch_size_per_gpu``,
issue 20): the worker hands it to the forward, and other packing gives the same log-probs."""

from __future__ import annotations

import torch
from replay_ranks import log_prob_budgets

from megarl.megatron.parallel import ParallelSizes


def test_old_log_probs_use_their_own_micro_batch_budget(pool2, moe_dir):
    gen = torch.Generator().manual_seed(3)
    sequences = [torch.randint(5, 128, (int(n),), generator=gen).tolist()
                 for n in torch.randint(10, 30, (6,), generator=gen)]
    result = pool2.run(log_prob_budgets, moe_dir, ParallelSizes(), sequences)[0]
    assert result["budgets"] == [96, 40]
    for default, own in zip(result["default"], result["own"], strict=True):
        torch.testing.assert_close(torch.tensor(own), torch.tensor(default), atol=1e-5, rtol=0)
