"""The real stack end to end: Ray pools, Megatron actor workers (EP=2), an embedded rollout
engine over HTTP, SGLang-protocol weight sync, GRPO. Slow-ish (a Ray start and a few steps)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import httpx
import pytest
import torch
from trainer_runs import first_and_last_fifth, fit

from megarl.config import load_config
from megarl.demo import DEMO_CONFIG
from megarl.metrics.health import HealthThresholds, default_alarms
from megarl.trainer import Trainer

REQUIRED = [
    "critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/pg_clipfrac",
    "actor/ppo_kl", "actor/entropy", "actor/grad_norm", "actor/lr", "timing/gen",
    "timing/old_log_prob", "timing/adv", "timing/update_actor", "timing/sync_weights",
    "timing/step", "throughput/total_tokens_per_sec", "throughput/gen_tokens_per_sec_per_gpu",
    "throughput/train_tokens_per_sec_per_gpu", "training/rollout_probs_diff_mean",
    "training/rollout_probs_diff_max",
]

pytestmark = pytest.mark.usefixtures("private_ray")


@pytest.fixture(scope="module")
def assets(demo_assets) -> Path:
    return demo_assets


def make_trainer(root: Path, out: Path, *overrides: str) -> Trainer:
    base = [f"model.path={root / 'model'}", f"data.train_files=[{root / 'data/train.parquet'}]",
            f"data.val_files=[{root / 'data/val.parquet'}]", f"trainer.output_dir={out}",
            "trainer.loggers=[jsonl]"]
    cfg, sources = load_config(str(DEMO_CONFIG), base + list(overrides))
    return Trainer(cfg, sources)


def engine_weights(trainer: Trainer, names: list[str]) -> dict[str, torch.Tensor]:
    client = trainer.workers.client
    out = {}
    for name in names:
        per_engine = trainer.run(client.get_weights_by_name(name, truncate_size=10**9))
        out[name] = torch.tensor(per_engine[0], dtype=torch.float32)
    return out


def test_three_steps_sync_weights_report_every_metric_and_penalise_kl(assets, tmp_path):
    """Three steps with ``algorithm.use_kl_in_reward`` (adaptive): after every sync each tensor
    on the engine equals the trainer's export, every metric is there and finite; the reference
    forward runs before the advantages and the penalty is logged, and after the first update
    the policy has moved, so the KL is > 0 and the adaptive controller moves the coefficient.
    The engine starts with ``rollout.load_format=dummy`` (random weights, no checkpoint read):
    the trainer's first sync gives it the actor's, so step 1 already scores as the actor does."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    trainer = make_trainer(assets, tmp_path / "run", "trainer.total_steps=3",
                           "data.train_batch_size=8", "rollout.n=4",
                           "actor.ppo_mini_batch_size=4", "trainer.val_every=1",
                           "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive",
                           "algorithm.kl_ctrl.kl_coef=0.1", "rollout.load_format=dummy",
                           f"ray.timeline_file={tmp_path / 'timeline.json'}")
    history = []
    try:
        trainer.setup()
        assert trainer.cfg.ref.enabled
        for url in trainer.workers.client.urls:
            assert httpx.get(url + "/get_server_info").json()["load_format"] == "dummy"
        for step in range(1, 4):
            metrics = trainer.step(trainer.loader.next_batch())
            history.append(metrics)
            missing = [k for k in REQUIRED if k not in metrics]
            assert not missing, missing
            # every metric a health alarm watches is one the trainer logs (the KL loss is off)
            watched = {m for alarm in default_alarms(HealthThresholds()) for m in alarm.metrics}
            assert watched - set(metrics) == {"actor/kl_loss"}, watched - set(metrics)
            bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
            assert not bad, bad
            assert metrics["training/rollout_probs_diff_mean"] < 1e-3
            assert metrics["rollout/weight_version"] == step
            # after the sync, every tensor on the engine equals the trainer's export
            actor = trainer.workers.actor.execute_all("hf_state_dict")[0]
            names = list(actor)
            on_engine = engine_weights(trainer, names)
            for name in names:
                assert torch.equal(on_engine[name].reshape(-1),
                                   actor[name].float().reshape(-1)[: on_engine[name].numel()]), name
            assert trainer.run(trainer.workers.client.get_weight_version()) == [str(step)]
        # two mini-batches per step: the second one is off-policy, so ppo_kl is not exactly 0
        assert metrics["actor/ppo_kl"] != 0.0
        val = trainer.validate()
        assert 0.0 <= val["val/score/mean"] <= 1.0
        assert val["val/synthetic/copy_digit/score/mean"] == val["val/score/mean"]
        trainer.finish()
        assert (tmp_path / "timeline.json").stat().st_size > 0
    finally:
        trainer.close()
    assert history[0]["actor/reward_kl_penalty_coeff"] == 0.1
    assert history[1]["actor/reward_kl_penalty"] > 0
    assert history[1]["actor/reward_kl_penalty_coeff"] != 0.1  # the adaptive controller moved
    for metrics in history:
        assert math.isfinite(metrics["actor/reward_kl_penalty"])


