"""Input checks for the conversion CLI: paths, model family, weights, parallel layout, output dir.

Everything here runs before any process is spawned or any tensor is read, and reads only JSON
(``config.json``, safetensors headers), so a wrong path, an unsupported family or a layout that
does not divide the model is reported in about a second. Each problem raises
:class:`ConversionError` with one line that names the file or flag and the fix.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megarl.config.model_info import ModelInfo, ModelInfoError, model_info_from_dict

# HF model_type -> the HF architecture the conversion is tested with (round trip and verify).
SUPPORTED_FAMILIES: dict[str, str] = {
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}

# safetensors dtype codes -> torch dtype names
SAFETENSORS_DTYPES: dict[str, str] = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}
DTYPE_CHOICES: dict[str, str] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
DTYPE_BYTES: dict[str, int] = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
                               "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1,
                               "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}
INDEX_FILE = "model.safetensors.index.json"


class ConversionError(Exception):
    """A problem with the user's input or files; the message is one line with the fix."""


@dataclass(frozen=True)
class TensorEntry:
    """Where one HF tensor lives and what it is, read from its safetensors header."""

    file: str
    """File name inside the HF directory."""
    dtype: str
    """torch dtype name, e.g. ``bfloat16``."""
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Size of the tensor's data in bytes."""
        count = 1
        for dim in self.shape:
            count *= dim
        return count * DTYPE_BYTES[self.dtype]


def existing_dir(path: str | Path, flag: str) -> Path:
    """``path`` as a directory that exists, or a one-line error naming ``flag``."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ConversionError(f"{flag} {path}: no such directory")
    if not path.is_dir():
        raise ConversionError(f"{flag} {path}: is a file, expected a directory")
    return path


def read_hf_config(path: str | Path, flag: str = "--hf") -> tuple[Path, dict[str, Any]]:
    """The directory holding ``config.json`` and its parsed contents (``path`` may name the
    directory or the file itself)."""
    path = Path(path).expanduser()
    config_file = path if path.name.endswith(".json") and path.is_file() else path / "config.json"
    if not path.exists():
        raise ConversionError(f"{flag} {path}: no such file or directory")
    if not config_file.is_file():
        raise ConversionError(f"{flag} {path}: no config.json (expected an HF model directory)")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConversionError(f"{config_file}: not readable JSON ({err})") from err
    return config_file.parent, config


def check_family(config: dict[str, Any], source: str) -> str:
    """The model_type of a supported family, or a one-line error naming the supported ones."""
    model_type = config.get("model_type")
    supported = ", ".join(sorted(SUPPORTED_FAMILIES))
    if model_type not in SUPPORTED_FAMILIES:
        raise ConversionError(
            f"{source}: model_type {model_type!r} is not supported; supported: {supported}"
        )
    return model_type


def model_info(config: dict[str, Any], source: str) -> ModelInfo:
    """Architecture facts of the model (layers, heads, experts) from its config dict."""
    try:
        return model_info_from_dict(config, source)
    except ModelInfoError as err:
        raise ConversionError(str(err)) from err


def _read_header(file: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (the tensors' names, dtypes, shapes, offsets)."""
    try:
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > 100_000_000:
                raise ValueError(f"header length {length}")
            return json.loads(f.read(length))
    except (OSError, ValueError, struct.error) as err:
        raise ConversionError(f"{file}: not a readable safetensors file ({err})") from err


def hf_weight_index(hf_dir: Path) -> dict[str, TensorEntry]:
    """Every tensor of the HF model at ``hf_dir``: name -> file, dtype and shape (headers only)."""
    index_file = hf_dir / INDEX_FILE
    if index_file.is_file():
        try:
            files = sorted(set(json.loads(index_file.read_text())["weight_map"].values()))
        except (OSError, json.JSONDecodeError, KeyError) as err:
            raise ConversionError(f"{index_file}: no readable weight_map ({err})") from err
        missing = [f for f in files if not (hf_dir / f).is_file()]
        if missing:
            raise ConversionError(
                f"{index_file} lists {missing[0]}, which is missing from {hf_dir}"
                + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            )
    else:
        files = sorted(p.name for p in hf_dir.glob("*.safetensors"))
    if not files:
        hint = (" (pytorch_model*.bin is not supported: re-save it with safe_serialization)"
                if any(hf_dir.glob("pytorch_model*.bin")) else "")
        raise ConversionError(f"--hf {hf_dir}: no *.safetensors weights{hint}")
    entries: dict[str, TensorEntry] = {}
    for name in files:
        for tensor, meta in _read_header(hf_dir / name).items():
            if tensor == "__metadata__":
                continue
            dtype = SAFETENSORS_DTYPES.get(meta["dtype"])
            if dtype is None:
                raise ConversionError(f"{hf_dir / name}: tensor {tensor} has dtype "
                                      f"{meta['dtype']}, which the conversion does not handle")
            entries[tensor] = TensorEntry(file=name, dtype=dtype, shape=tuple(meta["shape"]))
    return entries


