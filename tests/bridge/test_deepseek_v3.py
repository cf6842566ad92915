"""DeepSeek-V3 specifics: megarl's engine (native MLA spec, unsplit) against HF transformers,
with the routing features and YaRN that mbridge's bridge leaves out shown to matter; tensor
parallel gradients; a bf16 round trip; ``verify`` catching a corrupted routing bias and MLA
key/value split; the MTP layer of DeepSeek's release skipped and its FP8 format dequantized."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from bridge_cases import assert_same_tensors, fp8_copies, read_tensors
from safetensors.torch import load_file, save_file

from bridge.checks import ConversionError, Layout
from bridge.hf_to_mcore import hf_to_mcore
from bridge.mcore_to_hf import mcore_to_hf
from bridge.verify import verify
from megarl.data.tiny_model import make_tiny_model

EXACT = 1e-5  # fp32 megatron vs HF: measured 9.5e-7
LENGTHS = (9, 16, 5, 12, 48)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}


def sequences() -> list[torch.Tensor]:
    """The token sequences every parity check scores."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 128, (n,), generator=g) for n in LENGTHS]


def hf_log_probs(model_dir: str) -> list[torch.Tensor]:
    """log p(token | prefix) from HF transformers in fp32 (entry 0 of each sequence is 0)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for seq in sequences():
            logp = torch.log_softmax(model(seq[None]).logits[0], dim=-1)
            out.append(torch.cat([torch.zeros(1), logp[:-1].gather(-1, seq[1:, None])[:, 0]]))
    return out


def engine_log_probs(model_dir: str, overrides: dict) -> list[list[float]]:
    """Run on each rank: megarl's actor model (native spec, fp32, TP=PP=EP=1: every rank holds
    the whole model and computes what one rank alone computes, bit for bit) scores the
    sequences."""
    from megarl.megatron.logprobs import compute_log_probs
    from megarl.megatron.model import build_actor_model

    model = build_actor_model(model_dir, Layout().sizes(), torch.float32, spec="native",
                              config_overrides=overrides)
    with torch.no_grad():
        out = compute_log_probs(model, sequences())
    return [t.float().tolist() for t in out.log_probs]


def max_diff(engine: list[list[float]], reference: list[torch.Tensor]) -> float:
    """Largest absolute log-prob difference over all tokens after the first."""
    return max(float((torch.tensor(e[1:]) - r[1:]).abs().max())
               for e, r in zip(engine, reference))


@pytest.fixture(scope="module")
def yarn_model(tmp_path_factory) -> str:
    """Tiny DeepSeek-V3 with YaRN RoPE (factor 4 over 16 pretraining positions)."""
    return str(make_tiny_model(tmp_path_factory.mktemp("ds") / "yarn", arch="deepseek_v3",
                               seed=11, rope_parameters=YARN))


@pytest.fixture(scope="module")
def reference(tiny_models) -> list[torch.Tensor]:
    """HF transformers' log-probs of the tiny DeepSeek-V3 (computed once for the module)."""
    return hf_log_probs(tiny_models["deepseek_v3"])


def test_engine_matches_transformers(tiny_models, ranks, reference):
    """build_actor_model equals HF to float rounding."""
    exact = ranks.run(engine_log_probs, tiny_models["deepseek_v3"], {})[0]
    assert max_diff(exact, reference) < EXACT


@pytest.mark.parametrize("overrides,what", [
    ({"moe_router_num_groups": None, "moe_router_group_topk": None}, "group-limited routing"),
    ({"moe_router_enable_expert_bias": False}, "e_score_correction_bias"),
    ({"moe_router_topk_scaling_factor": None}, "routed_scaling_factor"),
])
def test_routing_feature_matters(tiny_models, ranks, reference, overrides, what):
    """The same model without one routing feature that mbridge's own bridge leaves out (or
    that HF applies) is far off (the exact model is within EXACT: the test above)."""
    without = ranks.run(engine_log_probs, tiny_models["deepseek_v3"], overrides)[0]
    assert max_diff(without, reference) > 1e-2, what  # measured 0.032-0.038


