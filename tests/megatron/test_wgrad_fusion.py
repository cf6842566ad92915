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


def _experts(buffer_order: str, experts: int = 4, out: int = 8, inp: int = 4):
    """Expert weights whose ``main_grad`` are views of one buffer, laid out as megatron's DDP
    does (``reverse``: the last parameter first), or apart (``apart``)."""
    g = torch.Generator().manual_seed(1)
    weights = [torch.nn.Parameter(torch.randn(out, inp, generator=g)) for _ in range(experts)]
    buffer = torch.randn(experts * out * inp + 16, generator=g)  # what earlier steps added
    n = out * inp
    for k, w in enumerate(weights):
        slot = {"forward": k, "reverse": experts - 1 - k}.get(buffer_order)
        w.main_grad = (buffer[8 + slot * n: 8 + (slot + 1) * n].view(out, inp)
                       if slot is not None else torch.randn(out, inp, generator=g))
    return weights


def test_expert_weight_gradients_are_added_into_the_ddp_buffer_in_one_view():
    from megarl.megatron.wgrad_fusion import stacked_main_grads

    for order, reverse in (("forward", False), ("reverse", True)):
        weights = _experts(order)
        view, got_reverse = stacked_main_grads(weights)
        assert got_reverse is reverse
        for k, w in enumerate(weights):
            assert torch.equal(view[len(weights) - 1 - k if reverse else k], w.main_grad)
    assert stacked_main_grads(_experts("apart")) is None


def test_the_fused_grouped_gemm_backward_adds_each_experts_gradient_once():
    """The native spec's grouped expert GEMM with ``fuse_wgrad``: every expert's ``main_grad``
    grows by exactly ``g_e^T x_e`` (an expert no row chose by zero), autograd gets no weight
    gradient (DDP's hook would add it a second time), and the input gradient is unchanged;
    in DDP's reverse layout, in one forward layout and with buffers apart."""
    from megarl.megatron.native_modules import grouped_linear

    splits = torch.tensor([5, 0, 3, 8])
    g = torch.Generator().manual_seed(2)
    x = torch.randn(16, 4, generator=g)
    grad_out = torch.randn(16, 8, generator=g)
    for order in ("reverse", "forward", "apart"):
        weights = _experts(order)
        before = [w.main_grad.clone() for w in weights]
        xs = [x.clone().requires_grad_() for _ in range(2)]
        grouped_linear(xs[0], weights, splits, fuse_wgrad=True).backward(grad_out)
        assert all(w.grad is None for w in weights)
        for k, (w, rows) in enumerate(zip(weights, x.split(splits.tolist()), strict=True)):
            want = before[k] + grad_out.split(splits.tolist())[k].t() @ rows
            torch.testing.assert_close(w.main_grad, want, rtol=1e-5, atol=1e-5)
            assert w.grad_added_to_main_grad
        assert torch.equal(weights[1].main_grad, before[1])  # no row chose expert 1
        # the unfused path: the same input gradient, the weight gradients handed to autograd
        grouped_linear(xs[1], weights, splits).backward(grad_out)
        torch.testing.assert_close(xs[0].grad, xs[1].grad)
        for w, m, b in zip(weights, (w.main_grad for w in weights), before, strict=True):
            torch.testing.assert_close(w.grad, m - b, rtol=1e-5, atol=1e-5)


def test_a_cuda_graph_of_the_chunk_switches_the_fused_layers_back():
    """GraphedChunk differentiates leaf copies of the weights (no main_grad): the layers that
    fuse_weight_gradients switched hand their gradients to autograd again."""
    from megatron.core.tensor_parallel import layers

    from megarl.megatron.cuda_graphs import GraphedChunk
    from megarl.megatron.wgrad_fusion import unfuse_weight_gradients

    class Grouped(torch.nn.Module):
        fuse_wgrad = False

    chunk = torch.nn.Sequential(Grouped(), Grouped(), torch.nn.Linear(2, 2))
    chunk[0].fuse_wgrad = True
    linear = layers.ColumnParallelLinear.__new__(layers.ColumnParallelLinear)
    torch.nn.Module.__init__(linear)
    linear.gradient_accumulation_fusion = True
    chunk.append(linear)
    GraphedChunk(chunk, emulate=True)
    assert not chunk[0].fuse_wgrad and not linear.gradient_accumulation_fusion
    assert unfuse_weight_gradients(chunk) == 0


def test_experts_no_row_chose_get_zero_gradients_where_the_kernel_is_unchecked(monkeypatch):
    """Where the grouped GEMM has not been checked to write zeros for empty groups (here: its
    result claimed unknown and the check unavailable, as inside a CUDA graph capture), the
    backward zeroes those experts' gradients itself; a checked device skips the pass."""
    from megarl.megatron import native_modules

    per_expert = torch.full((3, 2, 2), float("nan"))
    offs = torch.tensor([2, 2, 5], dtype=torch.int32)  # expert 1 has no row
    monkeypatch.setattr(native_modules, "_empty_groups_zeroed", lambda device, may_check=True: False)
    out = native_modules._zero_unused(per_expert.clone(), offs)
    assert torch.equal(out[1], torch.zeros(2, 2)) and out[0].isnan().all()
    monkeypatch.setattr(native_modules, "_empty_groups_zeroed", lambda device, may_check=True: True)
    assert native_modules._zero_unused(per_expert.clone(), offs)[1].isnan().all()
    monkeypatch.undo()
    # the CPU's grouped GEMM multiplies group by group: an empty group's product is zero
    assert native_modules._empty_groups_zeroed(torch.device("cpu"))