@pytest.mark.parametrize("fp8_attention", [True, False])
def test_fp8_rollout_engine_holds_the_quantized_actor_and_the_mismatch_is_corrected(
        assets, tmp_path, fp8_attention):
    """``rollout.quantization=fp8`` on the embedded engine: rollout correction turns on by
    default (token-level TIS); after each sync the engine holds exactly the blockwise FP8
    quantization of the actor's export (weights and ``weight_scale_inv``) and every other
    tensor as exported; the engine's FP8 log-probs differ from the fp32 trainer's, by less than
    the health monitor's FP8 baseline, and the IS weights see that difference. With
    ``rollout.fp8_attention=false`` the attention projections arrive and stay as exported."""
    from megarl.weights.fp8 import fp8_payload, ignored_modules

    trainer = make_trainer(assets, tmp_path / "fp8", "trainer.total_steps=2",
                           "data.train_batch_size=8", "rollout.n=4",
                           "actor.ppo_mini_batch_size=8", "rollout.quantization=fp8",
                           f"rollout.fp8_attention={str(fp8_attention).lower()}")
    ignored = ignored_modules(fp8_attention)
    try:
        trainer.setup()
        assert trainer.cfg.algorithm.rollout_correction.rollout_is == "token"
        assert trainer.health.thresholds.rollout_precision == "fp8 rollout"
        for step in (1, 2):
            metrics = trainer.step(trainer.loader.next_batch())
            assert 1e-6 < metrics["training/rollout_probs_diff_mean"] < \
                trainer.health.thresholds.rollout_probs_diff_max, metrics
            assert metrics["rollout_corr/rollout_is_std"] > 0  # the weights are not all 1
            assert metrics["rollout_corr/rollout_is_max"] != 1.0
            actor = trainer.workers.actor.execute_all("hf_state_dict")[0]
            expected = {name: tensor.float()
                        for name, tensor in fp8_payload(actor, ignored).items()}
            assert sum(n.endswith("_scale_inv") for n in expected) >= 8
            scaled_attention = any("self_attn" in n and n.endswith("_scale_inv")
                                   for n in expected)
            assert scaled_attention == fp8_attention
            on_engine = engine_weights(trainer, list(expected))
            for name, tensor in expected.items():
                assert torch.equal(on_engine[name].reshape(tensor.shape), tensor), name
            assert trainer.run(trainer.workers.client.get_weight_version()) == [str(step)]
    finally:
        trainer.close()


def test_grpo_reward_climbs_on_the_demo_task(assets, tmp_path):
    """A shorter demo run (same config): the reward of the last 20% of steps clearly exceeds the
    first 20%'s (about 0.06 -> 0.30 in 30 steps; the demo's 50 reach about 0.6)."""
    steps = 30
    history = fit(make_trainer(assets, tmp_path / "learn", f"trainer.total_steps={steps}"))
    assert len(history) == steps
    first, last = first_and_last_fifth(history, "critic/score/mean")
    assert last > first + 0.15, (first, last, [m["critic/score/mean"] for m in history])
    assert (tmp_path / "learn" / "run.png").stat().st_size > 10_000


