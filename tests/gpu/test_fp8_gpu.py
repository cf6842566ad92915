"""FP8 rollout on the H200 (issue 31): the block-FP8 GEMM the embedded engine picks on CUDA, and
an FP8 engine on the GPU. cuBLAS's (1x128, 128x128) recipe (``torch.nn.functional.scaled_mm``,
or ``torch._scaled_mm`` in an older torch) needs SM90 and CUDA >= 12.9; where it does not run,
``gemm_backend()`` says why and the first test fails with that reason (the engine still runs,
on the slow reference)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from megarl.data.tiny_model import make_tiny_model
from megarl.rollout.local import fp8_layers
from megarl.rollout.local.launch import launch_local_engines
from megarl.weights.fp8 import quantize_blockwise


@pytest.mark.parametrize("k", [2048, 384])  # 384: 3 blocks of K, scales padded to 4 for cuBLAS
def test_scaled_mm_runs_the_block_recipe_and_matches_the_reference(k):
    torch.manual_seed(0)
    x = torch.randn(37, k, device="cuda", dtype=torch.bfloat16)  # M not a multiple of 4
    weight, scale = quantize_blockwise(torch.randn(768, k, device="cuda") * 0.02)
    got = fp8_layers.fp8_linear(x, weight, scale)
    assert fp8_layers.gemm_backend().startswith("torch."), fp8_layers.gemm_backend()
    want = fp8_layers.fp8_matmul_reference(x, weight, scale)
    error = float((got.float() - want.float()).norm() / want.float().norm())
    assert got.dtype == torch.bfloat16 and got.shape == (37, 768)
    assert error < 1e-2, error
    print(k, fp8_layers.gemm_backend(), f"relative error {error:.2e}")


def test_an_fp8_engine_generates_on_the_gpu(tmp_path: Path):
    """A dense model whose projections are multiples of 128 (the _scaled_mm path) and a MoE one
    (FP8 experts: the Triton grouped GEMMs) both serve greedy requests in FP8."""
    dims = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 64}
    for arch, extra in (("qwen3", {}), ("qwen3_moe", {"moe_intermediate_size": 128})):
        model_dir = make_tiny_model(tmp_path / arch, arch=arch, seed=0, **dims, **extra)
        server = launch_local_engines(str(model_dir), 1, device="cuda", log_dir=tmp_path / "logs",
                                      extra_args=["--quantization", "fp8", "--dtype",
                                                  "bfloat16"], ready_timeout_s=300)[0]
        try:
            out = httpx.post(f"{server.url}/generate", json={
                "input_ids": [[3, 5, 7], [11, 13]], "sampling_params": {
                    "max_new_tokens": 16, "temperature": 0, "ignore_eos": True}},
                timeout=120).json()
            info = httpx.get(f"{server.url}/get_server_info", timeout=30).json()
        finally:
            server.stop()
        assert [len(o["output_ids"]) for o in out] == [16, 16], arch
        assert info["internal_states"][0]["fp8_gemm"].startswith("torch."), info
        if arch == "qwen3_moe":
            assert info["internal_states"][0]["fp8_experts"].startswith("Triton"), info


def test_quantization_gives_the_same_bits_on_the_gpu_as_on_the_cpu():
    """A weight sync quantizes on the GPU what a reference quantizes on the CPU. torch divides
    a CUDA tensor by a number through its reciprocal (an ulp off the quotient for about half of
    all amaxes), so ``megarl.weights.fp8`` divides by a tensor: here 2,048 blocks and 65,536
    activation groups whose amaxes spread over every mantissa give the same bytes on both."""
    from megarl.weights.fp8 import quantize_activations

    g = torch.Generator().manual_seed(3)
    weight = torch.randn(4096, 8192, generator=g)
    block_size = torch.rand(32, 1, 64, 1, generator=g) + 0.5  # each block's amax on its own
    weight *= block_size.expand(32, 128, 64, 128).reshape(4096, 8192)  # mantissa
    acts = torch.randn(1024, 8192, generator=g).bfloat16()
    for quantize, x in ((quantize_blockwise, weight), (quantize_activations, acts)):
        (q_cpu, s_cpu), (q_gpu, s_gpu) = quantize(x), quantize(x.cuda())
        assert torch.equal(q_cpu.view(torch.uint8), q_gpu.cpu().view(torch.uint8)), quantize
        assert torch.equal(s_cpu, s_gpu.cpu()), quantize
