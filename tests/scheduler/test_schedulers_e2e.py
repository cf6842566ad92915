"""The three schedulers on the real stack: Ray pools, a Megatron actor worker, an embedded
engine, SGLang-protocol weight sync, GRPO on the demo task.

Two trainers with the same seed (A and B, one Ray instance, one actor worker and one engine
each) are set up once for the module; B's engine decodes at most 4 rows at a time, so its
generation is slower than training and requests are in flight at every weight push. The tests
run in order on them:

1. A runs colocate_sync and B fully_async with staleness 0 and a push every step: every
   non-timing metric is equal (the known peer bug is that this silently runs one step off);
2. A runs one_step_off: samples are exactly one push old (the first step's are fresh);
3. B runs fully_async with staleness 1 and partial rollouts: no trained group's newest token is
   more than one push old, and partial samples carry the versions of their pieces;
4. A with dynamic sampling trains only on groups whose rewards differ.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from megarl.batch import StepBatch
from megarl.config import load_config
from megarl.config.schema import SchedulerConfig
from megarl.demo import DEMO_CONFIG, prepare_demo_assets
from megarl.scheduler import build_scheduler
from megarl.trainer import Trainer

STEPS = 3
SAMPLES = 16  # train_batch_size 4 x rollout.n 4
# timings differ between runs; the engine/trainer gap is noise from the engine's batching
NOISY = ("timing/", "throughput/", "perf/", "training/rollout_probs_diff", "rollout_corr/",
         "staleness/", "tq/",
         "fully_async/", "colocate_sync/", "one_step_off/")


def make_trainer(root: Path, out: Path, *overrides: str) -> Trainer:
    base = [f"model.path={root / 'model'}", f"data.train_files=[{root / 'data/train.parquet'}]",
            f"data.val_files=[{root / 'data/val.parquet'}]", f"trainer.output_dir={out}",
            "trainer.loggers=[jsonl]", "trainer.resume=never", f"trainer.total_steps={STEPS}",
            "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=2",
            "actor.ppo_micro_batch_size_per_gpu=8", "data.max_response_length=48",
            "resources.train_pool.gpus_per_node=1", "actor.parallel.ep=1",
            "reward.num_workers=0", "ray.num_cpus=4", "ray.address=local"]
    cfg, sources = load_config(str(DEMO_CONFIG), base + list(overrides))
    return Trainer(cfg, sources)


@pytest.fixture(scope="module")
def trainers(tmp_path_factory: pytest.TempPathFactory):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    root = tmp_path_factory.mktemp("assets")
    prepare_demo_assets(root)
    out = tmp_path_factory.mktemp("runs")
    a = make_trainer(root, out / "a", "scheduler.mode=colocate_sync")
    b = make_trainer(root, out / "b", "scheduler.mode=fully_async",
                     "scheduler.staleness_threshold=0", "scheduler.trigger_parameter_sync_step=1",
                     "rollout.max_num_seqs=4")
    try:
        a.setup()
        b.setup()
        yield a, b
    finally:
        b.close()
        a.close()


def observe_batches(trainer: Trainer) -> list[tuple[int, StepBatch]]:
    """Record (trainer weight_version, batch) of every train_on call (the real one runs)."""
    seen: list[tuple[int, StepBatch]] = []
    real = trainer.train_on

    def train_on(batch: StepBatch, metrics: dict[str, float]) -> None:
        seen.append((trainer.weight_version, batch))
        real(batch, metrics)

    trainer.train_on = train_on  # type: ignore[method-assign]
    return seen


def run_steps(trainer: Trainer, cfg: SchedulerConfig, steps: int,
              states: list | None = None) -> list[dict[str, float]]:
    """``steps`` steps of a scheduler; ``states`` collects (checkpoint_state, the loader's live
    position) after each step."""
    scheduler = build_scheduler(trainer, cfg)
    try:
        history = []
        for k in range(steps):
            history.append(scheduler.step(last=k == steps - 1))
            if states is not None:
                states.append((scheduler.checkpoint_state(), trainer.loader.state_dict()))
        scheduler.finish()
    finally:
        scheduler.close()
    return history


def test_fully_async_at_staleness_0_equals_colocate_sync(trainers):
    a, b = trainers
    sync_history, async_history = a.fit(), b.fit()
    compared = 0
    for step, (x, y) in enumerate(zip(sync_history, async_history), start=1):
        assert y["staleness/max"] == 0.0 and y["staleness/count_0"] == SAMPLES
        assert y["fully_async/count/stale_dropped"] == 0.0
        for key, value in x.items():
            if key.startswith(NOISY) or key not in y:
                continue
            assert math.isclose(value, y[key], rel_tol=1e-6, abs_tol=1e-9), (step, key, value,
                                                                             y[key])
            compared += 1
        assert y["rollout/weight_version"] == x["rollout/weight_version"] == step
    assert compared > 20 * STEPS
    # the policy moved, so an off-by-one schedule would have shown in these metrics
    assert sync_history[-1]["actor/grad_norm"] > 0
    assert a.run(a.workers.client.get_weight_version()) == [str(STEPS)]
    assert b.run(b.workers.client.get_weight_version()) == [str(STEPS)]


def test_one_step_off_samples_are_exactly_one_push_old(trainers):
    a, _ = trainers
    start, states = a.weight_version, []
    history = run_steps(a, SchedulerConfig(mode="one_step_off"), 4, states)
    first, rest = history[0], history[1:]
    assert first["staleness/max"] == 0.0 and first["staleness/count_0"] == SAMPLES
    assert "rollout/weight_version" not in first  # nothing to push before the first update
    for k, m in enumerate(rest, start=1):
        assert m["staleness/mean"] == 1.0 and m["staleness/count_1"] == SAMPLES
        assert m["staleness/count_0"] == 0.0
        assert m["rollout/weight_version"] == start + k  # one push per step
    assert a.weight_version == start + 4  # finish() pushed the last update
    assert a.run(a.workers.client.get_weight_version()) == [str(start + 4)]
    # the next step's samples were generated while this one trained
    assert sum(m["timing/wait_gen"] for m in rest) < sum(m["timing/gen"] for m in rest)
    # a checkpoint after a step resumes before the prefetched prompts, and pushes the update
    # the engines do not hold yet
    per_step = a.cfg.data.train_batch_size
    for saved, live in states[:-1]:
        assert saved["unsynced"] and saved["loader"]["epoch"] == live["epoch"]
        assert saved["loader"]["offset"] == live["offset"] - per_step
    assert states[-1][0]["loader"] == states[-1][1]  # the last step prefetched nothing


def test_fully_async_never_trains_on_groups_older_than_the_bound(trainers):
    _, b = trainers
    seen, states = observe_batches(b), []
    try:
        history = run_steps(b, SchedulerConfig(mode="fully_async", staleness_threshold=1,
                                               trigger_parameter_sync_step=1), 4, states)
    finally:
        del b.train_on
    assert len(seen) == 4
    partial, oldest = [], []
    for (version, batch), metrics in zip(seen, history):
        assert len(batch) == SAMPLES
        n = b.cfg.rollout.n
        for start in range(0, SAMPLES, n):
            newest = 0
            for s in batch.samples[start:start + n]:
                tokens = [int(v) for v in (s.token_weight_versions
                                           or [s.weight_version] * len(s.response_ids))]
                assert tokens == sorted(tokens) and max(tokens, default=0) <= version
                newest = max(newest, int(s.weight_version))
                oldest.append(version - min(tokens, default=int(s.weight_version)))
                if s.token_weight_versions is not None:
                    partial.append(tokens)
            assert version - newest <= 1, (version, newest)  # a group is as fresh as its newest
        # staleness/* reports each sample's oldest token
        assert metrics["staleness/max"] == max(oldest[-SAMPLES:])
    assert sum(m["fully_async/partial/count"] for m in history) == len(partial)
    assert any(len(set(p)) > 1 for p in partial), "no sample was resumed across a push"
    assert b.run(b.workers.client.get_weight_version()) == [str(b.weight_version)]
    # checkpoints resume at a batch boundary no later than the oldest untaken group: the
    # rollout had drawn prompts ahead of training, and those are generated again
    for saved, live in states:
        assert saved["unsynced"] is False  # a push after every step
        assert (saved["loader"]["epoch"], saved["loader"]["offset"]) <= (live["epoch"],
                                                                          live["offset"])
    assert any(s["loader"] != live for s, live in states), "the rollout never ran ahead"


@pytest.mark.parametrize("mode", ["fully_async", "colocate_sync", "one_step_off"])
def test_dynamic_sampling_trains_only_on_groups_with_reward_variance(trainers, mode):
    """Real engine and reward: every scheduler trains full batches of groups with spread."""
    a, _ = trainers
    filtering = a.cfg.algorithm.filter_groups
    seen = observe_batches(a)
    filtering.enable = True
    sched = (SchedulerConfig(mode=mode, staleness_threshold=1, trigger_parameter_sync_step=1)
             if mode == "fully_async" else SchedulerConfig(mode=mode))
    try:
        history = run_steps(a, sched, 2)
    finally:
        filtering.enable = False
        del a.train_on
    assert len(seen) == 2
    for (_, batch), metrics in zip(seen, history):
        assert len(batch.prompts) == a.cfg.data.train_batch_size
        if mode != "fully_async":
            assert metrics["train/num_gen_batches"] >= 1
        scores = batch.scores.view(-1, 4)
        assert torch.all(scores.max(dim=1).values > scores.min(dim=1).values), scores
        assert metrics["critic/score/mean"] == pytest.approx(float(batch.scores.mean()))
