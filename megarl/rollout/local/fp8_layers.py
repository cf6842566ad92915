"""FP8 weights in the embedded engine (``--quantization fp8``, issue 31).

With ``--quantization fp8`` the engine holds every projection that an FP8 checkpoint stores in
FP8 (:func:`megarl.weights.fp8.is_quantized_weight`: attention q/k/v/o, dense and expert
gate/up/down) as ``float8_e4m3fn`` weights with fp32 ``weight_scale_inv`` of 128x128 blocks,
the format of DeepSeek-V3's and Qwen3's FP8 releases and of SGLang's block-FP8 servers, so a
weight sync sends it exactly what it sends such a server (``docs/fp8.md``). Embeddings, norms,
the router and the LM head stay in the model dtype.

A matmul is w8a8 as in SGLang's block-FP8 linear method: each row of the activations is
quantized per group of 128 input features (dynamic scale = group amax / 448), and the product
of the two dequantized operands is accumulated in fp32:

- :func:`fp8_matmul_reference` computes exactly that with fp32 torch ops: the CPU path, and
  the reference of the tests;
- on CUDA, :func:`fp8_linear` uses cuBLAS's block-scaled GEMM with DeepSeek's (1x128, 128x128)
  recipe (SM90, CUDA >= 12.9) through ``torch.nn.functional.scaled_mm`` (or, in a torch without
  it, ``torch._scaled_mm`` for weights whose K is a multiple of 512), after a one-time check
  against the reference on this device; where that check fails the reference runs there too,
  and :func:`gemm_backend` says which one runs and why.

:class:`Fp8Linear` replaces an ``nn.Linear``; :class:`Fp8Experts` replaces transformers'
fused expert block (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) and keeps its
parameter names, so checkpoint names (``experts.3.gate_proj.weight``) still resolve to views of
the live weights; their scales are ``<param>_scale_inv`` of ``[E, 2 ceil(I/128), ceil(H/128)]``
and ``[E, ceil(H/128), ceil(I/128)]`` (gate's block rows, then up's; SGLang's
``w13_weight_scale_inv`` layout when I is a multiple of 128).
"""

from __future__ import annotations

import importlib.util
import logging
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from megarl.weights.fp8 import (
    BLOCK,
    GROUP,
    dequantize_activations,
    dequantize_blockwise,
    is_quantized_weight,
    quantize_activations,
    quantize_blockwise,
)

logger = logging.getLogger(__name__)


