"""The data of one RL step: generated samples and what the step adds to them.

A :class:`StepBatch` holds the samples of a step in prompt-major order (``n`` consecutive
samples per prompt) and, as the step proceeds, their rewards, advantages and log-probs. Helpers
here turn the ragged per-sample lists into padded ``[B, T]`` response tensors for the pure
functions of ``megarl.algo`` and back, and cut the batch into data-parallel shares.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from megarl.rollout.interface import RolloutSample


def pad_responses(values: Sequence[Sequence[float]], width: int) -> torch.Tensor:
    """Right-pad ragged per-response values into a float32 ``[B, width]`` tensor."""
    out = torch.zeros(len(values), width, dtype=torch.float32)
    for i, row in enumerate(values):
        if len(row):
            out[i, : len(row)] = torch.as_tensor(list(row), dtype=torch.float32)
    return out


def even_shares(count: int, parts: int) -> list[range]:
    """Split ``range(count)`` into ``parts`` contiguous ranges whose sizes differ by at most 1."""
    base, extra = divmod(count, parts)
    shares, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        shares.append(range(start, start + size))
        start += size
    return shares


@dataclass
class StepBatch:
    """The samples of one step and the per-sample values computed from them."""

    samples: list[RolloutSample]
    prompts: list[dict[str, Any]]
    """The prompt rows the samples answer (``samples[i]`` answers ``prompts[i // n]``)."""
    n: int
    scores: torch.Tensor | None = None
    """``[B]`` reward of each sample."""
    advantages: torch.Tensor | None = None
    """``[B, T]`` per response token."""
    old_log_probs: list[list[float]] = field(default_factory=list)
    """Per sample, trainer log-probs of its response tokens."""
    ref_log_probs: list[list[float]] | None = None
    rollout_is_weights: torch.Tensor | None = None
    """``[B, T]`` rollout-correction weights (None when off)."""
    loss_mask: torch.Tensor | None = None
    """``[B, T]`` response tokens that are trained on (after rejection sampling)."""
    replay_routes: list[torch.Tensor] | None = None
    """Per sample, int16 ``[L_i (or L_i - 1), moe_layers, top_k]`` experts the update routes
    each token of ``sequences()[i]`` to (router replay R2/R3; -1 rows route natively)."""

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def width(self) -> int:
        """Longest response."""
        return max((len(s.response_ids) for s in self.samples), default=0)

    def sequences(self) -> list[list[int]]:
        """Prompt + response token ids of each sample."""
        return [list(s.prompt_ids) + list(s.response_ids) for s in self.samples]

    def response_mask(self) -> torch.Tensor:
        """``[B, T]`` 1 on each sample's response tokens that the model generated; environment
        tokens of a multi-turn episode (``RolloutSample.response_mask`` 0) are 0, so they never
        count in the loss, entropy, KL, advantages or rollout-correction metrics."""
        return pad_responses([[1.0] * len(s.response_ids) if s.response_mask is None
                              else [float(m) for m in s.response_mask] for s in self.samples],
                             max(self.width, 1))

    def group_index(self) -> list[int]:
        """The prompt each sample answers (the GRPO group label)."""
        return [i // self.n for i in range(len(self.samples))]

    def rollout_log_probs(self) -> torch.Tensor:
        """``[B, T]`` the engine's log-probs of the response tokens."""
        return pad_responses([s.log_probs or [0.0] * len(s.response_ids) for s in self.samples],
                             max(self.width, 1))

    def engine_routes(self) -> list[torch.Tensor]:
        """Per sample, int16 ``[L_i - 1, moe_layers, top_k]``: the rollout engine's experts for
        each token of ``sequences()[i]`` but the last (which the engine never fed back). Rows
        the engine did not return (a prompt prefix skipped by ``routed_experts_start_len``)
        are -1."""
        out = []
        for i, s in enumerate(self.samples):
            fed = len(s.prompt_ids) + len(s.response_ids) - 1
            routes = s.routed_experts
            if routes is None:
                raise ValueError(f"sample {i} has no routed experts; the engines must return them "
                                 "(rollout.enable_return_routed_experts=true)")
            if routes.dim() != 3 or len(routes) > fed:
                raise ValueError(f"sample {i}: routed experts of shape {tuple(routes.shape)} for "
                                 f"{fed} fed tokens; expected [<= {fed}, moe_layers, top_k]")
            missing = routes.new_full((fed - len(routes), *routes.shape[1:]), -1)
            out.append(torch.cat([missing, routes]).to(torch.int16))
        return out

    def padded(self, per_sample: Sequence[Sequence[float]]) -> torch.Tensor:
        """``[B, T]`` tensor of ragged per-response values."""
        return pad_responses(per_sample, max(self.width, 1))

    def response_slice(self, full: Sequence[float], i: int) -> list[float]:
        """The response part of a per-token list aligned with ``sequences()[i]``."""
        start = len(self.samples[i].prompt_ids)
        return list(full[start:start + len(self.samples[i].response_ids)])

    def train_record(self, i: int) -> dict[str, Any]:
        """Sample ``i`` as the actor's update expects it: per-token lists over prompt+response
        (entry ``j`` concerns token ``j``; prompt entries are masked out)."""
        sample = self.samples[i]
        p, r = len(sample.prompt_ids), len(sample.response_ids)

        def full(row: torch.Tensor | Sequence[float]) -> list[float]:
            values = row[:r].tolist() if isinstance(row, torch.Tensor) else list(row[:r])
            return [0.0] * p + values

        assert self.advantages is not None and self.loss_mask is not None
        record = {
            "tokens": list(sample.prompt_ids) + list(sample.response_ids),
            "loss_mask": full(self.loss_mask[i]),
            "old_log_probs": full(self.old_log_probs[i]),
            "advantages": full(self.advantages[i]),
        }
        if self.ref_log_probs is not None:
            record["ref_log_probs"] = full(self.ref_log_probs[i])
        if self.rollout_is_weights is not None:
            record["rollout_is_weights"] = full(self.rollout_is_weights[i])
        if self.replay_routes is not None:
            record["routes"] = self.replay_routes[i]
        return record