def test_yarn_rope_matches_transformers(yarn_model, ranks):
    """YaRN from rope_parameters: exact; plain RoPE with the same weights is not."""
    reference = hf_log_probs(yarn_model)
    assert max_diff(ranks.run(engine_log_probs, yarn_model, {})[0], reference) < EXACT
    plain = {"rope_type": "rope", "rotary_scaling_factor": 1.0, "mscale_all_dim": 0.0}
    assert max_diff(ranks.run(engine_log_probs, yarn_model, plain)[0], reference) > 1e-3


def grad_norm_of_one_step(model_dir: str, layout: Layout) -> float:
    """Run on each rank: one training step of the engine on fixed data; its gradient norm."""
    from megarl.megatron.model import build_actor_model
    from megarl.megatron.optimizer import OptimizerSettings, TrainableActor
    from megarl.megatron.update import LossSettings, TrainSequence, train_step

    model = build_actor_model(model_dir, layout.sizes(), torch.float32, spec="native")
    actor = TrainableActor(model, OptimizerSettings(lr=1e-2))
    g = torch.Generator().manual_seed(0)
    batch = [TrainSequence(tokens=torch.randint(0, 128, (n,), generator=g),
                           loss_mask=torch.ones(n), old_log_probs=-5 * torch.ones(n),
                           advantages=torch.randn(n, generator=g)) for n in (9, 12)]
    # megatron torch.compiles the router's count of tokens per expert (the expert-bias
    # bookkeeping: a buffer no gradient depends on) on the first training step: 15 s of
    # inductor per rank on an idle CPU, a minute and more on a loaded one. Eager is the same.
    with torch.compiler.set_stance("force_eager"):
        return train_step(actor, batch, LossSettings())["actor/grad_norm"]


def test_tensor_parallel_gradients_match_the_unsplit_model(tiny_models, ranks):
    """TP=2 (sequence parallel) trains on the same gradients as the unsplit model (TP=1: two
    data-parallel replicas of one rank's step, 4e-8 from one rank alone): MLA's shared RoPE key
    collects every rank's heads (megatron's local MLA spec loses them: 5.5e-5 relative)."""
    unsplit = ranks.run(grad_norm_of_one_step, tiny_models["deepseek_v3"], Layout())[0]
    split = ranks.run(grad_norm_of_one_step, tiny_models["deepseek_v3"], Layout(tp=2))
    assert split[0] == split[1]
    assert abs(split[0] - unsplit) < 2e-6 * unsplit  # measured 5.3e-7 (1.7e-7 to one rank)


def test_bf16_round_trip_under_expert_and_tensor_parallel(tiny_models, ranks, tmp_path):
    """bf16 weights (the routing bias in fp32, as HF keeps it): HF -> EP=2 -> HF and
    HF -> TP=2 -> HF are bit-exact, dtypes included."""
    source = rewritten_copy(tiny_models["deepseek_v3"], tmp_path / "bf16", lambda tensors: {
        k: v if k.endswith("e_score_correction_bias") else v.to(torch.bfloat16)
        for k, v in tensors.items()})
    tensors = read_tensors(source)
    for layout in (Layout(ep=2), Layout(tp=2)):
        mcore, hf = tmp_path / f"mcore_{layout.tp}", tmp_path / f"hf_{layout.tp}"
        assert hf_to_mcore(source, mcore, layout, runner=ranks.runner)["dtype"] == "bfloat16"
        mcore_to_hf(mcore, hf)
        assert_same_tensors(tensors, read_tensors(hf))


def rewritten_copy(source: str, target: Path, rewrite) -> Path:
    """A copy of an HF model directory whose weights are ``rewrite(weights)``."""
    shutil.copytree(source, target)
    tensors = rewrite(load_file(target / "model.safetensors"))
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target


