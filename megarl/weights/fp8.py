"""Blockwise FP8 weights in the format of DeepSeek-V3's and Qwen3's FP8 releases.

A quantized linear weight ``W`` [out, in] is stored as two tensors:

- ``<module>.weight``: ``torch.float8_e4m3fn``, same shape as ``W``;
- ``<module>.weight_scale_inv``: ``float32`` [ceil(out / 128), ceil(in / 128)], one number per
  128 x 128 block (the last block of a dimension that is not a multiple of 128 is smaller). It
  is the *dequantization* multiplier: ``W[block] ~= weight[block].float() * scale_inv[block]``.

A block's scale is ``amax / 448`` (448 = the largest e4m3 value), so its largest element maps
onto +-448 exactly; an all-zero block gets scale 1 (any scale reproduces zeros, and 0 would
divide 0 by 0). The division is IEEE's on every device: torch divides a CUDA tensor by a Python
number as a product with the number's fp32 reciprocal, an ulp off the quotient for about half of
all amaxes (and then a dequantized weight no longer quantizes to the same scale), while a weight
sync quantizes on the GPU what a reference quantizes on the CPU. The config.json of such a checkpoint carries :data:`QUANTIZATION_CONFIG`.
docs/fp8.md says which SGLang code reads these names and how it was checked.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
BLOCK: tuple[int, int] = (128, 128)
SCALE_SUFFIX = "_scale_inv"
"""``<module>.weight`` -> ``<module>.weight_scale_inv``."""
QUANTIZATION_CONFIG: dict = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                             "weight_block_size": list(BLOCK)}
"""``quantization_config`` of config.json for weights in this format (as DeepSeek-V3 ships it)."""

ATTENTION_MODULE = "self_attn"
"""The HF module name of every supported architecture's attention block (Qwen, Llama, Mixtral,
DeepSeek's MLA): what ``rollout.fp8_attention=false`` keeps out of FP8, as config.json's
``ignored_layers`` entry (SGLang matches it as a substring of the layer names)."""


def ignored_modules(fp8_attention: bool = True) -> tuple[str, ...]:
    """The ``ignored_layers`` of FP8 engines for ``rollout.fp8_attention``."""
    return () if fp8_attention else (ATTENTION_MODULE,)

QUANTIZED_PROJECTIONS = frozenset({
    "q_proj", "k_proj", "v_proj", "o_proj",  # attention (GQA)
    "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",  # MLA (o_proj as above)
    "gate_proj", "up_proj", "down_proj",  # MLP, routed and shared experts
})
"""Linear modules whose weight an FP8 checkpoint stores in FP8. Everything else stays in the
model dtype: embeddings, lm_head, norms, the router (``mlp.gate``), Qwen2-MoE's
``shared_expert_gate``, biases, DeepSeek's ``e_score_correction_bias``."""
EXPERT_PROJECTIONS = frozenset({"w1", "w2", "w3"})
"""Mixtral's expert projections (``block_sparse_moe.experts.<e>.w1``), quantized as experts."""


def scale_name(weight_name: str) -> str:
    """The name of the scale tensor that belongs to ``weight_name``."""
    return weight_name + SCALE_SUFFIX


