"""Weight gradients accumulated straight into megatron DDP's fp32 ``main_grad`` buffers.

Megatron's ``gradient_accumulation_fusion`` computes a linear layer's weight gradient with one
GEMM that adds into ``weight.main_grad`` (fp32), through apex's ``fused_weight_gradient_mlp_cuda``
extension (or TransformerEngine's own linear layers). Without either, the weight gradient is a
bf16 tensor that DDP's backward hook then adds into the fp32 buffer: per weight and micro-batch
one more write and two more reads (on the dense e2e shape's update, 11.6% of the device time of a
forward + backward went to ``add_``). Here the same accumulation is one cuBLAS GEMM with beta = 1
and an fp32 output (``torch.addmm``'s ``out_dtype``), given to megatron's linear layers in the
extension's place; :func:`accumulate_weight_grad` is also what the chunked output layer
(:mod:`~megarl.megatron.output_log_probs`) adds its weight gradient with.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

logger = logging.getLogger(__name__)


def accumulate_weight_grad(main_grad: torch.Tensor, grad_output: torch.Tensor,
                           total_input: torch.Tensor) -> None:
    """``main_grad [out, in] += grad_output^T @ total_input`` for ``grad_output [N, out]`` and
    ``total_input [N, in]``, accumulated in ``main_grad``'s dtype (fp32 from bf16 inputs: CUDA
    only, as torch's ``out_dtype``)."""
    if main_grad.dtype == grad_output.dtype:
        main_grad.addmm_(grad_output.t(), total_input)
    else:
        torch.ops.aten.addmm.dtype_out(main_grad, grad_output.t(), total_input, main_grad.dtype,
                                       out=main_grad)


_WORKS: bool | None = None


def _works_here() -> bool:
    """Whether the bf16 GEMM with an fp32 output accumulates correctly on this GPU and torch
    (checked once on a small problem; a torch without ``out_dtype`` keeps DDP's unfused path,
    with a warning)."""
    global _WORKS
    if _WORKS is None:
        try:
            g = torch.Generator(device="cuda").manual_seed(0)
            grad_output, total_input = (torch.randn(256, n, device="cuda", generator=g)
                                        .bfloat16() for n in (64, 32))
            main_grad = torch.ones(64, 32, device="cuda")
            accumulate_weight_grad(main_grad, grad_output, total_input)
            want = 1 + grad_output.float().t() @ total_input.float()
            _WORKS = bool(torch.allclose(main_grad, want, rtol=1e-3, atol=1e-2))
        except (RuntimeError, TypeError) as err:
            logger.warning("weight gradients stay unfused (DDP adds them): %s", err)
            _WORKS = False
    return _WORKS


def accumulates_into(weight: torch.Tensor) -> bool:
    """Whether :func:`accumulate_weight_grad` can add ``weight``'s gradient into its
    ``main_grad`` here (same dtype anywhere; bf16 into fp32 on a GPU where it works)."""
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None:
        return False
    return main_grad.dtype == weight.dtype or (weight.is_cuda and _works_here())


class _Extension:
    """The two functions megatron's linear layers call of ``fused_weight_gradient_mlp_cuda``."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor,
                              main_grad: torch.Tensor) -> None:
        accumulate_weight_grad(main_grad, grad_output, total_input)

    wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp32


def fuse_weight_gradients(chunks: Iterable[torch.nn.Module]) -> int:
    """Make the Column/RowParallelLinear layers of DDP-wrapped ``chunks`` (whose weights have a
    ``main_grad``) accumulate their weight gradients into it; returns the layers switched.

    CUDA only (megatron's fused path allocates its placeholder gradients there). Layers without a
    weight of their own (a tied output layer: the embedding's gradient arrives in the same
    accumulation, which a placeholder would spoil) and frozen weights are left alone; so are CUDA
    graphs, whose captured backward would keep the buffer's address across offloads (the caller
    does not switch them on). Where apex's extension is installed, megatron uses it unchanged.
    """
    if not torch.cuda.is_available() or not _works_here():
        return 0
    from megatron.core.tensor_parallel import layers

    if not getattr(layers, "_grad_accum_fusion_available", False) or not hasattr(
            layers, "fused_weight_gradient_mlp_cuda"):
        layers.fused_weight_gradient_mlp_cuda = _Extension
        layers._grad_accum_fusion_available = True
    switched = 0
    for chunk in chunks:
        for module in chunk.modules():
            weight = getattr(module, "weight", None)
            if (isinstance(module, layers.ColumnParallelLinear | layers.RowParallelLinear)
                    and isinstance(weight, torch.nn.Parameter) and weight.requires_grad
                    and weight.is_cuda and hasattr(weight, "main_grad")):
                module.gradient_accumulation_fusion = True
                switched += 1
    return switched
