"""PITFALLS T5: a non-finite loss or gradient skips the update with a warning naming the step and
the batch; ``trainer.max_nonfinite_updates`` skipped updates in a row stop the run."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from megarl.config import load_config_dict
from megarl.metrics.health import NonFiniteGuard, NonFiniteUpdates
from megarl.trainer import Trainer
from tests.trainer.test_kl_in_reward import BASE, fake_batch

PROMPTS = [{"raw_prompt": [{"role": "user", "content": "What is 2+2?"}]},
           {"raw_prompt": [{"role": "user", "content": "x" * 200}]}]


def test_guard_stops_at_the_limit_naming_step_and_prompts() -> None:
    guard = NonFiniteGuard(limit=3)
    expected = ("step 4: update skipped (non-finite loss or gradient), 1 in a row; the batch's "
                f"first prompts: 'What is 2+2?', {'x' * 60!r}")
    assert guard.observe([0.0, 1.0], 4, PROMPTS) == [expected]
    assert len(guard.observe([1.0], 5, PROMPTS)) == 1
    with pytest.raises(NonFiniteUpdates) as err:
        guard.observe([1.0, 1.0], 6, PROMPTS)
    text = str(err.value)
    assert text.startswith("step 6: 3 updates in a row had a non-finite loss or gradient; the "
                           "batch's first prompts: 'What is 2+2?'")
    for knob in ("actor.optim.lr", "T4", "actor.grad_clip", "trainer.max_nonfinite_updates"):
        assert knob in text


def test_a_finite_update_resets_the_count_and_zero_never_stops() -> None:
    guard = NonFiniteGuard(limit=2)
    guard.observe([1.0, 0.0, 1.0], 1, PROMPTS)
    guard.observe([0.0], 2, PROMPTS)
    assert guard.in_a_row == 0
    never = NonFiniteGuard(limit=0)
    assert len(never.observe([1.0] * 50, 1, PROMPTS)) == 50


def _trainer_with_updates(flags: list[list[float]], *overrides: str) -> Trainer:
    """A Trainer whose fake actor reports the given ``actor/update_skipped`` per call."""
    cfg, sources = load_config_dict(BASE, list(overrides))
    trainer = Trainer(cfg, sources)
    calls = iter(flags)

    def execute_rank_split(method: str, per_rank: list[Any]) -> list[list[dict[str, float]]]:
        return [[{"actor/update_skipped": f, "actor/pg_loss": 0.0} for f in next(calls)]]

    actor = SimpleNamespace(world_size=1, execute_rank_split=execute_rank_split)
    trainer.workers = SimpleNamespace(actor=actor, dp_size=1, dp_rank=[0])
    trainer.warnings = []
    trainer.warn = trainer.warnings.append  # type: ignore[method-assign]
    return trainer


def _batch() -> Any:
    batch = fake_batch()
    batch.prompts = PROMPTS
    batch.advantages = torch.zeros(len(batch), 6)
    batch.loss_mask = batch.response_mask()
    return batch


def test_update_actor_stops_after_the_configured_number_in_a_row() -> None:
    trainer = _trainer_with_updates([[1.0], [1.0]], "trainer.max_nonfinite_updates=2")
    trainer.update_actor(_batch())
    assert trainer.warnings and trainer.warnings[0].startswith("step 1: update skipped")
    trainer.steps_done = 1
    with pytest.raises(NonFiniteUpdates, match="^step 2: 2 updates in a row"):
        trainer.update_actor(_batch())


def test_default_limit_is_three() -> None:
    trainer = _trainer_with_updates([[1.0, 1.0], [0.0], [1.0, 1.0]])
    assert trainer.cfg.trainer.max_nonfinite_updates == 3
    for _ in range(3):
        trainer.update_actor(_batch())
    assert len(trainer.warnings) == 4


def test_the_count_survives_a_checkpoint(tmp_path) -> None:
    from megarl.trainer.checkpoint import resume_run, save_run_checkpoint

    saved: dict[str, Any] = {}

    def save(method: str, path: str, step: int, extra: dict, keep: int,
             background: bool) -> Any:
        assert method == "save_checkpoint" and not background  # trainer.async_save defaults off
        saved.update(extra)
        return SimpleNamespace(get=lambda phase: [path])

    def fake_workers() -> Any:
        actor = SimpleNamespace(
            execute_all_async=save,
            execute_all=lambda name, path: [{"extra": saved, "step": 3, "path": path}])
        return SimpleNamespace(critic=None, actor=actor, weight_sync=lambda version: {})

    first = _trainer_with_updates([[1.0, 1.0]], f"trainer.output_dir={tmp_path}")
    first.update_actor(_batch())
    first.workers, first.steps_done = fake_workers(), 3
    first.scheduler = SimpleNamespace(checkpoint_state=lambda: {"loader": {}, "unsynced": False})
    first.health = SimpleNamespace(state_dict=dict)
    save_run_checkpoint(first)
    cfg, sources = load_config_dict(BASE, ["trainer.resume=/ckpt",
                                           f"trainer.output_dir={tmp_path}"])
    second = Trainer(cfg, sources)
    second.workers = fake_workers()
    second.loader = SimpleNamespace(load_state_dict=lambda state: None)
    second.health = SimpleNamespace(load_state_dict=lambda state: None)
    assert resume_run(second) == 3 and second.nonfinite.in_a_row == 2