def fp8_matmul_reference(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ W.T (+ bias)`` in ``x.dtype`` for a block-FP8 ``weight [N, K]``: the
    activations quantized per 1x128 group, both operands dequantized, the product in fp32."""
    flat = x.reshape(-1, x.shape[-1])
    acts = dequantize_activations(*quantize_activations(flat))
    out = acts @ dequantize_blockwise(weight, scale_inv).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


def padded_weight_scales(scale_inv: torch.Tensor) -> torch.Tensor:
    """cuBLAS's layout of 128x128 weight scales: ``[L4, N/128]`` with the K blocks contiguous,
    L = ceil(K/128) padded to L4, a multiple of 4 (16-byte aligned columns)."""
    blocks_n, blocks_k = scale_inv.shape
    if blocks_k % 4 == 0 and scale_inv.is_contiguous():
        return scale_inv.t()  # already that layout: no copy in every decode step
    padded = scale_inv.new_zeros(blocks_n, -(-blocks_k // 4) * 4)
    padded[:, :blocks_k] = scale_inv
    return padded.t()


def _scaled_mm(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
               api: str | None = None) -> torch.Tensor:
    """The same product through cuBLAS's (1x128, 128x128) block recipe; K and N must be
    multiples of 128. The activation scales go outer-dim-major (``[M, L]``, stride ``(1, M)``)
    and M is padded to a multiple of 4. ``api``: ``"scaled_mm"`` is
    ``torch.nn.functional.scaled_mm`` with the recipes named and the weight scales padded as
    cuBLAS wants them; ``"_scaled_mm"`` is the older entry point, which infers the recipe from
    the scales' exact shapes and strides and so cannot take padded ones: K / 128 must be a
    multiple of 4 there (:func:`_fits`)."""
    api = api or _Backend.api
    rows = x.shape[0]
    pad = -rows % 4
    if _Backend.triton_quant:  # one launch (fp8_quant_triton), bit for bit the torch ops
        from megarl.rollout.local.fp8_quant_triton import quantize_activations_triton

        quantized, scale_a = quantize_activations_triton(x, 4, scales_outer_major=True)
    else:
        quantized, scale = quantize_activations(F.pad(x, (0, 0, 0, pad)) if pad else x)
        scale_a = scale.t().contiguous().t()
    if api == "scaled_mm":
        from torch.nn.functional import ScalingType

        out = F.scaled_mm(quantized, weight.t(), scale_a, ScalingType.BlockWise1x128,
                          padded_weight_scales(scale_inv), ScalingType.BlockWise128x128,
                          output_dtype=x.dtype)
    else:
        out = torch._scaled_mm(quantized, weight.t(), scale_a=scale_a, scale_b=scale_inv.t(),
                               out_dtype=x.dtype)
    return out[:rows] if pad else out


class _Backend:
    """Which GEMM runs FP8 matmuls on CUDA: decided once per process by :func:`_probe`."""

    lock = threading.Lock()
    scaled_mm: bool | None = None
    api = ""
    reason = "not used yet"
    triton_quant = False
    """Whether the activations are quantized by :mod:`.fp8_quant_triton` (one launch) rather
    than by torch ops: where Triton runs and gives the same bits (:func:`_probe`)."""


def _probe_triton_quant(device: torch.device) -> bool:
    """Whether the one-launch activation quantization runs on ``device`` and equals
    :func:`quantize_activations` bit for bit (rows padded to 4, scales outer-dim-major)."""
    if importlib.util.find_spec("triton") is None:
        return False
    x = torch.randn(6, 384, generator=torch.Generator().manual_seed(1)).to(device, torch.bfloat16)
    x[1, 128:256] = 0  # an all-zero group: scale 1
    try:
        from megarl.rollout.local.fp8_quant_triton import quantize_activations_triton

        got, scales = quantize_activations_triton(x, 4, scales_outer_major=True)
    except Exception as err:  # noqa: BLE001 (any failure of a kernel build or launch)
        logger.warning("FP8 activation quantization in Triton failed (%s); torch ops instead",
                       str(err).splitlines()[0])
        return False
    want, want_scales = quantize_activations(F.pad(x, (0, 0, 0, 2)))
    return (torch.equal(got.view(torch.uint8), want.view(torch.uint8))
            and torch.equal(scales, want_scales) and scales.stride() == (1, 8))


def _fits(k: int) -> bool:
    """Whether the chosen block-scaled GEMM takes a weight of ``k`` inputs (a multiple of 128):
    ``torch._scaled_mm`` only unpadded scales, K / 128 a multiple of 4."""
    return _Backend.api == "scaled_mm" or (k // GROUP) % 4 == 0


def _probe(device: torch.device) -> None:
    """Run each block-scaled entry point once on random data and compare it with the reference:
    ``torch.nn.functional.scaled_mm`` (where torch has it) on a K whose blocks need padding,
    else ``torch._scaled_mm`` on one that needs none. The first that runs and agrees is used;
    where none does, every later matmul takes the reference path, and :func:`gemm_backend`
    says why."""
    _Backend.triton_quant = _probe_triton_quant(device)
    generator = torch.Generator(device="cpu").manual_seed(0)
    failures = []
    apis = (["scaled_mm"] if hasattr(F, "scaled_mm") else []) + ["_scaled_mm"]
    for api in apis:
        k = 384 if api == "scaled_mm" else 512
        x = torch.randn(8, k, generator=generator).to(device, torch.bfloat16)
        weight, scale = quantize_blockwise(torch.randn(256, k, generator=generator).to(device))
        try:
            got = _scaled_mm(x, weight, scale, api=api).float()
        except (RuntimeError, NotImplementedError, TypeError) as err:
            failures.append(f"{api}: {str(err).splitlines()[0]}")
            continue
        want = fp8_matmul_reference(x, weight, scale).float()
        error = float((got - want).norm() / want.norm())
        if error < 2e-2:
            _Backend.scaled_mm, _Backend.api = True, api
            _Backend.reason = ("torch.nn.functional.scaled_mm (1x128, 128x128)"
                               if api == "scaled_mm" else
                               "torch._scaled_mm (1x128, 128x128; weights with K a multiple "
                               "of 512, the rest on the reference)")
            return
        failures.append(f"{api} differs from the reference by {error:.3g} relative")
    _Backend.scaled_mm = False
    _Backend.reason = f"reference ({'; '.join(failures)})"


def gemm_backend(device: torch.device | str = "cuda") -> str:
    """Which FP8 GEMM this process runs on ``device``, and why (the reference on CPU)."""
    return _Backend.reason if torch.device(device).type == "cuda" else "reference (CPU)"


_W8A16 = threading.local()


@contextmanager
def unquantized_activations() -> Iterator[None]:
    """Within the block (in this thread), FP8 layers multiply the activations as they are by
    the dequantized weights (w8a16) instead of w8a8. The native decoder checks its fast decode
    kernels against its reference path so: w8a8 rounds every activation to one of e4m3's eight
    steps per octave, which turns the two paths' bf16 rounding differences into whole steps at
    random places; over a deep model the logits then differ by more than the check's bound
    whatever the kernels do (on the H100 the e2e dense FP8 engine lost FlashAttention and its
    fused kernels that way, and decoded at 0.13x bf16). The FP8 GEMMs have their own checks
    (:func:`_probe`, :func:`_probe_experts`)."""
    previous = getattr(_W8A16, "on", False)
    _W8A16.on = True
    try:
        yield
    finally:
        _W8A16.on = previous


def _unquantized() -> bool:
    return getattr(_W8A16, "on", False)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for a block-FP8 weight (see the module doc for which GEMM runs; w8a16
    inside :func:`unquantized_activations`)."""
    n, k = weight.shape
    if _unquantized():
        return F.linear(x, dequantize_blockwise(weight, scale_inv, x.dtype), bias)
    if x.is_cuda and n % GROUP == 0 and k % GROUP == 0:
        if _Backend.scaled_mm is None:
            with _Backend.lock:
                if _Backend.scaled_mm is None:
                    _probe(x.device)
        if _Backend.scaled_mm and _fits(k):
            out = _scaled_mm(x.reshape(-1, k), weight, scale_inv).view(*x.shape[:-1], n)
            return out if bias is None else out + bias
    return fp8_matmul_reference(x, weight, scale_inv, bias)


class _Experts:
    """Whether :class:`Fp8Experts` on CUDA runs the Triton grouped GEMMs: decided once per
    process by :func:`_probe_experts`."""

    lock = threading.Lock()  # not _Backend's: the probe's reference takes that one
    fused: bool | None = None
    reason = "not used yet"


def _probe_experts(device: torch.device) -> None:
    """Run the grouped GEMMs once on random experts and compare them with
    :meth:`Fp8Experts.reference`; where Triton is missing, fails or disagrees, the experts run
    on the reference (one by one, outside CUDA graphs) and :func:`experts_backend` says why."""
    if importlib.util.find_spec("triton") is None:
        _Experts.fused, _Experts.reason = False, "reference (Triton is not installed)"
        return
    generator = torch.Generator(device="cpu").manual_seed(0)
    block = SimpleNamespace(num_experts=4, hidden_dim=256, intermediate_dim=128, act_fn=F.silu,
                            gate_up_proj=torch.randn(4, 256, 256, generator=generator) * 0.05,
                            down_proj=torch.randn(4, 256, 128, generator=generator) * 0.05)
    experts = Fp8Experts(block).to(device)
    x = torch.randn(8, 256, generator=generator).to(device)
    index = torch.stack([torch.randperm(4, generator=generator)[:2] for _ in range(8)])
    weights = torch.rand(8, 2, generator=generator)
    index, weights = index.to(device), weights.to(device)
    # fp32: the order of the sums differs, and on the GPU both sides sum FP8 products in the
    # tensor cores' precision (measured 0.4% apart on the H200). bf16 (the engine's dtype, a
    # kernel of its own): its roundings move activations to other FP8 values, a few %
    for dtype, bound in ((torch.float32, 2e-2), (torch.bfloat16, 0.1)):
        try:
            got = experts.fused(x.to(dtype), index, weights).float()
        except Exception as err:  # noqa: BLE001 (any failure of a kernel build or launch)
            _Experts.fused = False
            _Experts.reason = f"reference (the grouped GEMMs failed: {str(err).splitlines()[0]})"
            return
        want = experts.reference(x.to(dtype), index, weights).float()
        error = float((got - want).norm() / want.norm())
        if error >= bound:
            _Experts.fused = False
            _Experts.reason = (f"reference (the grouped GEMMs differ from it by {error:.3g} "
                               f"relative in {dtype})")
            return
    _Experts.fused, _Experts.reason = True, "Triton grouped GEMMs (fp8_moe_triton)"


def experts_backend(device: torch.device | str = "cuda") -> str:
    """How this process runs FP8 experts on ``device``, and why (the reference on CPU)."""
    return _Experts.reason if torch.device(device).type == "cuda" else "reference (CPU)"


def fused_experts_available(device: torch.device | str = "cuda") -> bool:
    """Whether :class:`Fp8Experts` on ``device`` runs the grouped GEMMs (CUDA graphs can
    capture those; the reference reads the chosen experts on the host). Probes on first use."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    if _Experts.fused is None:
        with _Experts.lock:
            if _Experts.fused is None:
                _probe_experts(device)
    return bool(_Experts.fused)


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


class Fp8Linear(nn.Module):
    """An ``nn.Linear`` whose weight is block FP8 (``weight`` + ``weight_scale_inv``)."""

    def __init__(self, weight: torch.Tensor, scale_inv: torch.Tensor,
                 bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = _frozen(weight)
        self.weight_scale_inv = _frozen(scale_inv)
        self.bias = None if bias is None else _frozen(bias)

    @classmethod
    def of(cls, linear: nn.Linear) -> Fp8Linear:
        """The quantized copy of ``linear``."""
        weight, scale = quantize_blockwise(linear.weight.detach())
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(weight, scale, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T + b`` with the block-FP8 weight."""
        return fp8_linear(x, self.weight, self.weight_scale_inv, self.bias)


def _quantize_stack(weights: torch.Tensor, parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``weights [E, parts * R, C]`` expert by expert and part by part (gate, up):
    fp8 ``[E, parts * R, C]`` and scales ``[E, parts * ceil(R/128), ceil(C/128)]``."""
    quantized, scales = [], []
    for expert in weights:
        pieces = [quantize_blockwise(p) for p in expert.chunk(parts, dim=0)]
        quantized.append(torch.cat([q for q, _ in pieces]))
        scales.append(torch.cat([s for _, s in pieces]))
    return torch.stack(quantized), torch.stack(scales)


class Fp8Experts(nn.Module):
    """transformers' fused expert block (``gate_up_proj``, ``down_proj``) in block FP8."""

    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self.num_experts = int(experts.num_experts)
        self.hidden_dim = int(experts.hidden_dim)
        self.intermediate_dim = int(experts.intermediate_dim)
        self.act_fn = experts.act_fn
        gate_up, gate_up_scale = _quantize_stack(experts.gate_up_proj.detach(), 2)
        down, down_scale = _quantize_stack(experts.down_proj.detach(), 1)
        self.gate_up_proj = _frozen(gate_up)
        self.gate_up_proj_scale_inv = _frozen(gate_up_scale)
        self.down_proj = _frozen(down)
        self.down_proj_scale_inv = _frozen(down_scale)

    def _expert(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``index``'s SwiGLU MLP on rows ``x [n, H]``."""
        rows = -(-self.intermediate_dim // BLOCK[0])
        size = self.intermediate_dim
        weight, scale = self.gate_up_proj[index], self.gate_up_proj_scale_inv[index]
        gate = fp8_linear(x, weight[:size], scale[:rows])
        up = fp8_linear(x, weight[size:], scale[rows:])
        return fp8_linear(self.act_fn(gate) * up, self.down_proj[index],
                          self.down_proj_scale_inv[index])

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """As transformers' expert block: each chosen expert on its rows, weighted, summed. On
        CUDA with Triton, grouped GEMMs that a CUDA graph captures (:mod:`.fp8_moe_triton`);
        elsewhere, and w8a16 inside :func:`unquantized_activations`, :meth:`reference`."""
        if hidden_states.is_cuda and not _unquantized() and \
                fused_experts_available(hidden_states.device):
            return self.fused(hidden_states, top_k_index, top_k_weights)
        return self.reference(hidden_states, top_k_index, top_k_weights)

    def fused(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
              top_k_weights: torch.Tensor) -> torch.Tensor:
        """The Triton grouped GEMMs (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``)."""
        from megarl.rollout.local.fp8_moe_triton import fp8_moe

        return fp8_moe(hidden_states, top_k_index, top_k_weights, self.gate_up_proj,
                       self.gate_up_proj_scale_inv, self.down_proj, self.down_proj_scale_inv,
                       self.act_fn)

    def reference(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor) -> torch.Tensor:
        """Expert by expert over the experts the batch chose (it reads them on the host: no
        CUDA graph can capture it), each product by :func:`fp8_linear`."""
        out = torch.zeros_like(hidden_states)
        for expert in torch.unique(top_k_index).tolist():
            rows, slot = torch.where(top_k_index == expert)
            y = self._expert(expert, hidden_states[rows]) * top_k_weights[rows, slot, None]
            out.index_add_(0, rows, y.to(out.dtype))
        return out


def _ignored(model: nn.Module) -> list[str]:
    """Module-name substrings a model's ``quantization_config`` keeps unquantized."""
    config = getattr(model.config, "quantization_config", None) or {}
    if not isinstance(config, dict):
        config = config.to_dict()
    return list(config.get("ignored_layers") or config.get("modules_to_not_convert") or [])


def quantize_model(model: nn.Module, ignored: Sequence[str] = ()) -> int:
    """Replace, in place, every linear layer an FP8 checkpoint stores in FP8 by
    :class:`Fp8Linear` and every fused expert block by :class:`Fp8Experts`; returns how many
    modules were replaced. Modules named in ``ignored`` or in the model's own
    ``ignored_layers`` stay as they are. Raises when none was replaced (a model this engine
    cannot quantize)."""
    ignored = [*_ignored(model), *ignored]
    replaced = 0
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if isinstance(child, nn.Linear) and is_quantized_weight(
                    f"{full}.weight", child.weight, ignored):
                setattr(module, child_name, Fp8Linear.of(child))
                replaced += 1
            elif (child_name == "experts" and hasattr(child, "gate_up_proj")
                  and child.gate_up_proj.dim() == 3 and not any(s in full for s in ignored)):
                if getattr(child, "is_transposed", False) or getattr(child, "has_bias", False):
                    raise ValueError(f"{full}: FP8 experts with transposed weights or biases "
                                     "are not supported by the embedded engine")
                setattr(module, child_name, Fp8Experts(child))
                replaced += 1
    if not replaced:
        raise ValueError("--quantization fp8: the model has no projection an FP8 checkpoint "
                         "quantizes (q/k/v/o_proj, gate/up/down_proj, experts)")
    device = next(model.parameters()).device
    if device.type == "cuda" and _Backend.scaled_mm is None:
        _probe(device)  # now, not inside the first CUDA-graph capture
    if device.type == "cuda" and any(isinstance(m, Fp8Experts) for m in model.modules()):
        fused_experts_available(device)  # the same
    return replaced


def expert_scale_view(weight_shape: tuple[int, ...], scale_shape: tuple[int, ...],
                      size: tuple[int, ...], stride: tuple[int, ...], offset: int
                      ) -> tuple[tuple[int, ...], tuple[int, ...], int] | None:
    """(size, stride, offset) in the scales ``[E, SR, SC]`` of a fused FP8 expert weight
    ``[E, R, C]`` for the strided view ``(size, stride, offset)`` of one expert's rows
    ``[r0, r0 + n)`` (a checkpoint tensor such as ``experts.3.up_proj.weight``); None when the
    view is not a block of whole rows. Each part of a fused weight starts on its own block
    grid, so the scales of rows from ``r0`` start at block row ``ceil(r0 / 128)``."""
    if len(weight_shape) != 3 or len(size) != 2:
        return None
    experts, rows, cols = weight_shape
    if tuple(stride) != (cols, 1) or size[1] != cols:
        return None
    expert, rest = divmod(offset, rows * cols)
    first_row, first_col = divmod(rest, cols)
    block_rows = -(-size[0] // BLOCK[0])
    start = -(-first_row // BLOCK[0])
    _, scale_rows, scale_cols = scale_shape
    if first_col or expert >= experts or start + block_rows > scale_rows:
        return None
    return ((block_rows, scale_cols), (scale_cols, 1),
            expert * scale_rows * scale_cols + start * scale_cols)
