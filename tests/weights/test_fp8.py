"""Blockwise FP8 (``megarl.weights.fp8``): the round-trip error bound, agreement with a naive
per-block loop, idempotence, and which HF tensors an FP8 checkpoint quantizes.

The bound. A block with scale ``s = amax / 448`` quantizes ``x = w / s`` (|x| <= 448) to the
nearest e4m3 value ``q``. e4m3 has 3 mantissa bits: for |x| in [2^e, 2^(e+1)), e >= -6, its
values are 2^(e-3) apart; below 2^-6 (subnormals) 2^-9 apart. So |x - q| <= ulp(|x|) / 2 and
``|w - q s| <= s * ulp(|w| / s) / 2``. The fp32 arithmetic (one division, one multiplication)
adds at most ~2^-23 |x| s, under 2^-18 of that bound (half an ulp is at least |x| / 32); the
tests allow 2^-16 relative slack and also check that random blocks come within 5% of the bound.
"""

from __future__ import annotations

import math

import pytest
import torch

from megarl.weights.fp8 import (
    BLOCK,
    FP8_DTYPE,
    FP8_MAX,
    dequantize_blockwise,
    fp8_payload,
    is_quantized_weight,
    quantize_blockwise,
    scale_name,
    scale_shape,
)


def half_ulp_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Half the spacing of e4m3 values at magnitude ``|x|``."""
    exponent = torch.floor(torch.log2(x.abs().clamp(min=2.0 ** -6)))
    return torch.exp2(exponent - 3) / 2


def bound(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """Per element: s * half_ulp(|w| / s) with s the element's block scale (2^-16 slack)."""
    rows, cols = weight.shape
    s = scale_inv.repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)[:rows, :cols]
    return s * half_ulp_e4m3(weight.float() / s) * (1 + 2.0 ** -16)


def naive_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One block at a time, straight from the definition."""
    rows, cols = weight.shape
    scales = torch.empty(scale_shape(weight.shape), dtype=torch.float32)
    quantized = torch.empty(rows, cols, dtype=FP8_DTYPE)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            r, c = slice(i * 128, (i + 1) * 128), slice(j * 128, (j + 1) * 128)
            block = weight[r, c].float()
            amax = block.abs().max()
            scale = amax / 448.0 if amax > 0 else torch.tensor(1.0)
            scales[i, j] = scale
            quantized[r, c] = (block / scale).clamp(-448.0, 448.0).to(FP8_DTYPE)
    return quantized, scales


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (fp8 tensors compared as bytes)."""
    if a.dtype == FP8_DTYPE:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return a.dtype == b.dtype and torch.equal(a, b)


