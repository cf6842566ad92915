"""Rewards: rule-based scorers (synthetic tasks, math) and the batched reward manager."""

from megarl.reward.manager import RewardError, RewardManager, RewardResult, RewardSample

__all__ = ["RewardError", "RewardManager", "RewardResult", "RewardSample"]
