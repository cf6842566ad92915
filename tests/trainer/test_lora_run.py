"""``megarl train`` with ``actor.lora``: the demo (two Megatron ranks with EP=2, an embedded
engine, Ray) trains adapters on the attention and the routed experts and syncs the merged
weights or the adapters alone; and (``slow``) a run killed mid-update
and resumed from its checkpoint logs the same per-step metrics as an uninterrupted one.
``megarl demo --lora`` (a tiny dense Qwen3, adapters on every linear layer): two steps train
the adapters alone and the engine serves them; and (``slow``) the whole demo learns for
two seeds."""

from __future__ import annotations

import signal
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from trainer_runs import (
    TOTAL_STEPS,
    assert_same_metrics,
    demo_trainer,
    first_and_last_fifth,
    fit,
    run_metrics,
    train,
)

from megarl.config import load_config
from megarl.demo import DEMOS, prepare_demo_assets
from megarl.trainer import Trainer

# every linear layer of the demo's MoE: attention, and one adapter per routed expert (EP=2)
LORA = ("actor.lora.rank=8", "actor.lora.alpha=16",
        ("actor.lora.target_modules=[linear_qkv,linear_proj,experts.linear_fc1,"
         "experts.linear_fc2]"))

pytestmark = pytest.mark.usefixtures("private_ray")


@pytest.mark.parametrize("sync", ["merged", "adapter"])
def test_lora_run_syncs_the_expert_adapters(demo_assets, expected, tmp_path, sync):
    """merged: the engine gets W + scale * B A under the HF names; adapter: it gets only the
    adapters, the routed experts' one per expert in SGLang's names, and applies them to its
    base (the run's start) in its own expert loop. The run of ``megarl train`` that
    ``expected`` holds, with LoRA, in this process."""
    history = fit(demo_trainer(demo_assets, tmp_path / "whole", *LORA,
                               f"actor.lora.sync={sync}"))
    metrics = dict(enumerate(history, start=1))
    assert sorted(metrics) == list(range(1, TOTAL_STEPS + 1))
    for step, row in metrics.items():
        # the engine serves the trained adapters: it scores the samples as the actor does
        assert row["training/rollout_probs_diff_max"] < (1e-6 if sync == "merged" else 1e-5), \
            step
        assert row["rollout/weight_version"] == step
    # adapters, not the full weights, trained: the run differs from the full-weight one
    assert metrics[2]["actor/grad_norm"] != expected[2]["actor/grad_norm"]
    assert len({m["actor/pg_loss"] for m in metrics.values()}) == TOTAL_STEPS


