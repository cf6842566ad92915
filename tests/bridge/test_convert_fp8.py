"""FP8 checkpoints as released (DeepSeek-V3, Qwen3-*-FP8: projection weights in
float8_e4m3fn with 128x128 ``weight_scale_inv`` blocks) convert: ``megarl-convert hf-to-mcore``
dequantizes them on load (``megarl.megatron.hf_reader``), the checkpoint holds exactly the
dequantized weights, and its log-probs match HF transformers run on those weights."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from bridge_cases import assert_same_tensors, fp8_copies, read_tensors
from safetensors.torch import load_file, save_file

from bridge.checks import ConversionError, Layout, inspect_hf_model
from bridge.cli import main
from bridge.mcore_checkpoint import read_convert_info
from bridge.verify import verify
from megarl.data.tiny_model import make_tiny_model

# 128-wide blocks: q 256 / k, v 128 rows (whole blocks, as SGLang's fused qkv needs), hidden
# 192 = 1.5 blocks (ragged edge in every projection's input or output), experts' 128
FP8_DIMS = {"hidden_size": 192, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 64, "moe_intermediate_size": 128}


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory):
    """(FP8 copy, dequantized copy) of a tiny Qwen3-MoE with 128-block dimensions."""
    root = tmp_path_factory.mktemp("fp8_models")
    source = make_tiny_model(root / "bf16", arch="qwen3_moe", seed=3, **FP8_DIMS)
    count = fp8_copies(source, root / "fp8", root / "dequantized")
    assert count == 2 * (4 + 4 * 3)  # per layer: q, k, v, o and 4 experts x 3
    return root / "fp8", root / "dequantized"


def test_fp8_checkpoint_converts_to_its_dequantized_weights(fp8_model, ranks, tmp_path):
    """hf-to-mcore (the CLI) then mcore-to-hf gives bit for bit the dequantized tensors, and
    the scales are gone; the checkpoint scores as transformers does on the dequantized model."""
    fp8_dir, dequantized_dir = fp8_model
    mcore, exported = tmp_path / "mcore", tmp_path / "hf"
    assert main(["hf-to-mcore", "--hf", str(fp8_dir), "--out", str(mcore), "--ep", "2"]) == 0
    assert read_convert_info(mcore)["dequantized_fp8_tensors"] == 32
    assert main(["mcore-to-hf", "--mcore", str(mcore), "--out", str(exported)]) == 0
    assert_same_tensors(read_tensors(dequantized_dir), read_tensors(exported))
    assert "quantization_config" not in json.loads((exported / "config.json").read_text())
    result = verify(dequantized_dir, mcore, Layout(tp=2), runner=ranks.runner)
    assert result.passed and result.max_abs_diff < 1e-4


def test_scales_without_an_fp8_quantization_config_are_refused(fp8_model, tmp_path):
    fp8_dir, _ = fp8_model
    shutil.copytree(fp8_dir, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match="no quantization_config with quant_method fp8"):
        inspect_hf_model(tmp_path / "m")


@pytest.mark.parametrize("damage,message", [
    ("scale_shape", r"o_proj.weight_scale_inv has shape \[1, 1\]; .* needs \[2, 2\]"),
    ("no_scale", "o_proj.weight has no model.layers.0.self_attn.o_proj.weight_scale_inv"),
    ("not_fp8", "o_proj.weight_scale_inv has no float8_e4m3fn weight"),
])
def test_a_damaged_fp8_checkpoint_is_refused_in_one_line(fp8_model, tmp_path, damage, message):
    fp8_dir, _ = fp8_model
    shutil.copytree(fp8_dir, tmp_path / "m")
    tensors = load_file(tmp_path / "m" / "model.safetensors")
    name = "model.layers.0.self_attn.o_proj.weight"
    if damage == "scale_shape":
        tensors[name + "_scale_inv"] = torch.ones(1, 1)
    elif damage == "no_scale":
        del tensors[name + "_scale_inv"]
    else:
        tensors[name] = tensors[name].float()
    save_file(tensors, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=message):
        inspect_hf_model(tmp_path / "m")


def test_the_reader_dequantizes_fp8_weights_and_reads_others_as_stored(fp8_model):
    """HFWeightReader, which make_bridge gives every bridge (the trainer's direct HF load and
    the conversion alike; building a bridge needs megatron's parallel groups, the conversion
    test above exercises that path)."""
    from megarl.megatron.hf_reader import HFWeightReader

    fp8_dir, dequantized_dir = fp8_model
    reader = HFWeightReader(str(fp8_dir))
    names = ["model.layers.1.mlp.experts.2.down_proj.weight", "model.layers.0.mlp.gate.weight",
             "model.layers.0.self_attn.k_proj.weight"]
    expected = load_file(dequantized_dir / "model.safetensors")
    loaded = reader.load_some_hf_weight(names)
    assert sorted(loaded) == sorted(names)
    for name in names:
        assert torch.equal(loaded[name], expected[name]), name