def test_settings_the_trainer_does_not_run_yet_are_refused(assets, tmp_path, capsys):
    from megarl.trainer import train_main

    base = [f"model.path={assets / 'model'}", f"data.train_files=[{assets / 'data/train.parquet'}]",
            f"data.val_files=[{assets / 'data/val.parquet'}]", f"trainer.output_dir={tmp_path}"]
    assert train_main(["--config", str(DEMO_CONFIG), *base,
                       "algorithm.filter_groups.enable=true",
                       "algorithm.filter_groups.metric=acc"]) == 2
    assert ("algorithm.filter_groups.metric: not built in this version of megarl — dynamic "
            "sampling filters on the reward score") in capsys.readouterr().err
    assert train_main(["--config", str(DEMO_CONFIG), *base, "checkpoint_engine.backend=disk"]) == 2
    assert ("checkpoint_engine.backend: not built in this version of megarl — the trainer "
            "streams weights") in capsys.readouterr().err


def test_ray_mode_under_a_torchrun_of_several_processes_is_refused(assets, tmp_path, capsys,
                                                                     monkeypatch):
    """Every torchrun process would start a Ray job of its own; naive mode is meant."""
    from megarl.trainer import train_main

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("WORLD_SIZE", "2")
    base = [f"model.path={assets / 'model'}", f"data.train_files=[{assets / 'data/train.parquet'}]",
            f"data.val_files=[{assets / 'data/val.parquet'}]", f"trainer.output_dir={tmp_path}"]
    assert train_main(["--config", str(DEMO_CONFIG), *base]) == 2
    err = capsys.readouterr().err
    assert "trainer.worker_group: ray, but this driver is one of 2 processes started by " \
           "torchrun" in err and "set trainer.worker_group=naive" in err
    assert not any(tmp_path.iterdir())  # refused before anything started or was written


def test_ppo_with_a_critic_runs_gae(assets, tmp_path):
    """algorithm.adv_estimator=gae: a Megatron critic (EP=2, next to the actor on the train
    pool) gives values; advantages and returns come from GAE; the critic is updated and its
    value loss falls on the same kind of data over a few steps."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    trainer = make_trainer(assets, tmp_path / "gae", "algorithm.adv_estimator=gae",
                           "critic.optim.lr=1e-2", "trainer.total_steps=3",
                           "data.train_batch_size=8", "rollout.n=4",
                           "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_gpu=8",
                           "trainer.save_every=1", "trainer.keep_last=1")
    probe = [[1, 5, 9, 13, 17, 21, 25]]
    try:
        trainer.setup()
        assert trainer.workers.critic is not None
        before = trainer.workers.critic.group.execute_all("compute_values", probe)[0]
        history = trainer.fit()
        after = trainer.workers.critic.group.execute_all("compute_values", probe)[0]
    finally:
        trainer.close()
    for metrics in history:
        for name in ("critic/vf_loss", "critic/vf_clipfrac", "critic/values/mean",
                     "critic/returns/mean", "critic/vf_explained_var", "timing/values",
                     "timing/update_critic", "actor/pg_loss"):
            assert math.isfinite(metrics[name]), name
        # one outcome reward in [0, 1] per sample, gamma = lam = 1: returns are the rewards
        assert -1e-6 <= metrics["critic/returns/min"] <= metrics["critic/returns/max"] <= 1 + 1e-6
    # the critic was trained: its values on a fixed sequence moved
    assert max(abs(a - b) for a, b in zip(before[0][1:], after[0][1:])) > 1e-3
    # keep_last=1: the actor keeps step 3; the critic also step 2, which a crash after the
    # critic's save of step 3 and before the actor's would leave the run to resume from
    root = tmp_path / "gae" / "checkpoints"

    def steps(folder: Path) -> list[str]:
        return sorted(p.name for p in folder.iterdir() if p.name.startswith("step_"))

    assert steps(root) == ["step_00000003"]
    assert steps(root / "critic") == ["step_00000002", "step_00000003"]


HAND_OFF = ["release kv_cache+weights", "offload grad+optimizer", "free_cache", "resume weights",
            "sync", "offload param", "free_cache", "resume kv_cache"]
"""The memory hand-off of one colocated step with param offload on (DESIGN.md, "Colocated")."""


def record_hand_off(trainer: Trainer, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The engines' release/resume calls and the actor group's memory calls, in the order the
    step makes them (each still goes to the real client or workers)."""
    events: list[str] = []
    client, actor = trainer.workers.client, trainer.workers.actor

    def recording(action: str, real):
        async def call(tags):
            events.append(f"{action} {'+'.join(tags)}")
            return await real(tags)
        return call

    monkeypatch.setattr(client, "release_memory", recording("release", client.release_memory))
    monkeypatch.setattr(client, "resume_memory", recording("resume", client.resume_memory))
    real_execute_all, real_sync = actor.execute_all, trainer.workers.weight_sync

    def execute_all(method, *args):
        if method == "offload":
            events.append(f"offload {'+'.join(args[0])}")
        elif method == "free_cache":
            events.append(method)
        return real_execute_all(method, *args)

    def weight_sync(*args):
        events.append("sync")
        return real_sync(*args)

    monkeypatch.setattr(actor, "execute_all", execute_all)
    monkeypatch.setattr(trainer.workers, "weight_sync", weight_sync)
    return events


