"""``verify``: Megatron (from HF weights or a checkpoint, in a layout other than the one it was
saved in) agrees with HF transformers on every family, and a corrupted tensor is caught."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from bridge_cases import FAMILIES, MOE_FAMILIES
from safetensors.torch import load_file, save_file

from bridge.checks import Layout
from bridge.cli import main
from bridge.verify import MAX_PROMPT_TOKENS, PROMPTS, compare, verify

# a checkpoint saved with EP=2 (MoE) / TP=2 (dense) is loaded with TP=2 / PP=2
LOAD_LAYOUT = {name: Layout(tp=2) if name in MOE_FAMILIES else Layout(pp=2) for name in FAMILIES}


def scored_tokens(model_dir: str) -> int:
    """Tokens of the fixed prompts that verify compares (all but each prompt's first, of at
    most MAX_PROMPT_TOKENS)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    lengths = [len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in PROMPTS]
    return sum(min(n, MAX_PROMPT_TOKENS) - 1 for n in lengths)


@pytest.mark.parametrize("name", FAMILIES)
def test_checkpoint_matches_transformers_in_another_layout(tiny_models, converted, ranks, name):
    result = verify(tiny_models[name], converted[name], LOAD_LAYOUT[name], runner=ranks.runner)
    assert result.passed
    assert result.max_abs_diff < 1e-4
    assert result.tokens == scored_tokens(tiny_models[name]) and len(result.per_prompt_max) == 4


def test_hf_weights_match_transformers(tiny_models, ranks):
    """Without --mcore the model loads the HF weights through mbridge."""
    result = verify(tiny_models["qwen2_moe"], layout=Layout(ep=2), runner=ranks.runner)
    assert result.passed and result.max_abs_diff < 1e-4


def swap_experts(tensors: dict) -> None:
    """Layer 1's experts 0 and 1 trade places (a classic expert-numbering bug)."""
    for part in ("gate_proj", "up_proj", "down_proj"):
        a, b = (f"model.layers.1.mlp.experts.{e}.{part}.weight" for e in (0, 1))
        tensors[a], tensors[b] = tensors[b], tensors[a]


def swap_query_heads(tensors: dict) -> None:
    """Layer 0's first two query heads trade places (a QKV split bug)."""
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    head = q.shape[0] // 4
    tensors["model.layers.0.self_attn.q_proj.weight"] = torch.cat(
        [q[head:2 * head], q[:head], q[2 * head:]])


def corrupt_copy(source: str, target: Path, corruption) -> Path:
    """A copy of the HF model directory with one corruption applied to its weights."""
    shutil.copytree(source, target)
    tensors = load_file(target / "model.safetensors")
    corruption(tensors)
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target


@pytest.mark.parametrize("name,corruption", [("qwen3_moe", swap_experts),
                                             ("llama", swap_query_heads)])
def test_corrupted_checkpoint_fails(tiny_models, ranks, tmp_path, name, corruption):
    from bridge.hf_to_mcore import hf_to_mcore

    bad_hf = corrupt_copy(tiny_models[name], tmp_path / "bad_hf", corruption)
    hf_to_mcore(bad_hf, tmp_path / "bad_mcore", Layout(tp=2), runner=ranks.runner)
    result = verify(tiny_models[name], tmp_path / "bad_mcore", Layout(tp=2), runner=ranks.runner)
    assert not result.passed
    assert result.max_abs_diff > 5 * result.tolerance  # exact conversions stay under 1e-5


def test_compare_reports_max_and_mean():
    """The statistics against numbers worked out by hand (position 0 is never compared)."""
    megatron = [[0.0, -1.0, -2.0], [0.0, -3.0]]
    reference = [torch.tensor([5.0, -1.5, -2.0]), torch.tensor([0.0, -2.0])]
    result = compare(megatron, reference, tolerance=0.6)
    assert result.tokens == 3
    assert result.max_abs_diff == pytest.approx(1.0)
    assert result.mean_abs_diff == pytest.approx(0.5)
    assert result.per_prompt_max == pytest.approx((0.5, 1.0))
    assert not result.passed


def test_cli_end_to_end_with_spawned_ranks(tiny_models, tmp_path, capsys):
    """The console script's path: hf-to-mcore and verify spawn their own two ranks; a
    corrupted checkpoint makes verify exit 1 and print FAIL; mcore-to-hf restores the bits."""
    bad_hf = corrupt_copy(tiny_models["qwen3_moe"], tmp_path / "bad_hf", swap_experts)
    mcore = tmp_path / "mcore"
    assert main(["hf-to-mcore", "--hf", str(bad_hf), "--out", str(mcore), "--ep", "2"]) == 0
    assert main(["verify", "--hf", tiny_models["qwen3_moe"], "--mcore", str(mcore),
                 "--ep", "2"]) == 1
    assert "FAIL" in capsys.readouterr().out
    assert main(["mcore-to-hf", "--mcore", str(mcore), "--out", str(tmp_path / "hf")]) == 0
    assert "wrote" in capsys.readouterr().out
    restored = load_file(tmp_path / "hf" / "model-00001-of-00001.safetensors")
    original = load_file(bad_hf / "model.safetensors")
    assert restored.keys() == original.keys()
    assert all(torch.equal(restored[k], original[k]) for k in original)


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_context_parallel_log_probs_match_transformers(tiny_models, converted, ranks, name):
    """``verify --cp 2``: every prompt split over two CP ranks (odd lengths padded to 2 x cp
    chunks) scores like HF transformers, from the checkpoint saved in another layout."""
    layout = Layout(cp=2)
    assert layout.world_size == 2 and layout.describe() == "tp=1 pp=1 ep=1 cp=2"
    result = verify(tiny_models[name], converted[name], layout, runner=ranks.runner)
    assert result.passed and result.max_abs_diff < 1e-4
    assert result.tokens == scored_tokens(tiny_models[name])


def test_context_parallel_is_refused_for_mla_models(tiny_models, capsys):
    assert main(["verify", "--hf", tiny_models["deepseek_v3"], "--cp", "2"]) != 0
    err = capsys.readouterr().err
    assert "--cp 2: context parallelism is not built for MLA models" in err and "--cp 1" in err
