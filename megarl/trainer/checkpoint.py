"""Checkpoints of a whole run: save every ``trainer.save_every`` steps, resume after a crash.

A checkpoint is one directory ``<trainer.output_dir>/checkpoints/step_XXXXXXXX`` written by the
actor ranks together (:func:`megarl.megatron.checkpoint.save_checkpoint`: model, optimizer,
LR schedule, RNG states of every rank; written under a temporary name and published by a rename,
with the ``latest`` pointer updated last, older ones rotated by ``trainer.keep_last``). With
``trainer.async_save`` the actor's files are written in the background while the next step
generates; :func:`publish_checkpoint` publishes them at the start of that step's training (a
crash before that resumes from the checkpoint before). The critic (with gae) is saved the same
way under ``checkpoints/critic/``, before the actor, always at once. The
trainer's own state rides along in it: the prompt loader's position, the step, the engines'
``weight_version``, the health monitor's history, the in-reward KL coefficient (the adaptive
controller's beta) and the resolved config.

What is re-generated on resume: nothing is in flight at a colocate_sync checkpoint (it is taken
after a step's weights were synced), so the resumed run starts the next step from the saved
loader position. The asynchronous schedulers save the position before the prompts they had
drawn but not trained on (:meth:`megarl.scheduler.base.Scheduler.checkpoint_state`), so those
are generated again — none is lost. The rollout engines, which start from the HF weights, first
receive the checkpoint's weights under its ``weight_version`` (the next version when the actor
was one update ahead of them). With deterministic settings (CPU, fp32, the
per-prompt sampling seeds) the resumed run's per-step metrics equal an uninterrupted run's.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from megarl.config.render import render_config
from megarl.faults import crash_point

if TYPE_CHECKING:
    from megarl.algo import KLController
    from megarl.config import RunConfig
    from megarl.metrics.health import HealthMonitor, NonFiniteGuard


class RunState(Protocol):
    """What a checkpoint holds and a resume restores, and the workers that write and read it
    (the trainer is one; these functions see nothing else of it)."""

    cfg: RunConfig
    sources: dict[str, str]
    """Where each config value came from (the saved config names them)."""
    workers: Any
    """The running workers: ``actor`` and ``critic`` save and load, ``weight_sync`` pushes."""
    scheduler: Any
    """The running scheduler (:meth:`megarl.scheduler.base.Scheduler.checkpoint_state`)."""
    loader: Any
    """The prompt loader (``state_dict`` / ``load_state_dict``)."""
    steps_done: int
    weight_version: int
    health: HealthMonitor
    nonfinite: NonFiniteGuard
    kl_ctrl: KLController | None
    is_driver: bool


def checkpoint_root(run: RunState) -> Path:
    """Where the run's checkpoints go."""
    return Path(run.cfg.trainer.output_dir) / "checkpoints"


def save_due(run: RunState) -> bool:
    """Whether the step just finished is a checkpoint step (every ``save_every``, and the last
    step of the run unless saving is off with ``save_every=0`` and ``resume=never``)."""
    cfg = run.cfg.trainer
    step = run.steps_done
    if cfg.save_every and step % cfg.save_every == 0:
        return True
    return step == cfg.total_steps and (cfg.save_every > 0 or cfg.resume != "never")


def save_run_checkpoint(run: RunState) -> dict[str, float]:
    """Save the actor and the trainer's state after ``run.steps_done`` steps (after
    publishing a background save still pending); returns ``timing/save_blocking``, the seconds
    the loop was held up. With ``trainer.async_save`` the actor's files are still being written
    when this returns: :func:`publish_checkpoint` publishes them."""
    start = time.perf_counter()
    publish_checkpoint(run)
    state = run.scheduler.checkpoint_state()
    extra: dict[str, Any] = {
        "loader": state["loader"],
        "unsynced": state["unsynced"],
        "weight_version": run.weight_version,
        "health": run.health.state_dict(),
        "nonfinite_in_a_row": run.nonfinite.in_a_row,
        "kl_ctrl": None if run.kl_ctrl is None else run.kl_ctrl.state_dict(),
        "config": render_config(run.cfg, run.sources),
    }
    step, keep_last = run.steps_done, run.cfg.trainer.keep_last
    background = run.cfg.trainer.async_save
    root = checkpoint_root(run)
    critic = run.workers.critic
    if critic is not None:
        # the critic first: the actor's checkpoint (and its `latest`) marks the step complete.
        # It keeps one more: a crash between the two saves leaves the actor's previous step as
        # `latest`, and a resume from it needs that step's critic
        critic.group.execute_all("save_checkpoint", str(root / "critic"), step, {},
                                 None if keep_last is None else keep_last + 1)
    pending = run.workers.actor.execute_all_async("save_checkpoint", str(root), step, extra,
                                                      keep_last, background)
    crash_point("save", step)
    pending.get(phase="save")
    return {"timing/save_blocking": time.perf_counter() - start}


def publish_checkpoint(run: RunState) -> dict[str, float]:
    """Wait for the actor's background save, if one is pending, and publish it (``latest``
    moves to it); returns the seconds waited as ``timing/save_blocking`` (empty when nothing
    was pending). The trainer calls it at the start of each step's training and at the end of
    the run, so where ``latest`` stands after a crash depends on the step's phase only."""
    if not run.cfg.trainer.async_save:
        return {}
    start = time.perf_counter()
    published = run.workers.actor.execute_all("finish_checkpoint")[0]
    return {} if published is None else {"timing/save_blocking": time.perf_counter() - start}


def resume_path(run: RunState) -> str | None:
    """The checkpoint ``trainer.resume`` selects, or None to start fresh."""
    from megarl.megatron.checkpoint_dirs import latest_checkpoint

    choice = run.cfg.trainer.resume
    if choice == "never":
        return None
    if choice == "auto":
        latest = latest_checkpoint(checkpoint_root(run))
        return None if latest is None else str(latest)
    return choice


def resume_run(run: RunState) -> int | None:
    """Load the selected checkpoint into the actor ranks and the trainer, and push its weights
    to the engines; returns the step resumed after (None when starting fresh)."""
    path = resume_path(run)
    if path is None:
        return None
    info = run.workers.actor.execute_all("load_checkpoint", path)[0]
    extra = info["extra"]
    if run.workers.critic is not None:
        critic_path = Path(info["path"]).parent / "critic" / Path(info["path"]).name
        run.workers.critic.group.execute_all("load_checkpoint", str(critic_path))
    run.loader.load_state_dict(extra["loader"])
    run.health.load_state_dict(extra["health"])
    run.nonfinite.in_a_row = int(extra.get("nonfinite_in_a_row", 0))
    if run.kl_ctrl is not None and extra.get("kl_ctrl"):
        run.kl_ctrl.load_state_dict(extra["kl_ctrl"])
    run.steps_done = int(info["step"])
    # the actor may be one update ahead of the engines (one_step_off, fully_async): the push
    # below is then that update's
    run.weight_version = int(extra["weight_version"]) + int(extra.get("unsynced", False))
    run.workers.weight_sync(str(run.weight_version))
    if run.is_driver:
        print(f"megarl: resumed from {info['path']} (step {run.steps_done}, weight_version "
              f"{run.weight_version})", flush=True)
    return run.steps_done