def test_colocated_engines_release_memory_while_training(assets, tmp_path, monkeypatch):
    """rollout.colocate=true: actor ranks and the engine share the train pool's slots; the engine
    releases its KV cache and weights after generating; the actor offloads its gradients and
    optimizer state (on by default when colocated) and hands its cache back before the engine
    resumes its weights, the sync writes into them, then the parameters (param_offload) go to
    host memory and the cache is handed back again before the engine resumes its KV cache. The
    next step generates with the synced weights, so offload and reload changed no bit."""
    import httpx

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    trainer = make_trainer(assets, tmp_path / "colocated", "rollout.colocate=true",
                           "resources.rollout_pool=null", "trainer.total_steps=2",
                           "data.train_batch_size=8", "rollout.n=4",
                           "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_gpu=8",
                           "actor.offload.param_offload=true")
    assert trainer.cfg.actor.offload.grad_offload and trainer.cfg.actor.offload.optimizer_offload

    def released() -> list[list[str]]:
        return [httpx.get(f"{url}/get_server_info").json()["internal_states"][0]["released"]
                for url in trainer.workers.client.urls]

    try:
        trainer.setup()
        events = record_hand_off(trainer, monkeypatch)
        history = trainer.fit()
        assert events == HAND_OFF * 2
        freed = trainer.workers.actor.execute_all("free_cache")
        assert all(set(f) == {"before", "after"} and f["after"] >= 0 for f in freed)
        engines = len(trainer.workers.client.urls)  # one per train-pool slot
        assert released() == [[]] * engines
        trainer.engine_memory("release", ["kv_cache", "weights"])
        assert released() == [["kv_cache", "weights"]] * engines
        trainer.engine_memory("resume", ["weights"])
        assert released() == [["kv_cache"]] * engines
        trainer.engine_memory("resume", ["kv_cache"])
    finally:
        trainer.close()
    for step, metrics in enumerate(history, start=1):
        assert metrics["timing/release_rollout"] > 0
        assert metrics["rollout/weight_version"] == step
        assert metrics["training/rollout_probs_diff_mean"] < 1e-3  # generated with synced weights
        assert metrics["timing/offload_actor"] > 0 and metrics["timing/reload_actor"] > 0
        for phase in ("old_log_prob", "update_actor", "sync_weights"):
            assert metrics[f"perf/device_used_gb/{phase}"] > 0