def weights_dtype(entries: dict[str, TensorEntry]) -> str:
    """The floating dtype holding most of the weights' bytes (the dtype to build the model in)."""
    totals: dict[str, int] = {}
    for entry in entries.values():
        if entry.dtype in ("float32", "float16", "bfloat16"):
            totals[entry.dtype] = totals.get(entry.dtype, 0) + entry.nbytes
    if not totals:
        raise ConversionError("the weights hold no float32/float16/bfloat16 tensors")
    return max(totals, key=totals.get)


def _divisor_hint(total: int, wanted: int) -> str:
    options = [d for d in range(1, total + 1) if total % d == 0]
    near = [str(d) for d in sorted(sorted(options, key=lambda d: (abs(d - wanted), d))[:3])]
    return near[0] if len(near) == 1 else ", ".join(near[:-1]) + " or " + near[-1]


def check_layout(info: ModelInfo, tp: int, pp: int, ep: int, etp: int | None) -> None:
    """Raise a one-line error when the layout does not divide the model (megatron-core's rules)."""
    for flag, value in (("--tp", tp), ("--pp", pp), ("--ep", ep), ("--etp", etp or 1)):
        if value < 1:
            raise ConversionError(f"{flag} {value}: must be >= 1")
    rules = [
        ("--tp", tp, info.num_attention_heads, "attention heads"),
        ("--tp", tp, info.num_kv_heads, "key/value heads"),
        ("--pp", pp, info.num_layers, "layers"),
    ]
    if info.dense_layers:
        rules.append(("--tp", tp, info.ffn_hidden_size, "dense FFN columns (intermediate_size)"))
    if info.shared_expert_ffn_hidden_size:
        rules.append(("--tp", tp, info.shared_expert_ffn_hidden_size, "shared-expert FFN columns"))
    if info.is_moe:
        rules.append(("--ep", ep, info.num_experts, "experts"))
        rules.append(("--etp" if etp else "--tp", etp or tp, info.moe_ffn_hidden_size,
                      "expert FFN columns (moe_intermediate_size)"))
    elif ep > 1:
        raise ConversionError(f"--ep {ep}: the model ({info.model_type}) has no experts; use --ep 1")
    for flag, value, total, what in rules:
        if total % value:
            raise ConversionError(
                f"{flag} {value}: the model's {total} {what} do not split over {value} ranks; "
                f"use {flag} {_divisor_hint(total, value)}"
            )


def world_size(tp: int, pp: int, ep: int, etp: int | None, cp: int = 1) -> int:
    """The fewest ranks that hold one copy of the model in this layout:
    lcm(tp*cp*pp, ep*etp*pp)."""
    from math import lcm

    return lcm(tp * cp * pp, ep * (etp or tp) * pp)


def check_new_output(out: str | Path, flag: str = "--out") -> Path:
    """``out`` as a path that does not exist yet and whose parent is a writable directory."""
    out = Path(out).expanduser().absolute()
    if out.exists():
        raise ConversionError(f"{flag} {out}: already exists; remove it or choose a new path")
    parent = out.parent
    if not parent.is_dir():
        raise ConversionError(f"{flag} {out}: parent directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise ConversionError(f"{flag} {out}: parent directory {parent} is not writable")
    return out


@contextlib.contextmanager
def staged_output(out: Path) -> Iterator[Path]:
    """A sibling directory named ``<out>.incomplete-<pid>`` to write into; renamed to ``out``
    when the block succeeds, removed when it fails (so no partial output looks complete)."""
    stage = out.with_name(f"{out.name}.incomplete-{os.getpid()}")
    stage.mkdir()
    try:
        yield stage
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(stage, ignore_errors=True)
        raise ConversionError(f"{out}: appeared while converting; the result was discarded")
    stage.rename(out)


# Files of an HF model directory that describe the model or tokenizer (copied next to weights).
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja",
    "chat_template.json", "generation_config.json", "preprocessor_config.json",
)


def copy_model_files(src: Path, dst: Path) -> list[str]:
    """Copy the tokenizer and generation files of ``src`` (those present) into ``dst``."""
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    for path in sorted(src.glob("*.tiktoken")):
        shutil.copy2(path, dst / path.name)
        copied.append(path.name)
    return copied


