"""Weight-gradient accumulation into fp32 ``main_grad`` (megarl/megatron/wgrad_fusion.py) on the
CPU: the GEMM adds in place to what the buffer held; megatron's linear layers are switched on
CUDA only (tests/gpu/test_wgrad_fusion_gpu.py runs them there)."""

from __future__ import annotations

import torch

from megarl.megatron.wgrad_fusion import _Extension, accumulate_weight_grad, fuse_weight_gradients


def test_the_weight_gradient_adds_into_the_buffer_in_place():
    g = torch.Generator().manual_seed(0)
    grad_output, total_input = torch.randn(37, 6, generator=g), torch.randn(37, 5, generator=g)
    main_grad = torch.randn(6, 5, generator=g)
    before, address = main_grad.clone(), main_grad.data_ptr()
    accumulate_weight_grad(main_grad, grad_output, total_input)
    assert main_grad.data_ptr() == address
    torch.testing.assert_close(main_grad, before + grad_output.t() @ total_input)
    # megatron's call order: (total_input, grad_output, main_grad), twice accumulates twice
    _Extension.wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)
    torch.testing.assert_close(main_grad, before + 2 * grad_output.t() @ total_input)


def test_no_layer_is_switched_without_cuda():
    layer = torch.nn.Linear(4, 4)
    layer.weight.main_grad = torch.zeros(4, 4)
    assert fuse_weight_gradients([layer]) == 0


def test_the_output_layer_fuses_only_where_the_accumulation_runs():
    from megarl.megatron.wgrad_fusion import accumulates_into

    weight = torch.nn.Parameter(torch.zeros(4, 3))
    assert not accumulates_into(weight)  # no DDP buffer
    weight.main_grad = torch.zeros(4, 3)
    assert accumulates_into(weight)  # fp32 into fp32: a plain addmm_
    half = torch.nn.Parameter(torch.zeros(4, 3, dtype=torch.bfloat16))
    half.main_grad = torch.zeros(4, 3)
    assert not accumulates_into(half)  # bf16 into fp32 needs the GPU's out_dtype GEMM