@pytest.mark.parametrize("rollout_dtype", ["float32", "bfloat16"])
def test_colocated_engine_keeps_the_actors_views_and_replays_them(assets, tmp_path,
                                                                  rollout_dtype):
    """rollout.colocate=true with the parameters kept on the device (no param_offload): the
    engine keeps the actor's parameter memory as a program after the first syncs, and from then
    on a sync refills only the split q/k/v and posts one replay (on the CPU the actor's DDP
    buffer moves to shared memory at the first registration, so the second registers again).
    A rollout dtype other than the actor's casts every tensor at every sync: nothing is kept.
    After every step each tensor on the engine equals the actor's export (in the rollout
    dtype), bit for bit."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    trainer = make_trainer(assets, tmp_path / "kept", "rollout.colocate=true",
                           "resources.rollout_pool=null", "data.train_batch_size=8",
                           "rollout.n=4", "actor.ppo_mini_batch_size=8",
                           "actor.ppo_micro_batch_size_per_gpu=8",
                           "actor.offload.param_offload=false", "checkpoint_engine.backend=ipc",
                           "actor.parallel.ep=1", f"rollout.dtype={rollout_dtype}")
    dtype = getattr(torch, rollout_dtype)
    replayed = []
    try:
        trainer.setup()
        for _ in range(4):
            metrics = trainer.step(trainer.loader.next_batch())
            replayed.append(metrics["checkpoint_engine/replayed"])
            if dtype == torch.float32:  # generated with exactly the synced weights
                assert metrics["training/rollout_probs_diff_mean"] < 1e-3
            actor = trainer.workers.actor.execute_all("hf_state_dict")[0]
            on_engine = engine_weights(trainer, list(actor))
            for name, tensor in actor.items():
                want = tensor.to(dtype).float().reshape(-1)[: on_engine[name].numel()]
                assert torch.equal(on_engine[name].reshape(-1), want), name
    finally:
        trainer.close()
    assert replayed[-2:] == ([1.0, 1.0] if rollout_dtype == "float32" else [0.0, 0.0]), replayed


@pytest.mark.parametrize("mode", [
    "colocate_sync",
    pytest.param("one_step_off", marks=pytest.mark.slow),
    pytest.param("fully_async", marks=pytest.mark.slow),
])
def test_multi_turn_episodes_train_with_r3(assets, tmp_path, mode):
    """Multi-turn episodes (tests/trainer/agent_env.py: three model turns around two
    observations) through the whole step with R3. The trainer's log-probs of the model tokens
    (engine routes replayed over every turn) match the engine's, which they would not if an
    environment token (engine log-prob 0) were inside the mask or a route row were shifted."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    trainer = make_trainer(assets, tmp_path / "agent", "trainer.total_steps=2",
                           "data.train_batch_size=8", "rollout.n=4",
                           "actor.ppo_mini_batch_size=8", f"scheduler.mode={mode}",
                           "scheduler.trigger_parameter_sync_step=1",
                           "rollout.multi_turn.enable=true",
                           "rollout.multi_turn.env=agent_env:make_env",
                           "rollout.multi_turn.max_tokens_per_turn=6",
                           "data.max_response_length=80", "actor.router_replay.mode=R3",
                           "trainer.val_every=2", "data.val_batch_size=16")
    try:
        trainer.setup()
        history = trainer.fit()
    finally:
        trainer.close()
    assert len(history) == 2
    # greedy validation runs episodes too; the environment's rewards count in its score
    assert history[-1]["val/agent/num_turns/mean"] == 3
    assert history[-1]["val/score/mean"] >= history[-1]["val/agent/env_reward/mean"]
    for i, step in enumerate(history):
        assert step["agent/num_turns/mean"] == 3 and step["agent/tool_calls/mean"] == 3
        assert step["agent/budget_hit/tokens"] == 0 and step["agent/budget_hit/turns"] == 0
        assert step["timing/env"] > 0 and 0 <= step["critic/score/mean"] <= 1
        # env tokens masked, routes aligned over all turns: trainer == engine on model tokens
        # (one_step_off trains step 2 on samples of the weights before step 1's update)
        if mode == "colocate_sync" or i == 0:
            assert step["training/rollout_probs_diff_max"] < 1e-3, step
        assert step["rollout/moe/router_agreement"] == 1.0
        assert step["actor/entropy"] > 0.5  # there are model tokens under the mask
        # 3 turns of <= 6 tokens around two observations of ~20 tokens each
        assert 40 < step["response_length/mean"] <= 80


