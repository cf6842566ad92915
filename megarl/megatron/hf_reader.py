"""The HF safetensors reader every megarl bridge loads weights through.

mbridge reads HF weights tensor by tensor through ``bridge._get_safetensor_io(path)``;
:func:`megarl.megatron.model.make_bridge` points that at :class:`HFWeightReader`, so the trainer
(loading HF weights directly) and ``megarl-convert hf-to-mcore`` read the same way. It is
mbridge's reader plus one thing: an FP8 block-quantized weight (``X`` stored as
``float8_e4m3fn`` next to ``X_scale_inv``, as DeepSeek-V3 and Qwen3 FP8 releases ship) is
dequantized blockwise on load, on CPU, into fp32 (mbridge then casts it to the model dtype).
The scale tensors themselves are never handed to the model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from mbridge.core.safetensor_io import SafeTensorIO

from megarl.weights.fp8 import BLOCK, SCALE_SUFFIX, dequantize_blockwise, scale_name


def fp8_block_size(hf_dir: str | Path) -> tuple[int, int]:
    """``quantization_config.weight_block_size`` of the model's config.json ([128, 128] when
    the config has none)."""
    path = Path(hf_dir) / "config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    block = (config.get("quantization_config") or {}).get("weight_block_size") or BLOCK
    return int(block[0]), int(block[1])


class HFWeightReader(SafeTensorIO):
    """mbridge's safetensors reader that dequantizes FP8 block-quantized weights on load."""

    def __init__(self, hf_dir: str) -> None:
        super().__init__(hf_dir)
        self._scales = {name.removesuffix(SCALE_SUFFIX) for name in self.load_hf_weight_names()
                        if name.endswith(SCALE_SUFFIX)}
        self._block = fp8_block_size(hf_dir) if self._scales else BLOCK

    def load_some_hf_weight(self, hf_weight_names: list[str]) -> dict[str, torch.Tensor]:
        """The named tensors; each one that has a ``_scale_inv`` comes back dequantized."""
        quantized = [name for name in hf_weight_names if name in self._scales]
        loaded = super().load_some_hf_weight(
            [*hf_weight_names, *(scale_name(name) for name in quantized)])
        for name in quantized:
            loaded[name] = dequantize_blockwise(loaded[name], loaded.pop(scale_name(name)),
                                                block=self._block)
        return loaded
