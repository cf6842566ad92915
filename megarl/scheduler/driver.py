"""What a scheduler drives: the parts of the trainer it calls, as a Protocol.

The schedulers decide what overlaps; the step itself is the trainer's. They see the trainer only
through :class:`StepDriver` (which :class:`megarl.trainer.Trainer` satisfies), so the scheduler
package does not import the trainer module, which imports the schedulers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from megarl.batch import StepBatch
    from megarl.config.schema import RunConfig
    from megarl.rollout.interface import RolloutSample, SamplingParams


class PromptSource(Protocol):
    """The trainer's prompt loader: batches of prompt rows, and a position to resume from."""

    def next_batch(self) -> list[dict[str, Any]]:
        """The next ``data.train_batch_size`` prompt rows."""

    def state_dict(self) -> dict[str, int]:
        """The position after the prompts drawn so far."""


class StepDriver(Protocol):
    """The trainer as the schedulers use it: one step written once, in parts."""

    cfg: RunConfig
    loader: PromptSource
    workers: Any
    """The running workers (``workers.client`` reaches the rollout engines)."""
    weight_version: int
    """Version of the weights the engines hold."""
    steps_done: int

    def step(self, prompts: list[dict[str, Any]]) -> dict[str, float]:
        """One whole step (generate, train, push weights) on ``prompts``; its metrics."""

    async def rollout(self, client: Any, prompts: list[dict[str, Any]],
                      step_index: int) -> list[RolloutSample]:
        """The samples of step ``step_index``'s prompts, generated through ``client``."""

    def train_on(self, batch: StepBatch, metrics: dict[str, float]) -> None:
        """Score, recompute log-probs, compute advantages and update on ``batch``."""

    def end_step(self, batch: StepBatch, metrics: dict[str, float], start: float) -> None:
        """Count the step and log its metrics."""

    def score(self, batch: StepBatch) -> dict[str, float]:
        """Rewards of every sample of ``batch``; the reward metrics."""

    def sync_weights(self) -> dict[str, float]:
        """Push the actor's weights to the engines as the next weight version."""

    def sampling_params(self) -> SamplingParams:
        """Sampling parameters of a step's generation."""

    def generation_options(self) -> dict[str, bool]:
        """What the engines return with each sample."""

    def prompt_seeds(self, step_index: int, count: int) -> list[int]:
        """Sampling seeds of a step's ``count`` prompts."""