def flip_routing_bias(tensors: dict) -> dict:
    """Layer 1's routing bias reversed over the experts (a bias mapped to the wrong experts)."""
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    return {**tensors, name: tensors[name].flip(0)}


def swap_key_and_value(tensors: dict) -> dict:
    """Layer 0's kv_b_proj with the key (qk_nope_head_dim = 16) and value (v_head_dim = 16)
    rows of every head exchanged (an MLA up-projection split bug)."""
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    per_head = tensors[name].view(4, 32, -1)
    swapped = torch.cat([per_head[:, 16:], per_head[:, :16]], dim=1)
    return {**tensors, name: swapped.reshape(tensors[name].shape)}


@pytest.mark.parametrize("corruption", [flip_routing_bias, swap_key_and_value])
def test_verify_catches_corrupted_tensor(tiny_models, ranks, tmp_path, corruption):
    """A checkpoint converted from a corrupted copy fails verify against the original."""
    bad = rewritten_copy(tiny_models["deepseek_v3"], tmp_path / "bad_hf", corruption)
    hf_to_mcore(bad, tmp_path / "bad_mcore", Layout(ep=2), runner=ranks.runner)
    result = verify(tiny_models["deepseek_v3"], tmp_path / "bad_mcore", Layout(tp=2),
                    runner=ranks.runner)
    assert not result.passed
    assert result.max_abs_diff > 5 * result.tolerance


def test_multi_token_prediction_layer_is_skipped(tiny_models, ranks, tmp_path):
    """A checkpoint with the MTP layer its config declares (as DeepSeek-V3's release has, and
    HF transformers does not load) converts; the layer is reported skipped and not exported."""
    layers = 3
    extra = {f"model.layers.{layers}.eh_proj.weight": torch.randn(64, 128),
             f"model.layers.{layers}.enorm.weight": torch.ones(64)}
    source = rewritten_copy(tiny_models["deepseek_v3"], tmp_path / "mtp",
                            lambda tensors: {**tensors, **extra})
    config = json.loads((source / "config.json").read_text())
    assert config["num_hidden_layers"] == layers
    (source / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    summary = hf_to_mcore(source, tmp_path / "mcore", Layout(ep=2), runner=ranks.runner)
    assert summary["skipped_mtp_tensors"] == 2
    mcore_to_hf(tmp_path / "mcore", tmp_path / "hf")
    assert_same_tensors(read_tensors(tiny_models["deepseek_v3"]), read_tensors(tmp_path / "hf"))


def test_fp8_checkpoint_converts_dequantized(tiny_models, ranks, tmp_path):
    """DeepSeek's FP8 release format (MLA projections and experts in float8_e4m3fn with
    ``weight_scale_inv``, one ragged block each here) converts to the dequantized weights."""
    quantized = fp8_copies(tiny_models["deepseek_v3"], tmp_path / "fp8", tmp_path / "dequantized")
    summary = hf_to_mcore(tmp_path / "fp8", tmp_path / "mcore", Layout(ep=2), runner=ranks.runner)
    assert summary["dequantized_fp8_tensors"] == quantized > 0
    mcore_to_hf(tmp_path / "mcore", tmp_path / "hf")
    assert_same_tensors(read_tensors(tmp_path / "dequantized"), read_tensors(tmp_path / "hf"))


def test_fp8_scales_without_quantization_config_are_refused(tiny_models, tmp_path):
    """``weight_scale_inv`` next to fp8 weights but no fp8 quantization_config: one line."""
    name = "model.layers.0.self_attn.o_proj.weight"
    source = rewritten_copy(tiny_models["deepseek_v3"], tmp_path / "fp8", lambda tensors: {
        **tensors, name: tensors[name].to(torch.float8_e4m3fn),
        f"{name}_scale_inv": torch.ones(1, 1)})
    with pytest.raises(ConversionError, match="FP8 .* no quantization_config with quant_method"):
        hf_to_mcore(source, tmp_path / "mcore", Layout(ep=2))
    assert not (tmp_path / "mcore").exists()
