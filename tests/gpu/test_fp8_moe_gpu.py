"""The block-FP8 experts' Triton grouped GEMMs on CUDA (issue 31): against the expert-by-expert
reference (the checks of tests/rollout/fp8_moe_checks.py, which CI runs through Triton's
interpreter), inside a CUDA graph, and in the embedded engine's native decoder, which now runs
FP8 MoE models in its decode graphs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rollout"))

import fp8_moe_checks as checks

from megarl.rollout.local import fp8_layers


def test_sort_by_expert_groups_every_pair_once():
    checks.check_sort_by_expert("cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemms_equal_the_expert_by_expert_reference(dtype):
    print(dtype, checks.check_fused_matches_reference("cuda", dtype))


def test_grouped_gemms_replay_in_a_cuda_graph():
    """Captured once, replayed with other routes and inputs: the eager result each time."""
    module = checks.random_experts(16, 256, 128, "cuda")
    x = torch.zeros(24, 256, device="cuda", dtype=torch.bfloat16)
    index = torch.zeros(24, 4, device="cuda", dtype=torch.long)
    weights = torch.zeros(24, 4, device="cuda")
    new = [(torch.randn(24, 256, device="cuda", dtype=torch.bfloat16),
            *checks.random_routes(24, 16, 4, "cuda", seed=s)) for s in range(3)]
    x.copy_(new[0][0]), index.copy_(new[0][1]), weights.copy_(new[0][2])
    checks.fused(module, x, index, weights)  # compiles the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = checks.fused(module, x, index, weights)
    for inputs, routes, route_weights in new:
        x.copy_(inputs), index.copy_(routes), weights.copy_(route_weights)
        graph.replay()
        assert torch.equal(out, checks.fused(module, inputs, routes, route_weights))


def test_the_activation_quantization_kernel_rounds_as_torch_does():
    """On the GPU, random inputs: the one-launch quantization gives the torch ops' bits, and the
    engine's probe picks it for the block-scaled GEMMs."""
    checks.check_quantize_activations("cuda", exact=False)
    assert fp8_layers._probe_triton_quant(torch.device("cuda"))


def test_the_one_launch_w8a8_linear_is_the_reference_product():
    checks.check_linear_triton("cuda", exact=False)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3"])
def test_the_native_decoder_runs_fp8_in_its_graphs(tmp_path, arch):
    """A Qwen3-MoE (and a dense Qwen3) engine in FP8 decodes on the native path, every decode
    graph captured, with the HF path's next-token log-probs (both run the grouped GEMMs and the
    block-scaled GEMMs; the native path's q/k/v and gate/up fused)."""
    runners, gaps = checks.native_and_hf_runners(tmp_path, "cuda", "bfloat16", decode_steps=6,
                                                 arch=arch)
    assert max(gaps) < 0.1, gaps
    native = runners[0].native
    assert native.use_graphs and native.graphs.capture_failures == 0
    # the check of the fast kernels runs FP8 layers w8a16 (unquantized_activations): kept
    assert native.flash and native.fast_kernels
    fused = native._fused_layers()[0]
    assert fused.qkv.scale_inv is not None
    assert (fused.gate_up is not None) == (arch == "qwen3")
    if arch == "qwen3_moe":
        assert fp8_layers.experts_backend() == "Triton grouped GEMMs (fp8_moe_triton)"
