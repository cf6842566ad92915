"""The adapter sync's routed-expert adapters as SGLang loads them: SGLang's own ``LoRAAdapter``
(``srt/lora/lora.py``: ``initialize_weights_from_tensors``, which renames ``w1``/``w3``/``w2`` and
stacks gate and up into ``gate_up_proj``) takes megarl's per-expert tensors
(``megarl/weights/expert_adapters.py``) into the layout its MoE buffers read
(``experts.{e}.gate_up_proj`` A ``[2r, H]``, B ``[2I, r]``; ``experts.{e}.down_proj``), SGLang's
target-module lookup names each, and the deltas SGLang applies (each half of A with its half of
B, ``get_stacked_multiply("gate_up_proj_moe") == 2``) are PEFT's own merge of the fused adapter."""

from __future__ import annotations

import logging
import re
import types

import pytest
import sglang_ref
import torch
from torch import nn

from megarl.rollout.local.lora_serving import read_peft_dir
from megarl.weights.expert_adapters import per_expert_adapter
from tests.rollout.test_lora_expert_serving import ALPHA, RANK, random_moe_adapter


@pytest.fixture(scope="module")
def sglang_lora() -> dict:
    """SGLang's ``LoRAAdapter`` and its LoRA name helpers, from its source (the package's
    imports need CUDA)."""
    utils = types.ModuleType("sglang.srt.lora.utils")
    utils.__dict__.update(sglang_ref.load_definitions(
        "srt/lora/utils.py", ["get_normalized_target_modules", "get_target_module_name",
                              "get_stacked_multiply"], {"Iterable": object, "Set": set,
                                                        "Union": object}))
    layer_id = sglang_ref.load_definitions("srt/layers/utils/common.py", ["get_layer_id"],
                                           {"re": re})
    found = sglang_ref.load_definitions("srt/lora/lora.py", ["LoRALayer", "LoRAAdapter"], {
        "torch": torch, "nn": nn, "Dict": dict, "List": list, "logger": logging.getLogger("t"),
        "LoRAConfig": object, "AutoConfig": object, "LoadConfig": object,
        "BaseLoRABackend": object, "DefaultModelLoader": None,
        "LORA_SUPPORTED_BACKENDS": {"csgmv": None}, **layer_id})
    return {"LoRAAdapter": found["LoRAAdapter"], "utils": utils}


@pytest.fixture(scope="module")
def adapter_and_merge(tmp_path_factory: pytest.TempPathFactory):
    """A random PEFT adapter (saved by PEFT) on both fused expert parameters of a tiny
    Qwen3-MoE (``target_parameters`` in the other order), and PEFT's merge of it: the
    per-expert deltas SGLang must apply."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("sglang_moe_lora")
    base_dir, peft_model = random_moe_adapter(root, 1, 11, ["o_proj"],
                                              ("down_proj", "gate_up_proj"), 1.0)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    base = {n: p.detach() for n, p in model.named_parameters() if ".experts." in n}
    merged = dict(peft_model.merge_and_unload().named_parameters())
    deltas = {n: merged[n].detach() - w for n, w in base.items()}
    return read_peft_dir(root / "adapter"), deltas, model.config


def test_sglang_loads_the_per_expert_adapters_as_peft_merges_them(sglang_lora,
                                                                  adapter_and_merge):
    (config, tensors), deltas, hf_config = adapter_and_merge
    config, tensors = per_expert_adapter(config, tensors)
    utils = sglang_lora["utils"]
    targets = utils.get_normalized_target_modules(config["target_modules"])
    assert {"gate_up_proj", "down_proj", "o_proj"} <= targets
    # SGLang's adapter object, as LoRAManager makes it, minus the model loader
    adapter = object.__new__(sglang_lora["LoRAAdapter"])
    vars(adapter).update(
        config=types.SimpleNamespace(target_modules=config["target_modules"],
                                     lora_added_tokens_size=0),
        layers=[types.SimpleNamespace(weights={}) for _ in range(hf_config.num_hidden_layers)],
        embedding_layers={}, added_tokens_embeddings={},
        lora_backend=types.SimpleNamespace(name="csgmv"))
    scaling = ALPHA / RANK  # LoRAAdapter.scaling: lora_alpha / r
    with sglang_ref.sglang_modules(extra={"sglang.srt.lora.utils": utils}):
        adapter.initialize_weights_from_tensors(tensors)
    inter, experts = hf_config.moe_intermediate_size, hf_config.num_experts
    assert utils.get_stacked_multiply("gate_up_proj_moe") == 2
    for layer_id, layer in enumerate(adapter.layers):
        expert_keys = {k for k in layer.weights if re.search(r"experts\.(\d+)\.", k)}
        assert len(expert_keys) == 2 * 2 * experts  # gate_up and down, A and B, per expert
        for e in range(experts):
            prefix = f"base_model.model.model.layers.{layer_id}.mlp.experts.{e}"
            a = layer.weights[f"{prefix}.gate_up_proj.lora_A.weight"]
            b = layer.weights[f"{prefix}.gate_up_proj.lora_B.weight"]
            assert tuple(a.shape) == (2 * RANK, hf_config.hidden_size)
            assert tuple(b.shape) == (2 * inter, RANK)
            assert utils.get_target_module_name(f"{prefix}.gate_up_proj", targets) \
                == "gate_up_proj"
            stacked = torch.cat([b[:inter] @ a[:RANK], b[inter:] @ a[RANK:]])  # gate, up
            want = deltas[f"model.layers.{layer_id}.mlp.experts.gate_up_proj"][e]
            torch.testing.assert_close(scaling * stacked, want, atol=1e-5, rtol=1e-5)
            a = layer.weights[f"{prefix}.down_proj.lora_A.weight"]
            b = layer.weights[f"{prefix}.down_proj.lora_B.weight"]
            assert utils.get_target_module_name(f"{prefix}.down_proj", targets) == "down_proj"
            want = deltas[f"model.layers.{layer_id}.mlp.experts.down_proj"][e]
            torch.testing.assert_close(scaling * (b @ a), want, atol=1e-5, rtol=1e-5)
            assert want.abs().max() > 1e-2