@dataclass(frozen=True)
class Layout:
    """The parallel layout asked for on the command line (``--tp --pp --ep --etp``)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None
    """Expert tensor-parallel size; None means megatron's default (equal to ``tp``)."""
    cp: int = 1
    """Context-parallel size: each sequence split over ``cp`` ranks (``verify`` only; a
    checkpoint does not depend on it)."""

    @property
    def world_size(self) -> int:
        """The number of ranks the layout needs (one copy of the model)."""
        return world_size(self.tp, self.pp, self.ep, self.etp, self.cp)

    def check(self, info: ModelInfo) -> None:
        """Raise a one-line error when this layout does not divide the model."""
        check_layout(info, self.tp, self.pp, self.ep, self.etp)
        if self.cp < 1:
            raise ConversionError(f"--cp {self.cp}: must be >= 1")
        if self.cp > 1 and info.is_mla:
            raise ConversionError(f"--cp {self.cp}: context parallelism is not built for MLA "
                                  "models (DeepSeek-V2/V3) in megarl; use --cp 1")

    def sizes(self) -> Any:
        """The megarl ``ParallelSizes`` of this layout."""
        from megarl.megatron.parallel import ParallelSizes

        return ParallelSizes(tp=self.tp, pp=self.pp, ep=self.ep, etp=self.etp, cp=self.cp)

    def describe(self) -> str:
        """``tp=2 pp=1 ep=1`` (plus ``etp`` and ``cp`` when set)."""
        text = f"tp={self.tp} pp={self.pp} ep={self.ep}"
        text += f" etp={self.etp}" if self.etp is not None else ""
        return text + (f" cp={self.cp}" if self.cp > 1 else "")


@dataclass(frozen=True)
class HFModel:
    """An HF model directory that passed the checks: config, family, architecture, tensors."""

    path: Path
    config: dict[str, Any]
    model_type: str
    info: ModelInfo
    tensors: dict[str, TensorEntry]

    @property
    def nbytes(self) -> int:
        """Total bytes of the weights."""
        return sum(t.nbytes for t in self.tensors.values())


def load_transformers_config(config_dir: Path) -> Any:
    """The config as transformers and megarl's model builder read it, or a one-line error."""
    from megarl.megatron.model import load_hf_config

    try:
        return load_hf_config(config_dir)
    except Exception as err:  # transformers raises many types for a bad config
        first = (str(err).strip().splitlines() or [type(err).__name__])[-1]
        raise ConversionError(f"{config_dir}/config.json: not a valid config ({first})") from err


def inspect_hf_model(path: str | Path, flag: str = "--hf") -> HFModel:
    """Check an HF model directory (path, config.json, family, safetensors headers)."""
    hf_dir = existing_dir(path, flag)
    hf_dir, config = read_hf_config(hf_dir, flag)
    model_type = check_family(config, str(hf_dir / "config.json"))
    load_transformers_config(hf_dir)
    info = model_info(config, str(hf_dir / "config.json"))
    tensors = hf_weight_index(hf_dir)
    check_fp8_scales(config, tensors, hf_dir)
    return HFModel(path=hf_dir.absolute(), config=config, model_type=model_type, info=info,
                   tensors=tensors)


def check_fp8_scales(config: dict[str, Any], tensors: dict[str, TensorEntry],
                     hf_dir: Path) -> int:
    """Check block-quantized FP8 weights (DeepSeek-V3's and Qwen3's release format: an
    ``X`` in float8_e4m3fn next to ``X_scale_inv``, dequantized on load); returns how many
    weights are quantized. One line for a scale without its weight, an fp8 weight without its
    scale, a scale of the wrong shape, or scales without config.json's fp8 quantization_config."""
    from megarl.megatron.hf_reader import fp8_block_size
    from megarl.weights.fp8 import SCALE_SUFFIX, scale_shape

    scales = sorted(name for name in tensors if name.endswith(SCALE_SUFFIX))
    fp8 = sorted(name for name, entry in tensors.items() if entry.dtype.startswith("float8"))
    if not scales and not fp8:
        return 0
    quant = config.get("quantization_config") or {}
    if quant.get("quant_method") != "fp8" or not quant.get("weight_block_size"):
        raise ConversionError(
            f"--hf {hf_dir}: the weights hold FP8 / *{SCALE_SUFFIX} tensors (e.g. "
            f"{(scales or fp8)[0]}) but config.json has no quantization_config with "
            "quant_method fp8 and weight_block_size; only block-quantized FP8 checkpoints "
            "(DeepSeek-V3 / Qwen3 FP8 releases) are read")
    block = fp8_block_size(hf_dir)
    for scale in scales:
        weight = tensors.get(scale.removesuffix(SCALE_SUFFIX))
        if weight is None or not weight.dtype.startswith("float8_e4m3"):
            raise ConversionError(f"--hf {hf_dir}: {scale} has no float8_e4m3fn weight "
                                  f"{scale.removesuffix(SCALE_SUFFIX)} next to it")
        if tensors[scale].shape != scale_shape(weight.shape, block):
            raise ConversionError(
                f"--hf {hf_dir}: {scale} has shape {list(tensors[scale].shape)}; its weight "
                f"{list(weight.shape)} in {block[0]}x{block[1]} blocks needs "
                f"{list(scale_shape(weight.shape, block))}")
    unscaled = [name for name in fp8 if name + SCALE_SUFFIX not in tensors]
    if unscaled:
        raise ConversionError(f"--hf {hf_dir}: FP8 tensor {unscaled[0]} has no "
                              f"{unscaled[0]}{SCALE_SUFFIX}; cannot dequantize it")
    return len(scales)
