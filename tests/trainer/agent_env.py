"""An environment for the multi-turn trainer test (importable as ``agent_env:make_env`` with
this folder on PYTHONPATH): it answers every model turn with a short observation and ends the
episode after its third answer, rewarding turns that contain a digit."""

from __future__ import annotations

from typing import Any

from megarl.rollout.agent import StepResult


class DigitEnv:
    """Three model turns per episode; reward 1/3 per turn with a digit in it."""

    def __init__(self) -> None:
        self.steps = 0

    async def step(self, action: str) -> StepResult:
        self.steps += 1
        reward = sum(c.isdigit() for c in action) > 0
        return StepResult("7", reward=reward / 3, done=self.steps >= 3,
                          info={"tool_calls": 1.0})


def make_env(row: dict[str, Any]) -> DigitEnv:
    """A fresh environment per episode."""
    return DigitEnv()
