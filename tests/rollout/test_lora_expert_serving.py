"""Routed-expert LoRA adapters through the adapter sync (issue 33): PEFT's adapter on HF's fused
expert parameters (``target_parameters``), split into SGLang's per-expert adapters
(``megarl/weights/expert_adapters.py``) and served by the embedded engine
(``rollout/local/lora_experts.py``), scores as PEFT's model does; the rows of another adapter or
of none in the same batch are untouched; unloading gives the experts their own forward back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from megarl.data.tiny_model import make_tiny_model
from megarl.rollout.local.lora_serving import AdapterError, LoraServing, read_peft_dir
from megarl.weights.expert_adapters import per_expert_adapter

RANK, ALPHA = 4, 8
TOKENS = torch.tensor([[3, 5, 7, 9, 11, 2], [13, 17, 19, 23, 29, 31], [37, 41, 43, 47, 4, 6]])


def random_moe_adapter(root: Path, model_seed: int, lora_seed: int, target_modules: list[str],
                       expert_parameters: tuple[str, ...], scale: float) -> tuple[Path, Any]:
    """A tiny Qwen3-MoE in ``root/base`` and a PEFT adapter on ``target_modules`` and on the
    fused ``expert_parameters`` of every layer, A and B random (B too, so every expert's adapter
    matters), saved by PEFT itself in ``root/adapter``; returns (base dir, the PEFT model)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base_dir = make_tiny_model(root / "base", arch="qwen3_moe", seed=model_seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    layers = model.config.num_hidden_layers
    peft_model = get_peft_model(model, LoraConfig(
        r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=target_modules,
        target_parameters=[f"model.layers.{i}.mlp.experts.{p}" for i in range(layers)
                           for p in expert_parameters]))
    generator = torch.Generator().manual_seed(lora_seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    peft_model.save_pretrained(root / "adapter")
    return base_dir, peft_model


@pytest.fixture(scope="module")
def peft_adapter(tmp_path_factory: pytest.TempPathFactory):
    """The random adapter on q/v and both expert parameters, and PEFT's logits with it."""
    root = tmp_path_factory.mktemp("lora_experts")
    base_dir, peft_model = random_moe_adapter(root, 0, 3, ["q_proj", "v_proj"],
                                              ("gate_up_proj", "down_proj"), 0.2)
    with torch.no_grad():
        want = peft_model(TOKENS).logits
    return base_dir, root / "adapter", want


def served_logits(serving: LoraServing, rows: list[str | None]) -> torch.Tensor:
    serving.set_rows(rows)
    with torch.no_grad():
        return serving.model(TOKENS[:len(rows)]).logits


def test_the_per_expert_adapter_scores_as_peft_and_leaves_other_rows_alone(peft_adapter):
    from transformers import AutoModelForCausalLM

    base_dir, adapter_dir, want = peft_adapter
    config, tensors = read_peft_dir(adapter_dir)
    assert any(".mlp.experts.base_layer.lora_A" in k for k in tensors)  # PEFT's fused layout
    config, tensors = per_expert_adapter(config, tensors)
    experts = AutoModelForCausalLM.from_pretrained(base_dir).config.num_experts
    layers = len({k.split(".layers.")[1].split(".")[0] for k in tensors})
    # q, v: 2 modules; experts: gate, up, down per expert; A and B each
    assert len(tensors) == 2 * layers * (2 + 3 * experts)
    assert "target_parameters" not in config
    assert {"gate_proj", "up_proj", "down_proj"} <= set(config["target_modules"])
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        base = model(TOKENS).logits
    serving = LoraServing(model)
    serving.load("policy", config, tensors)
    got = served_logits(serving, ["policy", None, "policy"])
    torch.testing.assert_close(got[0], want[0], atol=2e-5, rtol=0)
    torch.testing.assert_close(got[2], want[2], atol=2e-5, rtol=0)
    torch.testing.assert_close(got[1], base[1], atol=2e-5, rtol=0)
    assert (want[0] - base[0]).abs().max() > 1e-2  # the adapters matter
    # without the expert adapters (attention only) the adapted rows differ from PEFT's
    attention_only = {k: v for k, v in tensors.items() if ".experts." not in k}
    serving.load("attention", config, attention_only)
    partial = served_logits(serving, ["attention", None, None])[0]
    assert (partial - want[0]).abs().max() > 1e-3
    serving.unload("policy")
    serving.unload("attention")
    experts_module = model.model.layers[0].mlp.experts
    assert "forward" not in vars(experts_module)  # the class's own forward again
    torch.testing.assert_close(served_logits(serving, [None, None, None]), base, atol=0, rtol=0)


def test_per_expert_adapters_that_do_not_fit_are_refused_with_the_module(peft_adapter):
    from transformers import AutoModelForCausalLM

    base_dir, adapter_dir, _ = peft_adapter
    config, tensors = per_expert_adapter(*read_peft_dir(adapter_dir))
    serving = LoraServing(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32))
    key = "base_model.model.model.layers.0.mlp.experts.1.down_proj.lora_A.weight"
    wrong = {**tensors, key: torch.zeros(RANK, 3)}
    with pytest.raises(AdapterError, match=r"experts\.1\.down_proj lora_A \[4, 3\]"):
        serving.load("bad", config, wrong)
    extra = {**tensors, key.replace("experts.1.", "experts.99."): tensors[key],
             key.replace("experts.1.", "experts.99.").replace("lora_A", "lora_B"):
                 tensors[key.replace("lora_A", "lora_B")]}
    with pytest.raises(AdapterError, match="experts.99.down_proj: the layer has"):
        serving.load("bad", config, extra)
    assert serving.adapters == {}
    with pytest.raises(ValueError, match="not PEFT's fused layout of rank 8"):
        per_expert_adapter({**config, "r": 8, "target_parameters": [
            "model.layers.0.mlp.experts.down_proj"]},
            {"base_model.model.model.layers.0.mlp.experts.lora_A.weight": torch.zeros(12, 5),
             "base_model.model.model.layers.0.mlp.experts.lora_B.weight": torch.zeros(5, 4)})