def random_weights() -> list[torch.Tensor]:
    """Shapes with whole and ragged blocks in either dimension, magnitudes from 1e-6 to 1e3,
    bf16 and fp32."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(128, 128), (256, 384), (200, 130), (1, 300), (129, 1), (64, 32), (384, 257)]
    weights = []
    for k, shape in enumerate(shapes):
        magnitude = 10.0 ** (k - 5)
        w = torch.randn(*shape, generator=gen) * magnitude
        weights.append(w.to(torch.bfloat16) if k % 2 else w)
    return weights


def adversarial_weights() -> dict[str, torch.Tensor]:
    """Zeros, one outlier, values on e4m3 rounding ties and boundaries, subnormal range."""
    gen = torch.Generator().manual_seed(1)
    outlier = torch.randn(256, 300, generator=gen) * 0.01
    outlier[5, 7] = 1e4
    zero_block = torch.randn(256, 200, generator=gen)
    zero_block[128:, :128] = 0
    ties = torch.tensor([448.0, 1.0, 1.0625, 1.125, 1.1875, 17.0, 240.0, 248.0, 256.0, 3.0,
                         2.0 ** -7, 3 * 2.0 ** -10, 2.0 ** -9, 2.0 ** -10])
    ties = torch.cat([ties, -ties]).repeat(10, 1)
    wide = torch.exp2(torch.linspace(-20, 0, 130 * 140)).view(130, 140)  # 2^20 dynamic range
    return {"zeros": torch.zeros(130, 260), "outlier": outlier, "zero_block": zero_block,
            "ties": ties, "wide_range": wide, "single": torch.tensor([[-3.5]])}


ALL = {f"random{k}": w for k, w in enumerate(random_weights())} | adversarial_weights()


@pytest.mark.parametrize("name", list(ALL))
def test_round_trip_within_half_an_e4m3_ulp_times_the_block_scale(name):
    weight = ALL[name]
    quantized, scale_inv = quantize_blockwise(weight)
    assert quantized.dtype == FP8_DTYPE and quantized.shape == weight.shape
    assert scale_inv.dtype == torch.float32
    assert tuple(scale_inv.shape) == (math.ceil(weight.shape[0] / 128),
                                      math.ceil(weight.shape[1] / 128))
    error = (weight.float() - dequantize_blockwise(quantized, scale_inv)).abs()
    assert (error <= bound(weight, scale_inv)).all()
    assert quantized.float().abs().amax() <= FP8_MAX and torch.isfinite(quantized.float()).all()
    if name.startswith("random"):  # the bound is tight: some element comes close to it
        assert (error / bound(weight, scale_inv)).max() > 0.95


def test_every_block_scale_is_its_amax_over_448_and_a_zero_block_gets_1():
    weight = ALL["zero_block"]
    _, scale_inv = quantize_blockwise(weight)
    assert scale_inv[1, 0] == 1.0
    assert scale_inv[0, 0] == weight[:128, :128].abs().max() / 448.0
    assert scale_inv[1, 1] == weight[128:, 128:].abs().max() / 448.0
    q, s = quantize_blockwise(torch.zeros(130, 260))
    assert (s == 1).all() and (q.float() == 0).all()


def test_an_outlier_changes_only_its_own_block():
    weight = ALL["outlier"].clone()
    quiet = weight.clone()
    quiet[5, 7] = 0.0
    q_loud, s_loud = quantize_blockwise(weight)
    q_quiet, s_quiet = quantize_blockwise(quiet)
    assert s_loud[0, 0] == 1e4 / 448.0 and s_loud[0, 0] > 1000 * s_quiet[0, 0]
    others = torch.ones_like(s_loud, dtype=torch.bool)
    others[0, 0] = False
    assert torch.equal(s_loud[others], s_quiet[others])
    assert same(q_loud[128:], q_quiet[128:]) and same(q_loud[:, 128:], q_quiet[:, 128:])
    error = (weight - dequantize_blockwise(q_loud, s_loud)).abs()
    assert error[:, 128:].max() <= bound(weight, s_loud)[:, 128:].max()
    # the outlier's block flushes its small values to zero; the other blocks keep ~4 bits
    assert error[:128, :128].max() > 10 * error[:, 128:].max()


@pytest.mark.parametrize("name", list(ALL))
def test_equals_a_naive_per_block_loop(name):
    quantized, scale_inv = quantize_blockwise(ALL[name])
    ref_q, ref_s = naive_quantize(ALL[name])
    assert same(quantized, ref_q) and same(scale_inv, ref_s)


@pytest.mark.parametrize("name", list(ALL))
def test_quantizing_the_dequantized_weight_gives_the_same_tensors(name):
    quantized, scale_inv = quantize_blockwise(ALL[name])
    again_q, again_s = quantize_blockwise(dequantize_blockwise(quantized, scale_inv))
    assert same(again_q, quantized) and same(again_s, scale_inv)


def test_the_scale_survives_the_round_trip_for_every_normal_amax():
    """Idempotence hinges on fl(fl(448 s) / 448) == s for s = fl(amax / 448) (the block's
    largest element becomes +-448, dequantizes to fl(448 s), and is requantized). Rounding
    depends only on amax's mantissa, so one binade covers every normal fp32 amax (those whose
    scale is not subnormal, amax >= 448 * 2^-126)."""
    mantissas = torch.arange(2 ** 23, dtype=torch.int32)
    amax = (mantissas | (127 << 23)).view(torch.float32)  # every fp32 in [1, 2)
    scale = amax / FP8_MAX
    assert torch.equal((scale * FP8_MAX) / FP8_MAX, scale)


def test_dequantize_refuses_a_scale_of_the_wrong_shape():
    quantized, scale_inv = quantize_blockwise(torch.randn(200, 130))
    with pytest.raises(ValueError, match=r"needs \[2, 2\]"):
        dequantize_blockwise(quantized, scale_inv[:1])


def test_quantize_refuses_non_finite_and_non_2d():
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize_blockwise(torch.tensor([[1.0, float("inf")]]))
    with pytest.raises(ValueError, match="2-D"):
        quantize_blockwise(torch.randn(4))


W = torch.zeros(4, 4)
QUANTIZED = [
    "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
    "model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.o_proj.weight",
    "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
    "model.layers.0.mlp.down_proj.weight", "model.layers.3.mlp.experts.17.gate_proj.weight",
    "model.layers.3.mlp.experts.17.down_proj.weight",
    "model.layers.3.mlp.shared_experts.up_proj.weight",
    "model.layers.3.mlp.shared_expert.up_proj.weight",
    "model.layers.0.self_attn.q_a_proj.weight", "model.layers.0.self_attn.q_b_proj.weight",
    "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
    "model.layers.0.self_attn.kv_b_proj.weight",
    "model.layers.0.block_sparse_moe.experts.1.w2.weight",
]
KEPT = [
    "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
    "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight",
    "model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.q_a_layernorm.weight",
    "model.layers.0.self_attn.kv_a_layernorm.weight", "model.layers.3.mlp.gate.weight",
    "model.layers.3.mlp.shared_expert_gate.weight", "model.layers.0.block_sparse_moe.gate.weight",
    "model.layers.0.self_attn.q_proj.bias", "model.layers.3.mlp.gate.e_score_correction_bias",
]


@pytest.mark.parametrize("name", QUANTIZED)
def test_projection_weights_are_quantized(name):
    assert is_quantized_weight(name, W)
    assert not is_quantized_weight(name, torch.zeros(4))  # never a 1-D tensor


@pytest.mark.parametrize("name", KEPT)
def test_embeddings_head_norms_router_and_biases_stay(name):
    assert not is_quantized_weight(name, W)


def test_ignored_layers_match_by_substring_as_sglang_does():
    name = "model.layers.0.self_attn.o_proj.weight"
    assert not is_quantized_weight(name, W, ignored=["layers.0.self_attn"])
    assert is_quantized_weight(name, W, ignored=["layers.1."])


def test_payload_pairs_each_quantized_weight_with_its_scale():
    bucket = {"model.layers.0.self_attn.q_proj.weight": torch.randn(256, 192).bfloat16(),
              "model.layers.0.input_layernorm.weight": torch.randn(192).bfloat16()}
    payload = fp8_payload(bucket)
    assert list(payload) == ["model.layers.0.self_attn.q_proj.weight",
                             scale_name("model.layers.0.self_attn.q_proj.weight"),
                             "model.layers.0.input_layernorm.weight"]
    assert payload["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape == (2, 2)
    assert payload["model.layers.0.input_layernorm.weight"] is bucket[
        "model.layers.0.input_layernorm.weight"]


def test_the_sync_plan_sends_ignored_modules_in_the_model_dtype():
    """``sent_specs`` with the engines' ``ignored_layers``: an ignored projection goes as one
    tensor in the sync dtype, the others as FP8 weight + fp32 scale."""
    from megarl.weights.fp8 import ignored_modules
    from megarl.weights.sglang_sender import sent_specs

    specs = [("model.layers.0.self_attn.q_proj.weight", [256, 128]),
             ("model.layers.0.mlp.experts.1.up_proj.weight", [64, 128]),
             ("model.layers.0.input_layernorm.weight", [128])]
    everything = sent_specs(specs, "bfloat16", "fp8")
    kept = sent_specs(specs, "bfloat16", "fp8", ignored_modules(fp8_attention=False))
    assert [len(g) for g in everything] == [2, 2, 1]
    assert kept[0] == [("model.layers.0.self_attn.q_proj.weight", [256, 128], "bfloat16")]
    assert kept[1] == everything[1] == [
        ("model.layers.0.mlp.experts.1.up_proj.weight", [64, 128], "float8_e4m3fn"),
        ("model.layers.0.mlp.experts.1.up_proj.weight_scale_inv", [1, 1], "float32")]
    assert ignored_modules(fp8_attention=True) == ()
