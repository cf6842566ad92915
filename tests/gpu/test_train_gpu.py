"""``megarl train`` on one GPU: colocated actor and embedded engine, weights over CUDA IPC.

The real trainer (Ray pools, a Megatron actor rank, an embedded engine sharing the GPU) runs the
GPU demo's config on a small random Qwen3-MoE in bf16. After every weight sync every tensor the
engine holds equals the actor's export bit for bit; the engine's log-probs stay close to the
trainer's; the engine gave its memory back while the actor trained. With R3 the router agreement
is reported with and without replay, and replay raises it to (almost) 1. With LoRA and the
adapter sync the engine gets only the adapters and scores as the trainer does. With
``rollout.quantization=fp8`` the engine holds, after every sync, exactly the blockwise FP8
quantization of the actor's export (quantized on the GPU, the reference on the CPU).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from megarl.config import load_config
from megarl.demo import DEMOS, prepare_demo_assets
from megarl.trainer import Trainer

pytestmark = pytest.mark.e2e  # the second GPU command: pytest -m "gpu and e2e"

SMALL_MOE = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 512,
             "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 256}
# bf16 engine vs bf16 trainer on a random model: the gap measured on the H200 stays well under
# PITFALLS T3's alarm (0.01); a broken sync (stale weights) gives > 0.05
PROBS_DIFF_BOUND = 0.01


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gpu-train")
    spec = DEMOS["cuda"]
    spec = type(spec)(root, spec.config, "copy_digit", SMALL_MOE, train_rows=1024)
    prepare_demo_assets(root, spec=spec)
    return root


@pytest.fixture(scope="module", autouse=True)
def private_ray():
    import ray

    from megarl.cluster import init_ray

    init_ray("local", num_cpus=8)
    yield
    ray.shutdown()


def make_trainer(root: Path, out: Path, *overrides: str) -> Trainer:
    base = [f"model.path={root / 'model'}", f"data.train_files=[{root / 'data/train.parquet'}]",
            f"data.val_files=[{root / 'data/val.parquet'}]", f"trainer.output_dir={out}",
            "trainer.loggers=[jsonl]", "data.train_batch_size=16", "rollout.n=4",
            "actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size_per_gpu=64",
            "checkpoint_engine.bucket_size_mb=4"]  # several buckets: two buffers take turns
    cfg, sources = load_config(str(DEMOS["cuda"].config), base + list(overrides))
    return Trainer(cfg, sources)


def engine_state(trainer: Trainer, names: list[str]) -> dict[str, torch.Tensor]:
    client = trainer.workers.client
    return {name: torch.tensor(trainer.run(client.get_weights_by_name(name, 10**9))[0])
            for name in names}


def test_colocated_training_on_one_gpu_syncs_every_tensor(assets, tmp_path):
    trainer = make_trainer(assets, tmp_path / "run", "trainer.total_steps=5")
    history = []
    try:
        trainer.setup()
        for step in range(1, 6):
            metrics = trainer.step(trainer.loader.next_batch())
            history.append(metrics)
            bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
            assert not bad, bad
            assert metrics["rollout/weight_version"] == step
            actor = trainer.workers.actor.execute_all("hf_state_dict")[0]
            held = engine_state(trainer, list(actor))
            for name, tensor in actor.items():
                assert torch.equal(held[name].reshape(-1), tensor.float().reshape(-1)), name
    finally:
        trainer.close()
    for metrics in history:
        assert metrics["training/rollout_probs_diff_mean"] < PROBS_DIFF_BOUND, metrics
        assert metrics["checkpoint_engine/bytes"] > 0
        assert metrics["timing/release_rollout"] > 0
    print({k: round(v, 5) for k, v in history[-1].items()
           if k.startswith(("timing/", "perf/", "training/", "checkpoint_engine/"))})


def test_r3_router_replay_on_one_gpu(assets, tmp_path):
    trainer = make_trainer(assets, tmp_path / "r3", "trainer.total_steps=3",
                           "rollout.enable_return_routed_experts=true",
                           "actor.router_replay.mode=R3",
                           "actor.router_replay.diagnose_no_replay=true")
    try:
        trainer.setup()
        history = trainer.fit()
    finally:
        trainer.close()
    for metrics in history:
        replayed = metrics["rollout/moe/router_agreement"]
        native = metrics["rollout/moe/router_agreement_no_replay"]
        print(f"router agreement: replayed {replayed:.4f}, native {native:.4f}")
        assert replayed > 0.99 and replayed >= native


def test_lora_adapter_sync_on_one_gpu(assets, tmp_path):
    """LoRA on the attention and the routed experts, colocated, ``actor.lora.sync=adapter``:
    each sync loads only the adapters into the engine (the experts' one per expert, in SGLang's
    names), the engine's base stays the model's, and it scores the samples as the trainer does."""
    from safetensors.torch import load_file

    trainer = make_trainer(assets, tmp_path / "lora", "trainer.total_steps=3",
                           "actor.lora.rank=8", "actor.lora.alpha=16", "actor.lora.sync=adapter",
                           ("actor.lora.target_modules=[linear_qkv,linear_proj,"
                            "experts.linear_fc1,experts.linear_fc2]"))
    try:
        trainer.setup()
        history = trainer.fit()
        name = "model.layers.0.mlp.experts.0.gate_proj.weight"
        held = engine_state(trainer, [name])[name]
        lora_path = trainer.workers.client.lora_path
    finally:
        trainer.close()
    start = load_file(assets / "model" / "model.safetensors")
    assert lora_path == "policy-v3"
    # the base is unmerged: the checkpoint's fp32 weight as the bf16 engine loaded it
    base = start[name].to(torch.bfloat16).float()
    assert torch.equal(held.reshape(-1), base.reshape(-1))
    weights = sum(t.numel() * t.element_size() for t in start.values())
    for step, metrics in enumerate(history, start=1):
        assert metrics["rollout/weight_version"] == step
        assert 0 < metrics["checkpoint_engine/bytes"] < 0.2 * weights
        assert metrics["training/rollout_probs_diff_mean"] < PROBS_DIFF_BOUND, metrics
    assert history[2]["actor/pg_loss"] != history[1]["actor/pg_loss"]
    print({k: round(v, 5) for k, v in history[-1].items()
           if k.startswith(("timing/", "perf/", "training/", "checkpoint_engine/"))})


def test_fp8_rollout_on_one_gpu_holds_the_quantized_actor_exactly(assets, tmp_path):
    """``rollout.quantization=fp8``, colocated, weights over CUDA IPC: the sender quantizes each
    bucket on the GPU; after every sync each FP8 weight and ``weight_scale_inv`` on the engine
    equals ``quantize_blockwise`` of the actor's bf16 export done on the CPU, bit for bit, and
    every other tensor the export; the engine's FP8 log-probs stay under the health monitor's
    FP8 alarm and token-level TIS is on."""
    from megarl.metrics.health import FP8_ROLLOUT_THRESHOLDS
    from megarl.weights.fp8 import is_quantized_weight, quantize_blockwise, scale_name

    trainer = make_trainer(assets, tmp_path / "fp8", "trainer.total_steps=3",
                           "rollout.quantization=fp8")
    history = []
    try:
        trainer.setup()
        assert trainer.cfg.algorithm.rollout_correction.rollout_is == "token"
        for step in range(1, 4):
            history.append(trainer.step(trainer.loader.next_batch()))
            expected = {}
            for name, tensor in trainer.workers.actor.execute_all("hf_state_dict")[0].items():
                if is_quantized_weight(name, tensor):
                    weight, scale = quantize_blockwise(tensor.cpu())
                    expected[name], expected[scale_name(name)] = weight.float(), scale
                else:
                    expected[name] = tensor.cpu().float()
            assert sum(n.endswith("_scale_inv") for n in expected) >= 4 * 4
            held = engine_state(trainer, list(expected))
            for name, tensor in expected.items():
                assert torch.equal(held[name].reshape(-1), tensor.reshape(-1)), name
    finally:
        trainer.close()
    for metrics in history:
        assert 0 < metrics["training/rollout_probs_diff_mean"] < \
            FP8_ROLLOUT_THRESHOLDS["rollout_probs_diff_max"], metrics
        assert metrics["rollout_corr/rollout_is_std"] > 0
    print({k: round(v, 5) for k, v in history[-1].items()
           if k.startswith(("training/", "rollout_corr/", "checkpoint_engine/"))})
