"""The embedded engine in block FP8 (``--quantization fp8``, issue 31): the w8a8 matmul against
a naive reference and the rounding bound of e4m3, the FP8 expert block against transformers'
loop on dequantized weights, the engine's own quantization against the weight sync's, and the
refusals (a bf16 tensor into an FP8 weight, a view that is not a block of rows)."""

from __future__ import annotations

import math
from pathlib import Path

import httpx
import pytest
import torch
import torch.nn.functional as F
from fp8_moe_checks import native_and_hf_runners

from megarl.data.tiny_model import make_tiny_model
from megarl.rollout.local.fp8_layers import (
    Fp8Experts,
    Fp8Linear,
    dequantize_activations,
    expert_scale_view,
    fp8_matmul_reference,
    padded_weight_scales,
    quantize_activations,
    unquantized_activations,
)
from megarl.rollout.local.launch import launch_local_engines
from megarl.rollout.local.model_runner import ModelRunner
from megarl.rollout.local.weights import WeightMap, iter_safetensors
from megarl.weights.fp8 import FP8_MAX, dequantize_blockwise, fp8_payload, quantize_blockwise


def naive_w8a8(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ W.T with x quantized per row and group of 128 columns and W per 128x128 block, each
    piece rounded to e4m3 after dividing by its amax / 448, written out element by element."""
    def round_blocks(t: torch.Tensor, rows: int) -> torch.Tensor:
        out = torch.empty_like(t, dtype=torch.float64)
        for r in range(0, t.shape[0], rows):
            for c in range(0, t.shape[1], 128):
                block = t[r:r + rows, c:c + 128].double()
                scale = block.abs().max() / FP8_MAX if block.abs().max() > 0 else 1.0
                q = (block / scale).float().to(torch.float8_e4m3fn).double()
                out[r:r + rows, c:c + 128] = q * scale
        return out

    return round_blocks(x, 1) @ round_blocks(weight, 128).t()


def test_the_w8a8_matmul_is_the_naive_blockwise_product_within_e4m3_rounding():
    torch.manual_seed(0)
    x = torch.randn(5, 300) * torch.logspace(-2, 1, 300)  # groups of very different scale
    weight = torch.randn(200, 300) * 0.05
    q, s = quantize_blockwise(weight)
    got = fp8_matmul_reference(x, q, s).double()
    assert torch.allclose(got, naive_w8a8(x, weight), rtol=1e-5, atol=1e-6)
    # against the exact product: e4m3 keeps 3 mantissa bits, so each operand is off by at most
    # 2^-4 of itself (normal range) or half the smallest subnormal step x its scale
    _, act_scale = quantize_activations(x)
    act_err = torch.maximum(x.abs() / 16, act_scale.repeat_interleave(128, 1)[:, :300] * 2**-10)
    w_err = torch.maximum(weight.abs() / 16, s.repeat_interleave(128, 0).repeat_interleave(
        128, 1)[:200, :300] * 2**-10)
    bound = (x.abs() @ w_err.t() + act_err @ weight.abs().t() + act_err @ w_err.t()).double()
    error = (got - (x.double() @ weight.double().t())).abs()
    assert (error <= bound * 1.001 + 1e-6).all()
    assert error.max() > 0  # not an fp32 matmul in disguise


@pytest.mark.parametrize("blocks_k", [3, 4, 6])
def test_weight_scales_take_cublas_layout_for_the_128x128_recipe(blocks_k):
    """The weight scales handed to ``torch.nn.functional.scaled_mm``: ``[L4, N/128]`` with the
    K blocks contiguous and 16-byte aligned (L padded to a multiple of 4 with zeros), the
    layout of torch's own block-scaled tests; every block's scale where cuBLAS reads it."""
    scale_inv = torch.arange(1, 5 * blocks_k + 1, dtype=torch.float32).view(5, blocks_k)
    laid_out = padded_weight_scales(scale_inv)
    l4 = -(-blocks_k // 4) * 4
    assert laid_out.shape == (l4, 5) and laid_out.stride() == (1, l4)
    storage = laid_out.t()  # the memory cuBLAS reads: row n holds N-block n's K blocks
    assert torch.equal(storage[:, :blocks_k], scale_inv)
    assert not storage[:, blocks_k:].any()


def test_fp8_linear_keeps_the_bias_and_the_shape():
    torch.manual_seed(1)
    linear = torch.nn.Linear(130, 260, bias=True)
    fp8 = Fp8Linear.of(linear)
    assert fp8.weight.dtype == torch.float8_e4m3fn and fp8.weight_scale_inv.shape == (3, 2)
    x = torch.randn(2, 3, 130)
    want = fp8_matmul_reference(x, fp8.weight, fp8.weight_scale_inv) + linear.bias
    assert torch.allclose(fp8(x), want, atol=1e-6)
    assert not any(p.requires_grad for p in fp8.parameters())


def test_unquantized_activations_multiply_by_the_dequantized_weights():
    """Inside ``unquantized_activations`` (the native decoder's check of its fast kernels) an
    FP8 layer is w8a16: the activations as they are times the dequantized weight; the experts
    too. Outside, and again after the block, w8a8."""
    torch.manual_seed(3)
    fp8 = Fp8Linear.of(torch.nn.Linear(256, 128, bias=True))
    x = torch.randn(4, 256)
    w8a16 = x @ dequantize_blockwise(fp8.weight, fp8.weight_scale_inv).T + fp8.bias
    w8a8 = fp8_matmul_reference(x, fp8.weight, fp8.weight_scale_inv) + fp8.bias
    assert (w8a8 - w8a16).abs().max() > 1e-4  # the activations' rounding is visible
    with unquantized_activations():
        torch.testing.assert_close(fp8(x), w8a16, atol=1e-6, rtol=1e-6)
        with unquantized_activations():
            pass
        torch.testing.assert_close(fp8(x), w8a16, atol=1e-6, rtol=1e-6)  # nested: still on
    torch.testing.assert_close(fp8(x), w8a8, atol=1e-6, rtol=1e-6)
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(4)
    block = SimpleNamespace(num_experts=3, hidden_dim=256, intermediate_dim=128, act_fn=F.silu,
                            gate_up_proj=torch.randn(3, 256, 256, generator=g) * 0.05,
                            down_proj=torch.randn(3, 256, 128, generator=g) * 0.05)
    experts = Fp8Experts(block)
    index, weights = torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1]]), torch.rand(4, 2)
    want = torch.zeros_like(x)
    for row in range(4):
        for slot in range(2):
            e = int(index[row, slot])
            gate_up = x[row] @ dequantize_blockwise(experts.gate_up_proj[e],
                                                    experts.gate_up_proj_scale_inv[e]).T
            gate, up = gate_up.chunk(2)
            down = dequantize_blockwise(experts.down_proj[e], experts.down_proj_scale_inv[e])
            want[row] += weights[row, slot] * (F.silu(gate) * up) @ down.T
    with unquantized_activations():
        torch.testing.assert_close(experts(x, index, weights), want, atol=1e-5, rtol=1e-5)
    assert (experts(x, index, weights) - want).abs().max() > 1e-5


def test_fp8_experts_equal_transformers_loop_on_the_dequantized_weights():
    """Each expert of the FP8 block computes SwiGLU with its gate, up and down weights as the
    engine holds them (gate and up each on their own block grid), weighted by the router."""
    from transformers import AutoModelForCausalLM

    from megarl.data.tiny_model import tiny_config_dict

    torch.manual_seed(2)
    config = tiny_config_dict("qwen3_moe")
    from transformers import Qwen3MoeConfig

    model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**config))
    experts = model.model.layers[0].mlp.experts
    fp8 = Fp8Experts(experts)
    size = experts.intermediate_dim
    x = torch.randn(7, experts.hidden_dim)
    top = torch.randint(0, experts.num_experts, (7, 2))
    weights = torch.rand(7, 2)
    want = torch.zeros_like(x)
    for row in range(7):
        for slot in range(2):
            e = int(top[row, slot])
            gate_up = fp8.gate_up_proj[e]
            scale = fp8.gate_up_proj_scale_inv[e]
            rows = math.ceil(size / 128)
            gate = fp8_matmul_reference(x[row:row + 1], gate_up[:size], scale[:rows])
            up = fp8_matmul_reference(x[row:row + 1], gate_up[size:], scale[rows:])
            out = fp8_matmul_reference(F.silu(gate) * up, fp8.down_proj[e],
                                       fp8.down_proj_scale_inv[e])
            want[row] += (out * weights[row, slot])[0]
    assert torch.allclose(fp8(x, top, weights), want, atol=1e-6)
    # the held weights are the blockwise quantization of each expert's projections
    gate_q, gate_s = quantize_blockwise(experts.gate_up_proj[3, :size].detach())
    assert torch.equal(fp8.gate_up_proj[3, :size].float(), gate_q.float())
    assert torch.equal(fp8.gate_up_proj_scale_inv[3, :rows], gate_s)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3"])
def test_the_engine_quantizes_as_the_weight_sync_does(arch, tmp_path: Path):
    """A runner started with ``quantization="fp8"`` holds exactly what the sync sends for its
    checkpoint (``fp8_payload``): loading that payload changes no bit; every payload name
    (weights and scales, experts included) resolves; norms, router, embeddings and head stay
    in the model dtype; its logits are those of the dequantized weights, w8a8."""
    model_dir = make_tiny_model(tmp_path / arch, arch=arch, seed=0, with_tokenizer=False)
    runner = ModelRunner(model_dir, quantization="fp8")
    weights = WeightMap(runner.model)
    payload = fp8_payload(dict(iter_safetensors(model_dir)))
    before = {n: weights.view(n).clone() for n in payload}
    assert weights.load_many(payload.items()) == len(payload)
    for name, tensor in payload.items():
        assert before[name].dtype == tensor.dtype, name
        assert torch.equal(weights.view(name).float(), tensor.float()), name
    fp8_names = {n for n, t in payload.items() if t.dtype == torch.float8_e4m3fn}
    assert any("q_proj" in n for n in fp8_names)
    assert any(".experts." in n for n in fp8_names) == (arch == "qwen3_moe")
    assert not any("norm" in n or "embed" in n or "lm_head" in n or "mlp.gate." in n
                   for n in fp8_names)
    ids = torch.tensor([[3, 5, 7, 11, 13, 17, 19]])
    with torch.no_grad():
        got = runner.model(ids).logits
        exact = ModelRunner(model_dir).model(ids).logits
    assert 1e-4 < (got - exact).abs().max() < 0.1 * exact.abs().max()
    if arch == "qwen3":  # dense: every FP8 matmul is a hookable nn.Linear of the plain model
        plain = ModelRunner(model_dir)
        dequantized = {n: dequantize_blockwise(t, payload[n + "_scale_inv"])
                       for n, t in payload.items() if n in fp8_names}
        WeightMap(plain.model).load_many(dequantized.items())
        for name, module in plain.model.named_modules():
            if f"{name}.weight" in fp8_names:  # round the activations as w8a8 does
                module.register_forward_pre_hook(lambda _, args: (
                    dequantize_activations(*quantize_activations(
                        args[0].reshape(-1, args[0].shape[-1]))).view(args[0].shape),))
        with torch.no_grad():
            assert torch.allclose(plain.model(ids).logits, got, atol=1e-5)


def test_an_fp8_weight_refuses_a_bf16_tensor_and_odd_views_are_refused(tmp_path: Path):
    model_dir = make_tiny_model(tmp_path / "m", arch="qwen3_moe", seed=0, with_tokenizer=False)
    weights = WeightMap(ModelRunner(model_dir, quantization="fp8").model)
    name = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(ValueError, match=r"float8_e4m3fn \(--quantization fp8\).*weight_scale_inv"):
        weights.load(name, torch.zeros(weights.view(name).shape, dtype=torch.bfloat16))
    # a column slice of a fused expert weight, or a transposed view, has no block rows
    assert expert_scale_view((4, 64, 64), (4, 2, 1), (32, 32), (64, 1), 0) is None
    assert expert_scale_view((4, 64, 64), (4, 2, 1), (32, 64), (1, 64), 0) is None
    # up_proj of expert 3: rows 32..63 of [4, 64, 64] -> its own block row 1 of [4, 2, 1]
    assert expert_scale_view((4, 64, 64), (4, 2, 1), (32, 64), (64, 1),
                             3 * 64 * 64 + 32 * 64) == ((1, 1), (1, 1), 3 * 2 + 1)


def test_an_fp8_server_generates_and_reports_its_gemm(tmp_path: Path):
    model_dir = make_tiny_model(tmp_path / "m", arch="qwen3_moe", seed=0)
    server = launch_local_engines(str(model_dir), 1, num_threads=1, log_dir=tmp_path / "logs",
                                  extra_args=["--quantization", "fp8"], ready_timeout_s=120)[0]
    try:
        out = httpx.post(f"{server.url}/generate", json={
            "input_ids": [3, 5, 7], "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
            "return_logprob": True}, timeout=60).json()
        info = httpx.get(f"{server.url}/get_server_info", timeout=30).json()
    finally:
        server.stop()
    assert len(out["output_ids"]) == 6
    assert all(math.isfinite(lp) for lp, _, _ in out["meta_info"]["output_token_logprobs"])
    assert info["quantization"] == "fp8"
    state = info["internal_states"][0]
    assert state["fp8_gemm"] == state["fp8_experts"] == "reference (CPU)"


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3"])
def test_the_native_decoder_takes_fp8_models(tmp_path: Path, arch: str):
    """An FP8 Qwen3-MoE (and dense Qwen3) decodes on the native path (on CUDA inside its decode
    graphs, through the Triton grouped GEMMs and fused FP8 projections:
    tests/gpu/test_fp8_moe_gpu.py) with the HF path's log-probs: to 1e-5 with the activations
    unquantized (w8a16, as the decoder checks its fast kernels), within 0.1 with them rounded to
    e4m3 (w8a8). The two paths compute some activations in another order, so their last bits
    differ on some CPUs (an AVX-512 EPYC, where the dense model's log-probs differ by 0.016:
    an activation landed on the other side of an e4m3 step); a wrong scale or layout moves
    them by whole nats."""
    with unquantized_activations():
        _, gaps = native_and_hf_runners(tmp_path / "w8a16", "cpu", "float32", decode_steps=4,
                                        arch=arch)
    assert max(gaps) < 1e-5, gaps
    _, gaps = native_and_hf_runners(tmp_path / "w8a8", "cpu", "float32", decode_steps=4, arch=arch)
    assert max(gaps) < 0.1, gaps


def test_an_engine_with_ignored_attention_holds_it_as_the_sync_sends_it(tmp_path: Path):
    """``fp8_ignored=("self_attn",)`` (``rollout.fp8_attention=false``): the attention
    projections stay plain linear layers in the model dtype, the MLPs and experts are FP8, and
    the sync's payload for that setting (``fp8_payload(..., ignored)``, what the plan sends)
    loads without changing a bit."""
    from megarl.rollout.local.fp8_layers import Fp8Experts
    from megarl.weights.fp8 import ignored_modules

    model_dir = make_tiny_model(tmp_path / "m", arch="qwen3_moe", seed=0, with_tokenizer=False)
    ignored = ignored_modules(fp8_attention=False)
    runner = ModelRunner(model_dir, quantization="fp8", fp8_ignored=ignored)
    kinds = {name: type(m) for name, m in runner.model.named_modules()}
    assert all(kind is torch.nn.Linear for name, kind in kinds.items()
               if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")))
    assert any(kind is Fp8Experts for kind in kinds.values())
    payload = fp8_payload(dict(iter_safetensors(model_dir)), ignored)
    assert not any("self_attn" in n and n.endswith("_scale_inv") for n in payload)
    assert any(".experts." in n and n.endswith("_scale_inv") for n in payload)
    weights = WeightMap(runner.model)
    before = {n: weights.view(n).clone() for n in payload}
    assert weights.load_many(payload.items()) == len(payload)
    for name, tensor in payload.items():
        assert before[name].dtype == tensor.dtype, name
        assert torch.equal(weights.view(name).float(), tensor.float()), name
    with pytest.raises(ValueError, match="only with quantization=fp8"):
        ModelRunner(model_dir, fp8_ignored=ignored)
