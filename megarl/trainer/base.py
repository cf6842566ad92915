"""The trainer's state and plumbing: construction, setup (data, rewards, workers, trackers,
resume), the driver process, outputs and shutdown. :class:`~megarl.trainer.phases.StepPhases`
adds the phases of a step, :class:`~megarl.trainer.step.Trainer` the step itself."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megarl.algo import KLController, make_kl_controller
from megarl.config import RunConfig
from megarl.config.render import render_config
from megarl.config.validate_options import engines_start_without_weights
from megarl.faults import fail_point
from megarl.metrics.health import HealthMonitor, NonFiniteGuard, thresholds_for
from megarl.metrics.trackers import MultiTracker, TrackerSettings
from megarl.rollout.agent import AgentLoop, AgentSettings
from megarl.trainer.checkpoint import resume_run
from megarl.trainer.workers import Workers, build_workers, shutdown_workers


class TrainerBase:
    """The state of a run and what every part of the step uses: the config, the workers, the
    event loop of the rollout client, the driver."""

    def __init__(self, cfg: RunConfig, sources: dict[str, str] | None = None) -> None:
        self.cfg = cfg
        self.sources = sources or {}
        self.output_dir = Path(cfg.trainer.output_dir)
        self.loop = asyncio.new_event_loop()
        self.weight_version = 0
        self.steps_done = 0
        self.workers: Workers | None = None
        self.nonfinite = NonFiniteGuard(cfg.trainer.max_nonfinite_updates)
        ctrl = cfg.algorithm.kl_ctrl  # the in-reward KL coefficient; None when that KL is off
        self.kl_ctrl: KLController | None = make_kl_controller(
            ctrl.type, ctrl.kl_coef, ctrl.target_kl, ctrl.horizon) if (
            cfg.algorithm.use_kl_in_reward) else None

    def setup(self) -> None:
        """Start pools, workers and engines; load data; open trackers."""
        from megarl.data.dataset import load_prompt_dataset
        from megarl.data.loader import PromptLoader
        from megarl.reward import RewardManager

        cfg = self.cfg
        self.dataset = load_prompt_dataset(cfg.data.train_files, cfg.model.path,
                                           max_prompt_length=cfg.data.max_prompt_length,
                                           prompt_key=cfg.data.prompt_key,
                                           trust_remote_code=cfg.model.trust_remote_code)
        self.loader = PromptLoader(self.dataset, cfg.data.train_batch_size, seed=cfg.data.seed,
                                   shuffle=cfg.data.shuffle)
        self.tokenizer = self.dataset.tokenizer
        self.agent = make_agent_loop(cfg, self.tokenizer)
        if self.is_driver:  # outputs only once the inputs were read without error
            self.save_config()
        self.val_dataset = None
        if cfg.trainer.val_every:
            self.val_dataset = load_prompt_dataset(
                cfg.data.val_files, cfg.model.path, max_prompt_length=cfg.data.max_prompt_length,
                prompt_key=cfg.data.prompt_key, trust_remote_code=cfg.model.trust_remote_code)
        self.rewards = RewardManager(cfg.reward.function, batched=cfg.reward.batched,
                                     num_workers=cfg.reward.num_workers,
                                     timeout_s=cfg.reward.timeout_s,
                                     format_score=cfg.reward.format_score)
        self.workers = build_workers(cfg, self.output_dir)
        self.health = HealthMonitor(thresholds=thresholds_for(cfg.actor.clip_ratio_high,
                                                              cfg.rollout.quantization))
        resumed_step = resume_run(self)
        if resumed_step is None and engines_start_without_weights(cfg):
            self.workers.weight_sync(str(self.weight_version))  # their first weights
        loggers = cfg.trainer.loggers if self.is_driver else []
        self.tracker = MultiTracker.from_names(loggers, TrackerSettings(
            output_dir=self.output_dir, total_steps=cfg.trainer.total_steps,
            project_name=cfg.trainer.project_name, experiment_name=cfg.trainer.experiment_name,
            wandb_proxy=cfg.trainer.wandb_proxy, run_config=cfg.model_dump(mode="json"),
            resume_from_step=resumed_step or 0))  # a fresh run replaces old rows

    def save_config(self) -> Path:
        """Write the resolved config (secrets redacted) to ``<output_dir>/config.yaml``."""
        self.output_dir.mkdir(parents=True, exist_ok=True)
        path = self.output_dir / "config.yaml"
        path.write_text(render_config(self.cfg, self.sources))
        return path

    def close(self) -> None:
        """Stop workers and engines, close trackers."""
        if self.workers is not None:
            shutdown_workers(self.workers, self.loop)
            self.workers = None
        if getattr(self, "rewards", None) is not None:
            self.rewards.close()
        if getattr(self, "tracker", None) is not None:
            self.tracker.close()
        fail_point("after_close")  # a teardown that fails once everything is stopped

    def on_driver(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the driver. In the no-Ray mode every torchrun rank runs the trainer:
        rank 0 runs ``fn`` and the others receive its result, so all ranks see the same data."""
        if self.cfg.trainer.worker_group != "naive":
            return fn()
        import torch.distributed as dist

        box = [fn() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    @property
    def is_driver(self) -> bool:
        """Whether this process logs and writes outputs (always with Ray; rank 0 under
        torchrun)."""
        if self.cfg.trainer.worker_group != "naive":
            return True
        import torch.distributed as dist

        return dist.get_rank() == 0

    def run(self, coro: Any) -> Any:
        """Run a coroutine of the async rollout client on the trainer's event loop."""
        return self.loop.run_until_complete(coro)

    def warn(self, line: str) -> None:
        """A one-line warning on the trackers (stderr before they are open)."""
        tracker = getattr(self, "tracker", None)
        if tracker is not None:
            tracker.warn(line)
        else:
            print(f"warning: {line}", file=sys.stderr)

    def finish(self) -> None:
        """End of run (also after a failed step): the PNG of the run's metrics and the Ray
        timeline."""
        if not self.is_driver:
            return
        from megarl.metrics.plot import plot_run

        jsonl = self.output_dir / "metrics.jsonl"
        if jsonl.exists():
            png = plot_run(jsonl, self.output_dir / "run.png")
            print(f"megarl: metrics in {jsonl}, plot in {png}")
        if self.cfg.ray.timeline_file and self.cfg.trainer.worker_group == "ray":
            from megarl.cluster import write_timeline

            write_timeline(self.cfg.ray.timeline_file)


def make_agent_loop(cfg: RunConfig, tokenizer: Any) -> AgentLoop | None:
    """The agent loop of ``rollout.multi_turn`` (None when it is off)."""
    mt = cfg.rollout.multi_turn
    if not mt.enable:
        return None
    settings = AgentSettings(max_assistant_turns=mt.max_assistant_turns,
                             max_user_turns=mt.max_user_turns,
                             max_tokens_per_turn=mt.max_tokens_per_turn,
                             max_response_length=cfg.data.max_response_length, format=mt.format)
    return AgentLoop(settings, tokenizer, tools=mt.tools, env=mt.env,
                     max_tool_response_length=mt.max_tool_response_length)