def scale_shape(shape: Sequence[int], block: Sequence[int] = BLOCK) -> tuple[int, int]:
    """[ceil(out / block_out), ceil(in / block_in)] for a weight of ``shape`` [out, in]."""
    rows, cols = shape
    return -(-rows // block[0]), -(-cols // block[1])


def is_quantized_weight(name: str, tensor: torch.Tensor, ignored: Sequence[str] = ()) -> bool:
    """Whether an FP8 checkpoint stores the HF tensor ``name`` in FP8: a 2-D ``.weight`` of an
    attention or MLP/expert projection (:data:`QUANTIZED_PROJECTIONS`), unless its module name
    contains one of ``ignored`` (config.json's ``ignored_layers`` / ``modules_to_not_convert``,
    matched as SGLang's ``is_layer_skipped`` does: by substring)."""
    return is_quantized_shape(name, tensor.shape, ignored)


def is_quantized_shape(name: str, shape: Sequence[int], ignored: Sequence[str] = ()) -> bool:
    """:func:`is_quantized_weight` for a tensor of ``shape`` not at hand (a weight-sync plan)."""
    if len(shape) != 2 or not name.endswith(".weight"):
        return False
    module = name.removesuffix(".weight")
    projection = module.rsplit(".", 1)[-1]
    wanted = projection in QUANTIZED_PROJECTIONS or (
        projection in EXPERT_PROJECTIONS and ".experts." in module)
    return wanted and not any(skip in module for skip in ignored)


def _blocks(tensor: torch.Tensor, block: Sequence[int]) -> torch.Tensor:
    """``tensor`` [out, in] zero-padded to whole blocks, viewed as [rows, block_out, cols,
    block_in] (fp32)."""
    rows, cols = scale_shape(tensor.shape, block)
    padded = torch.zeros(rows * block[0], cols * block[1], dtype=torch.float32,
                         device=tensor.device)
    padded[:tensor.shape[0], :tensor.shape[1]] = tensor
    return padded.view(rows, block[0], cols, block[1])


def _to_fp8(values: torch.Tensor, dims: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``values`` divided by the scale ``amax / 448`` of each group spanning ``dims`` (kept
    as size 1; an all-zero group gets scale 1) and rounded to e4m3: (fp8 values, scales)."""
    amax = values.abs().amax(dim=tuple(dims), keepdim=True)
    # a tensor divisor: torch on CUDA turns a division by a number into a reciprocal product
    scale = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    # |values / scale| <= 448 up to fp32 rounding; the clamp keeps a rounding above 448 from
    # turning into NaN (e4m3fn has no infinity)
    return (values / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_blockwise(weight: torch.Tensor, block: Sequence[int] = BLOCK
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, fp32 ``weight_scale_inv``) of a 2-D ``weight`` (any float dtype): each block
    is divided by its scale ``amax / 448`` and rounded to the nearest e4m3 value."""
    if weight.dim() != 2:
        raise ValueError(f"blockwise FP8 quantizes 2-D weights; got shape {list(weight.shape)}")
    if not torch.isfinite(weight).all():
        raise ValueError("blockwise FP8: the weight holds inf or NaN")
    blocks = _blocks(weight, block)
    quantized, scale = _to_fp8(blocks, (1, 3))
    rows, cols = weight.shape
    quantized = quantized.view(blocks.shape[0] * block[0], -1)[:rows, :cols].contiguous()
    return quantized, scale.view(blocks.shape[0], blocks.shape[2]).contiguous()


def dequantize_blockwise(quantized: torch.Tensor, scale_inv: torch.Tensor,
                         dtype: torch.dtype = torch.float32,
                         block: Sequence[int] = BLOCK) -> torch.Tensor:
    """The weight an FP8 tensor and its ``weight_scale_inv`` stand for: each block times its
    scale, computed in fp32, returned in ``dtype``."""
    if quantized.dim() != 2 or tuple(scale_inv.shape) != scale_shape(quantized.shape, block):
        raise ValueError(
            f"weight_scale_inv has shape {list(scale_inv.shape)}; a weight of shape "
            f"{list(quantized.shape)} in {block[0]}x{block[1]} blocks needs "
            f"{list(scale_shape(quantized.shape, block))}")
    rows, cols = quantized.shape
    scales = scale_inv.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return (quantized.float() * scales[:rows, :cols]).to(dtype)


GROUP = 128
"""Input features per activation scale (SGLang's ``per_token_group_quant_fp8`` group)."""


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 ``[M, K]``, fp32 scales ``[M, ceil(K/128)]``) of ``x [M, K]``: each row's groups of
    128 features divided by their amax / 448 (an all-zero group gets scale 1)."""
    rows, cols = x.shape
    groups = -(-cols // GROUP)
    padded = F.pad(x.float(), (0, groups * GROUP - cols)).view(rows, groups, GROUP)
    quantized, scale = _to_fp8(padded, (-1,))
    return quantized.view(rows, -1)[:, :cols], scale.squeeze(-1)


def dequantize_activations(quantized: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 ``[M, K]`` that :func:`quantize_activations`' output stands for."""
    cols = quantized.shape[1]
    return quantized.float() * scale.repeat_interleave(GROUP, dim=1)[:, :cols]


def fp8_payload(bucket: Mapping[str, torch.Tensor], ignored: Sequence[str] = ()
                ) -> dict[str, torch.Tensor]:
    """The tensors an SGLang server of an FP8 block-quantized model loads for ``bucket`` (HF
    name -> bf16/fp32 tensor): every :func:`is_quantized_weight` as its fp8 ``.weight`` followed
    by its fp32 ``.weight_scale_inv``, everything else unchanged (docs/fp8.md)."""
    payload: dict[str, torch.Tensor] = {}
    for name, tensor in bucket.items():
        if is_quantized_weight(name, tensor, ignored):
            payload[name], payload[scale_name(name)] = quantize_blockwise(tensor)
        else:
            payload[name] = tensor
    return payload
