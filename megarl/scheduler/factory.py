"""The scheduler of ``scheduler.mode``: the factory, apart from the base its schedulers import
(:mod:`megarl.scheduler.base`), so that no module imports one that imports it back."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from megarl.config.schema import SchedulerConfig
from megarl.scheduler.base import ColocateSync, Scheduler

if TYPE_CHECKING:
    from megarl.scheduler.driver import StepDriver


def default_client_factory(trainer: StepDriver) -> Callable[[], Any]:
    """A new rollout client to the trainer's engines, for a scheduler's own event loop."""
    from megarl.rollout.sglang import SGLangClient

    cfg, client = trainer.cfg, trainer.workers.client

    def make() -> SGLangClient:  # naming the adapter the trainer's client names (adapter sync)
        return SGLangClient(client.urls, router_url=client.router_url,
                            timeout_s=cfg.trainer.phase_timeout_s, api_key=cfg.rollout.api_key,
                            adapter=client.adapter,
                            max_concurrency_per_engine=client.max_concurrency_per_engine)

    return make


def build_scheduler(trainer: StepDriver, cfg: SchedulerConfig,
                    make_client: Callable[[], Any] | None = None) -> Scheduler:
    """The scheduler of ``cfg.mode`` on a set-up trainer; ``make_client`` builds the rollout
    client of the overlapping schedulers (default: one like the trainer's)."""
    if cfg.mode == "colocate_sync":
        return ColocateSync(trainer)
    if trainer.cfg.trainer.worker_group == "naive":
        raise ValueError(f"scheduler.mode={cfg.mode} runs generation on a background thread "
                         "next to Ray workers; the no-Ray mode (trainer.worker_group=naive) "
                         "runs colocate_sync only: set trainer.worker_group=ray or "
                         "scheduler.mode=colocate_sync")
    make_client = make_client or default_client_factory(trainer)
    if cfg.mode == "one_step_off":
        from megarl.scheduler.one_step_off import OneStepOff

        return OneStepOff(trainer, make_client)
    if cfg.mode == "fully_async":
        from megarl.scheduler.fully_async import FullyAsync

        return FullyAsync(trainer, cfg, make_client)
    raise ValueError(f"scheduler.mode: unknown mode {cfg.mode!r}; use colocate_sync, "
                     "one_step_off or fully_async")
