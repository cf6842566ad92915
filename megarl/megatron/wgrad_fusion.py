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

The grouped expert layers of the native spec (one ``weight{k}`` parameter per expert) get their
weight gradients from one grouped GEMM; unfused, DDP's hook then adds each expert's (transposed)
slice of it into that expert's ``main_grad``, one kernel and one hook per expert and micro-batch.
Fused (:func:`add_expert_grads`), the GEMM writes them in the parameters' layout and one add puts
all of them into DDP's buffer, which holds a layer's experts back to back.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Sequence

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


def stacked_view(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, bool] | None:
    """``tensors`` (same shape, dtype and storage, each contiguous) as one ``[E, *shape]`` view
    when they lie back to back, and whether in reverse order; None when they do not."""
    first = tensors[0]
    if not all(t is not None and t.shape == first.shape and t.dtype == first.dtype
               and t.is_contiguous() and t.device == first.device
               and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
               for t in tensors):
        return None
    n, offsets = first.numel(), [t.storage_offset() for t in tensors]
    shape, strides = (len(tensors), *first.shape), (n, *first.stride())
    if all(b - a == n for a, b in itertools.pairwise(offsets)):
        return first.as_strided(shape, strides, offsets[0]), False
    if all(a - b == n for a, b in itertools.pairwise(offsets)):
        return tensors[-1].as_strided(shape, strides, offsets[-1]), True
    return None


def stacked_main_grads(weights: Sequence[torch.Tensor]) -> tuple[torch.Tensor, bool] | None:
    """The ``main_grad`` buffers of ``weights`` as one :func:`stacked_view` (DDP lays out a
    grouped layer's experts back to back); None when they are not."""
    grads = [getattr(w, "main_grad", None) for w in weights]
    return None if any(g is None for g in grads) else stacked_view(grads)


def add_expert_grads(weights: Sequence[torch.Tensor], per_expert: torch.Tensor) -> None:
    """``weights[k].main_grad += per_expert[k]`` for every expert ``k`` (``per_expert``:
    ``[E, out, in]`` in the weights' layout), as one add where DDP's buffer holds the experts
    back to back, and mark each as added (DDP's hook then skips the gradient it is handed)."""
    stacked = stacked_main_grads(weights)
    if stacked is None:
        for weight, grad in zip(weights, per_expert.unbind(0), strict=True):
            weight.main_grad.add_(grad)
    else:
        view, reverse = stacked
        view.add_(per_expert.flip(0) if reverse else per_expert)
    for weight in weights:
        weight.grad_added_to_main_grad = True


class _Extension:
    """The two functions megatron's linear layers call of ``fused_weight_gradient_mlp_cuda``."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor,
                              main_grad: torch.Tensor) -> None:
        accumulate_weight_grad(main_grad, grad_output, total_input)

    wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp32


def fuse_weight_gradients(chunks: Iterable[torch.nn.Module]) -> int:
    """Make the linear layers of DDP-wrapped ``chunks`` (whose weights have a ``main_grad``)
    accumulate their weight gradients into it; returns the layers switched.

    The native spec's grouped expert layers switch on any device (:func:`add_expert_grads`),
    under a DDP without ``overlap_grad_reduce``.
    megatron's Column/RowParallelLinear layers on CUDA only (megatron's fused path allocates its
    placeholder gradients there). Layers without a weight of their own (a tied output layer: the
    embedding's gradient arrives in the same accumulation, which a placeholder would spoil) and
    frozen weights are left alone; so are CUDA graphs, whose captured backward would keep the
    buffer's address across offloads (the caller does not switch them on). Where apex's
    extension is installed, megatron uses it unchanged.
    """
    chunks = list(chunks)
    switched = 0
    for chunk in chunks:
        ddp_config = getattr(chunk, "ddp_config", None)
        if ddp_config is None or ddp_config.overlap_grad_reduce:
            continue  # the grouped path hands autograd no gradient: DDP's hook must not wait
        for module in chunk.modules():
            # native_modules' grouped linear layers: a fuse_wgrad flag and their weights
            if isinstance(getattr(module, "fuse_wgrad", None), bool) and all(
                    w.requires_grad and hasattr(w, "main_grad") for w in module._weights()):
                module.fuse_wgrad = True
                switched += 1
    if not torch.cuda.is_available() or not _works_here():
        return switched
    from megatron.core.tensor_parallel import layers

    if not getattr(layers, "_grad_accum_fusion_available", False) or not hasattr(
            layers, "fused_weight_gradient_mlp_cuda"):
        layers.fused_weight_gradient_mlp_cuda = _Extension
        layers._grad_accum_fusion_available = True
    for chunk in chunks:
        for module in chunk.modules():
            weight = getattr(module, "weight", None)
            if (isinstance(module, layers.ColumnParallelLinear | layers.RowParallelLinear)
                    and isinstance(weight, torch.nn.Parameter) and weight.requires_grad
                    and weight.is_cuda and hasattr(weight, "main_grad")):
                module.gradient_accumulation_fusion = True
                switched += 1
    return switched


def unfuse_weight_gradients(chunk: torch.nn.Module) -> int:
    """Switch every layer of ``chunk`` that :func:`fuse_weight_gradients` switched back to
    handing its weight gradients to autograd; returns how many were fused. A CUDA graph of the
    chunk (:class:`~megarl.megatron.cuda_graphs.GraphedChunk`) differentiates leaf copies of the
    weights, which have no ``main_grad`` to add into."""
    from megatron.core.tensor_parallel import layers

    switched = 0
    for module in chunk.modules():
        linear = isinstance(module, layers.ColumnParallelLinear | layers.RowParallelLinear)
        flag = "gradient_accumulation_fusion" if linear else "fuse_wgrad"
        if getattr(module, flag, None) is True:
            setattr(module, flag, False)
            switched += 1
    return switched