def test_the_tools_demo_learns_to_call_the_calculator(tmp_path):
    """`megarl demo --tools` in short: the warm-started tiny model (calls the calculator in ~30%
    of its samples, guesses in the rest) trained with GRPO on `tool_multiply` episodes. The
    tool-call rate and the reward of the last 20% of steps exceed the first 20%'s by 0.15
    (measured over 10 steps, first two vs last two: calls 0.29 -> 0.82, reward 0.24 -> 0.57,
    turns 1.28 -> 1.81; the rise goes on to calls 0.98 by step 15)."""
    from dataclasses import replace

    from megarl.demo import DEMOS, prepare_demo_assets

    spec = replace(DEMOS["tools"], root=tmp_path / "tools")
    root = prepare_demo_assets(spec.root, spec=spec)[0].parent
    steps = 10
    base = [f"model.path={root / 'model'}", f"data.train_files=[{root / 'data/train.parquet'}]",
            f"data.val_files=[{root / 'data/val.parquet'}]", f"trainer.output_dir={tmp_path / 'run'}",
            "trainer.loggers=[jsonl]", f"trainer.total_steps={steps}"]
    cfg, sources = load_config(str(spec.config), base)
    history = fit(Trainer(cfg, sources))
    assert len(history) == steps

    def rise(key: str) -> tuple[float, float]:
        return first_and_last_fifth(history, key)

    (first_score, last_score), (first_calls, last_calls) = (
        rise("critic/score/mean"), rise("agent/tool_calls/mean"))
    assert last_calls > first_calls + 0.15, [m["agent/tool_calls/mean"] for m in history]
    assert last_score > first_score + 0.15, [m["critic/score/mean"] for m in history]
    first_turns, last_turns = rise("agent/num_turns/mean")
    assert last_turns > first_turns + 0.15  # an episode that calls the tool has a second turn
    for m in history:
        # a call's result comes back (a malformed call is an error observation)
        assert 1 <= m["agent/num_turns/mean"] <= 2 and m["agent/tool_error_rate"] < 0.25
    assert (tmp_path / "run" / "run.png").stat().st_size > 10_000


def test_a_run_that_fails_still_writes_its_plot_and_timeline(assets, tmp_path, monkeypatch):
    """PITFALLS M6: the timeline (and the metrics' plot) of a run whose step 2 raised is written
    before the error reaches the caller, and the error is the step's own."""
    import megarl.trainer.step as step_module
    from megarl.metrics.health import HealthMonitor
    from megarl.metrics.trackers import MultiTracker, TrackerSettings

    class FailingScheduler:
        calls = 0
        closed = False

        def step(self, last: bool) -> dict[str, float]:
            FailingScheduler.calls += 1
            if FailingScheduler.calls == 2:
                raise RuntimeError("step 2 broke")
            return {"critic/score/mean": 0.5, "timing/step": 1.0}

        def close(self) -> None:
            FailingScheduler.closed = True

    monkeypatch.setattr(step_module, "build_scheduler", lambda trainer, cfg: FailingScheduler())
    out = tmp_path / "run"
    trainer = make_trainer(assets, out, "trainer.total_steps=3", "trainer.val_every=0",
                           f"ray.timeline_file={tmp_path / 'timeline.json'}")
    trainer.health = HealthMonitor()
    trainer.tracker = MultiTracker.from_names(["jsonl"], TrackerSettings(output_dir=out))
    with pytest.raises(RuntimeError, match="^step 2 broke$"):
        trainer.fit()
    trainer.tracker.close()
    assert FailingScheduler.closed
    assert (tmp_path / "timeline.json").stat().st_size > 0  # Ray's trace of the job so far
    assert (out / "run.png").stat().st_size > 0
    assert '"step": 1' in (out / "metrics.jsonl").read_text()