@pytest.mark.slow  # the parts run every time: test_resume.py (a run killed mid-update resumes
# exactly) and test_lora_checkpoint.py (adapters and the next Adam step come back exactly)
def test_lora_run_killed_mid_update_resumes_exactly(demo_assets, tmp_path):
    whole = tmp_path / "whole"
    assert train(demo_assets, whole, *LORA) == 0
    metrics = run_metrics(whole)
    crashy = tmp_path / "crashy"
    assert train(demo_assets, crashy, *LORA, crash="update_actor:3:0.05") == -signal.SIGKILL
    assert (crashy / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    assert train(demo_assets, crashy, *LORA) == 0
    assert assert_same_metrics(run_metrics(crashy), metrics) > 40


# what LoRA adapts on the dense Qwen3: every linear layer of each decoder layer
ADAPTED = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def lora_demo_trainer(tmp_path: Path, seed: int, *overrides: str) -> Trainer:
    """A Trainer of ``megarl demo --lora``'s config on the demo's model and data as the demo
    writes them with ``seed`` (model and data; ``trainer.seed`` is ``seed + 1``, the demo's 1
    for seed 0), under ``tmp_path``."""
    spec = replace(DEMOS["lora"], root=tmp_path / "assets")
    model, train_file, val_file = prepare_demo_assets(spec.root, seed=seed, spec=spec)
    cfg, sources = load_config(str(spec.config), [
        f"model.path={model}", f"data.train_files=[{train_file}]", f"data.val_files=[{val_file}]",
        f"trainer.output_dir={tmp_path / 'run'}", "trainer.loggers=[jsonl]",
        f"trainer.seed={seed + 1}", *overrides])
    return Trainer(cfg, sources)


@pytest.mark.slow  # 2 x 50 steps, about a minute each on 2 cores
@pytest.mark.parametrize("seed", [0, 1])
def test_the_lora_demo_learns(seed, tmp_path):
    """`megarl demo --lora` as it runs (seed 0) and with another model, data and trainer seed:
    the reward of the last 20% of the 50 steps exceeds the first 20%'s by 0.15 (measured:
    0.115 -> 0.811 and 0.156 -> 0.802)."""
    history = fit(lora_demo_trainer(tmp_path, seed))
    assert len(history) == 50
    first, last = first_and_last_fifth(history, "critic/score/mean")
    assert last > first + 0.15, (first, last, [m["critic/score/mean"] for m in history])
    assert max(m["training/rollout_probs_diff_max"] for m in history) < 1e-5


def test_the_lora_demo_trains_adapters_on_a_frozen_base_and_syncs_only_them(tmp_path):
    """Two steps of `megarl demo --lora` with ``actor.lora.sync=adapter``: each sync loads the
    actor's adapters into the engine as ``policy-v<step>`` and every request names it; the
    engine's base weights stay the random model's, yet it scores the samples as the actor does
    (it applies the trained adapters), and a sync moves the adapters' bytes only. The actor's
    merged export (what ``sync=merged`` sends; that sync runs in
    ``test_lora_run_syncs_the_expert_adapters``) differs from the random model's by a rank <= 16
    update on every linear layer and not at all elsewhere (embeddings, output layer, norms:
    frozen)."""
    trainer = lora_demo_trainer(tmp_path, 0, "trainer.total_steps=2", "actor.lora.sync=adapter")
    try:
        trainer.setup()
        history = trainer.fit()
        assert trainer.workers.client.lora_path == "policy-v2"
        config, tensors = trainer.workers.actor.execute_all("lora_adapter")[0]
        merged = trainer.workers.actor.execute_all("hf_state_dict")[0]
        name = "model.layers.0.self_attn.q_proj.weight"
        held = trainer.run(trainer.workers.client.get_weights_by_name(name, 10**9))[0]
    finally:
        trainer.close()
    start = load_file(tmp_path / "assets" / "model" / "model.safetensors")
    assert torch.equal(torch.tensor(held), start[name])  # the base is not merged
    assert config["r"] == 16 and len(tensors) == 2 * 2 * len(ADAPTED)
    adapter_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    assert adapter_bytes < 0.5 * sum(t.numel() * t.element_size() for t in start.values())
    for step, metrics in enumerate(history, start=1):
        # the random model's logits at initializer_range 0.1 span more than at 0.02: ~1e-6
        assert metrics["training/rollout_probs_diff_max"] < 1e-5, step
        assert metrics["rollout/weight_version"] == step
        assert metrics["checkpoint_engine/bytes"] == adapter_bytes
    assert history[1]["actor/pg_loss"] != history[0]["actor/pg_loss"]
    assert sorted(merged) == sorted(start)
    adapted = [name for name in start if name.endswith(tuple(f"{a}.weight" for a in ADAPTED))]
    assert len(adapted) == 2 * len(ADAPTED)
    for name, weight in start.items():
        if name not in adapted:
            assert torch.equal(merged[name], weight), name
            continue
        delta = merged[name].double() - weight.double()
        singular = torch.linalg.svdvals(delta)
        assert singular[0] > 1e-3, name  # the adapter moved
        assert singular[16] < 1e-5 * singular[0], (name, singular[:18])  # by B @ A, rank 16


@pytest.mark.parametrize("mode", ["one_step_off", "fully_async"])
def test_the_adapter_sync_under_the_overlapping_schedulers(tmp_path, mode):
    """The overlapping schedulers generate through clients of their own: those name the adapter
    of the latest sync too (else every request would go to the base model). Three steps;
    one_step_off generates steps 1 and 2 before the first sync (base) and step 3 under
    policy-v1, 16 prompts x 8 samples each; fully_async (a sync after every step) names each
    version once synced. Every sync moved the adapters' bytes only."""
    import httpx

    trainer = lora_demo_trainer(tmp_path, 0, "trainer.total_steps=3", "actor.lora.sync=adapter",
                                f"scheduler.mode={mode}", "scheduler.trigger_parameter_sync_step=1")
    try:
        trainer.setup()
        history = trainer.fit()
        url = trainer.workers.client.urls[0]
        served = httpx.get(f"{url}/get_server_info", timeout=30).json()["internal_states"][0]
        lora_path = trainer.workers.client.lora_path
        _, tensors = trainer.workers.actor.execute_all("lora_adapter")[0]
    finally:
        trainer.close()
    assert lora_path == "policy-v3"
    requests = served["lora_requests"]
    assert "policy-v1" in requests, requests
    assert set(requests) <= {"", "policy-v1", "policy-v2", "policy-v3"}, requests
    if mode == "one_step_off":
        assert requests["policy-v1"] == 16 * 8 and requests[""] >= 2 * 16 * 8, requests
        # the engines carry the synced version: step 3's samples (policy-v1) are one update
        # old, not two (the version stamped at the adapter sync)
        assert [m["staleness/max"] for m in history] == [0.0, 1.0, 1.0]
    assert max(m["staleness/max"] for m in history) <= 1.0  # fully_async drops what is older
    adapter_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    synced = [m["checkpoint_engine/bytes"] for m in history if "checkpoint_engine/bytes" in m]
    assert synced and all(b == adapter_bytes for b in synced), synced
