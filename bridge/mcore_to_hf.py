"""Megatron dist checkpoint -> HF safetensors, one process, one tensor at a time.

The checkpoint may come from ``hf-to-mcore`` or from training (any layout; optimizer state and
other entries are skipped; LoRA adapters are merged into their weights, :class:`LoraMerge`). Nothing is built on ranks: the checkpoint's ``.metadata`` says which
model tensors exist and their global shapes, megatron's layout of a key is fixed (a leading
layer axis for ``decoder.layers.*`` keys without a layer number, then an expert axis for
``*.experts.experts.*`` keys), and mbridge's per-family mapping turns each megatron parameter of
one layer (and expert) into its HF tensors. The whole output is planned first on meta tensors
(names, shapes, files), then each parameter is read from the chunks that hold it, converted and
appended to its output file. Peak memory is one parameter plus one stored chunk, whatever the
model size.
"""

from __future__ import annotations

import itertools
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from bridge.checks import (
    ConversionError,
    check_family,
    check_new_output,
    copy_model_files,
    load_transformers_config,
    model_info,
    read_hf_config,
    staged_output,
)
from bridge.dist_reader import CheckpointTensors, StoredTensor
from bridge.mcore_checkpoint import (
    HF_SUBDIR,
    TRAINING_MANIFEST,
    check_training_manifest,
    find_model_checkpoint,
)
from bridge.safetensors_writer import (
    SafetensorsFile,
    TensorSpec,
    assign_files,
    shard_file_name,
    write_index,
)

MODEL_KEY_PREFIXES = ("embedding.", "decoder.", "output_layer.")
VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9


@dataclass(frozen=True)
class ExportUnit:
    """One megatron parameter of one layer (and expert): where it is stored, what it becomes."""

    key: str
    """The checkpoint key holding it."""
    stored_shape: tuple[int, ...]
    """The global shape of that key."""
    index: tuple[int, ...]
    """Its position along the key's leading layer/expert axes (empty without such axes)."""
    mcore_name: str
    """Its megatron parameter name, as mbridge maps it (global layer and expert numbers)."""
    outputs: tuple[TensorSpec, ...]
    """The HF tensors it converts to, in the output dtype."""


def locate_hf_config(checkpoint: Path, hf_config: str | Path | None) -> tuple[Path, dict]:
    """The HF config to export with: ``--hf-config``, else the one stored with the checkpoint."""
    if hf_config is not None:
        return read_hf_config(hf_config, "--hf-config")
    for candidate in (checkpoint / HF_SUBDIR, checkpoint.parent / HF_SUBDIR):
        if (candidate / "config.json").is_file():
            return read_hf_config(candidate, "--hf-config")
    raise ConversionError(
        f"--mcore {checkpoint}: no HF config stored with the checkpoint; pass --hf-config "
        "PATH (the HF model directory or config.json it was trained from)")


def reading_bridge(config_dir: Path) -> Any:
    """An mbridge bridge for name and format mapping only (no parallel state, no model)."""
    from mbridge.core.parallel_states import ParallelStates

    from megarl.megatron.model import make_bridge

    hf_config = load_transformers_config(config_dir)
    return make_bridge(hf_config, parallel_states=ParallelStates())


def _leading_axes(key: str) -> tuple[bool, bool]:
    """Whether a checkpoint key has a leading layer axis, and an expert axis after it."""
    parts = key.split(".")
    stacked = key.startswith("decoder.layers.") and not parts[2].isdigit()
    return stacked, ".mlp.experts.experts." in key


def _mcore_name(key: str, index: tuple[int, ...], stacked: bool, experts: bool) -> str:
    name, pos = key, 0
    if stacked:
        name, pos = name.replace("decoder.layers.", f"decoder.layers.{index[0]}.", 1), 1
    if experts:
        name = name.replace(".mlp.experts.experts.", ".mlp.experts.", 1) + str(index[pos])
    return name


def to_hf(bridge: Any, mcore_name: str, tensor: torch.Tensor,
          vocab_size: int) -> list[tuple[str, torch.Tensor]]:
    """mbridge's conversion of one full (TP=1) megatron parameter to its HF tensors."""
    if mcore_name in VOCAB_PARAMS and tensor.shape[0] > vocab_size:
        tensor = tensor[:vocab_size]  # megatron pads the vocabulary for TP
    names, tensors = bridge._weight_to_hf_format(mcore_name, tensor)
    return list(zip(names, tensors))


def _layer_of(name: str) -> int:
    parts = name.split(".")
    return int(parts[2]) if name.startswith("decoder.layers.") else -1


def _order(unit: tuple[StoredTensor, tuple[int, ...], str], position: dict[str, int]) -> tuple:
    """Embedding first, then layer by layer, then the final norm and output layer."""
    stored, index, name = unit
    section = 0 if name.startswith("embedding.") else 1 if name.startswith("decoder.layers.") else 2
    return section, _layer_of(name), position[stored.key], index


def plan_export(reader: CheckpointTensors, bridge: Any, config_dir: Path, config: dict,
                dtype: torch.dtype | None) -> list[ExportUnit]:
    """Every parameter to export, in output order, with its HF tensors (``dtype`` None keeps
    each tensor's stored dtype). Raises a one-line error where the config does not fit."""
    stored = [t for t in reader.tensors() if t.key.startswith(MODEL_KEY_PREFIXES)
              and not t.key.endswith("_extra_state") and ".lora." not in t.key]
    if not stored:
        raise ConversionError(f"{reader.directory}: the checkpoint holds no model tensors "
                              "(embedding.*, decoder.*, output_layer.*)")
    raw = []
    for tensor in stored:
        stacked, experts = _leading_axes(tensor.key)
        lead = int(stacked) + int(experts)
        for index in itertools.product(*(range(n) for n in tensor.shape[:lead])):
            raw.append((tensor, index, _mcore_name(tensor.key, index, stacked, experts)))
    position = {t.key: i for i, t in enumerate(stored)}
    raw.sort(key=lambda unit: _order(unit, position))
    _check_counts(raw, config, reader.directory)
    units, seen = [], set()
    tied = bool(config.get("tie_word_embeddings", False))
    for tensor, index, name in raw:
        lead = len(index)
        meta = torch.empty(tensor.shape[lead:], dtype=tensor.dtype, device="meta")
        try:
            converted = to_hf(bridge, name, meta, config["vocab_size"])
        except (NotImplementedError, RuntimeError, AssertionError, ValueError) as err:
            raise ConversionError(
                f"{reader.directory}: checkpoint tensor {tensor.key} {list(tensor.shape)} does "
                f"not convert to {config.get('model_type')} as config.json describes it "
                f"({type(err).__name__}: {err}); is --hf-config the right model?") from err
        outputs = tuple(TensorSpec(n, dtype or t.dtype, tuple(t.shape)) for n, t in converted
                        if n not in seen and not (tied and n == "lm_head.weight"))
        seen.update(spec.name for spec in outputs)
        if outputs:
            units.append(ExportUnit(tensor.key, tensor.shape, index, name, outputs))
    _check_shapes(units, config_dir, reader.directory)
    if not tied and "lm_head.weight" not in seen:
        raise ConversionError(f"{reader.directory}: the checkpoint has no output layer but "
                              "config.json has tie_word_embeddings=false; is --hf-config the "
                              "right model?")
    return units


def hf_parameter_shapes(config_dir: Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of the HF model's parameters as transformers builds it from the config
    (on the meta device: no memory). Fused expert parameters do not match checkpoint names."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(config_dir))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def _check_shapes(units: list[ExportUnit], config_dir: Path, directory: Path) -> None:
    """Every output tensor that transformers' model has under the same name (all but fused
    experts) must have its shape."""
    expected = hf_parameter_shapes(config_dir)
    for unit in units:
        for spec in unit.outputs:
            want = expected.get(spec.name)
            if want is not None and want != spec.shape:
                raise ConversionError(
                    f"{directory}: {unit.key} gives {spec.name} of shape {list(spec.shape)} but "
                    f"{config_dir}/config.json implies {list(want)}; is --hf-config the right "
                    "model?")


def _check_counts(raw: list, config: dict, directory: Path) -> None:
    """The checkpoint's layer and expert counts must be the config's."""
    info = model_info(config, "--hf-config config.json")
    layers = {_layer_of(name) for _, _, name in raw} - {-1}
    if len(layers) != info.num_layers:
        raise ConversionError(f"{directory}: the checkpoint has {len(layers)} layers but "
                              f"config.json says num_hidden_layers={info.num_layers}; is "
                              "--hf-config the right model?")
    experts = {re.search(r"(\d+)$", name).group(1) for _, _, name in raw
               if ".mlp.experts.linear_fc" in name}
    if info.is_moe and len(experts) != info.num_experts:
        raise ConversionError(f"{directory}: the checkpoint has {len(experts)} experts per layer "
                              f"but config.json says {info.num_experts}; is --hf-config the "
                              "right model?")


def _export_config(config: dict, dtype: torch.dtype | None) -> dict:
    """config.json for the output: the dtype fields say what the files hold."""
    config = dict(config)
    if dtype is not None:
        name = str(dtype).removeprefix("torch.")
        keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["torch_dtype"]
        for key in keys:
            config[key] = name
    return config


class LoraMerge:
    """The LoRA adapters a training checkpoint holds next to its base weights: each adapted
    weight is exported as ``W + alpha / rank * B @ A`` (in the stored layout, before the
    bridge splits fused q/k/v and gate/up)."""

    def __init__(self, reader: CheckpointTensors, config: dict[str, Any]) -> None:
        keys = {t.key: t for t in reader.tensors() if ".lora." in t.key}
        manifest = reader.directory / TRAINING_MANIFEST
        lora = json.loads(manifest.read_text()).get("lora") if manifest.is_file() else None
        if keys and not lora:
            raise ConversionError(f"{reader.directory}: LoRA adapters without the actor.lora "
                                  f"settings in {TRAINING_MANIFEST}; save the checkpoint again")
        self.reader, self.keys = reader, keys
        self.scale = lora["alpha"] / lora["rank"] if lora else 0.0
        self.kv_groups = int(config.get("num_key_value_heads")
                             or config.get("num_attention_heads", 0))

    def __bool__(self) -> bool:
        return bool(self.keys)

    def merged(self, unit: ExportUnit, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (the unit's stored weight) with its adapters merged, if it has any."""
        from megarl.megatron.lora import lora_delta

        base = unit.key.removesuffix("weight")
        if not unit.key.endswith(".weight") or f"{base}lora.lora_A" not in self.keys:
            return tensor
        parts = sorted(k for k in self.keys if k.startswith(f"{base}lora.lora_B."))
        a, *bs = (self._read(k, unit.index) for k in (f"{base}lora.lora_A", *parts))
        groups = self.kv_groups if base.endswith("linear_qkv.") else 0
        return (tensor.float() + lora_delta(a, bs, self.scale, groups)).to(tensor.dtype)

    def _read(self, key: str, index: tuple[int, ...]) -> torch.Tensor:
        shape = self.keys[key].shape
        lead = len(index)
        stored = self.reader.read(key, index + (0,) * (len(shape) - lead),
                                  (1,) * lead + shape[lead:])
        return stored.reshape(shape[lead:])


def write_hf_weights(reader: CheckpointTensors, bridge: Any, units: list[ExportUnit],
                     stage: Path, max_shard_bytes: int, vocab_size: int,
                     lora: LoraMerge | None = None) -> dict[str, Any]:
    """Stream every unit into sharded safetensors files plus the index (adapted weights merged
    with ``lora``'s adapters); returns the counts."""
    files = assign_files([list(u.outputs) for u in units], max_shard_bytes)
    count = files[-1] + 1
    total = sum(s.nbytes for u in units for s in u.outputs)
    weight_map: dict[str, str] = {}
    per_file: list[list[ExportUnit]] = [[] for _ in range(count)]
    for unit, file_index in zip(units, files):
        per_file[file_index].append(unit)
    bar = tqdm(total=total, desc="write HF shards", unit="B", unit_scale=True)
    for file_index, members in enumerate(per_file):
        name = shard_file_name(file_index, count)
        with SafetensorsFile(stage / name, [s for u in members for s in u.outputs]) as out:
            for unit in members:
                stored = reader.read(unit.key, *_box(unit))
                tensor = stored.reshape(stored.shape[len(unit.index):])
                if lora:
                    tensor = lora.merged(unit, tensor)
                converted = _kept(to_hf(bridge, unit.mcore_name, tensor, vocab_size),
                                  unit.outputs)
                for spec, (hf_name, hf_tensor) in zip(unit.outputs, converted):
                    out.write(hf_name, hf_tensor.to(spec.dtype))
                    weight_map[hf_name] = name
                    bar.update(spec.nbytes)
    bar.close()
    write_index(stage, weight_map, total)
    return {"files": count, "tensors": len(weight_map), "bytes": total}


def _box(unit: ExportUnit) -> tuple[tuple, tuple]:
    """Offsets and sizes of the unit's slice of its checkpoint key."""
    lead, shape = len(unit.index), unit.stored_shape
    return unit.index + (0,) * (len(shape) - lead), (1,) * lead + shape[lead:]


def _kept(pairs: list[tuple[str, torch.Tensor]], outputs: tuple[TensorSpec, ...]) -> list:
    wanted = {s.name for s in outputs}
    return [(n, t) for n, t in pairs if n in wanted]


def mcore_to_hf(mcore: str | Path, out: str | Path, hf_config: str | Path | None = None,
                dtype: torch.dtype | None = None,
                max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> dict[str, Any]:
    """Convert the dist checkpoint at (or under) ``mcore`` into an HF model directory ``out``.

    ``dtype`` None keeps each tensor's stored dtype. Returns a summary (files, bytes, seconds).
    """
    checkpoint = find_model_checkpoint(mcore)
    config_dir, config = locate_hf_config(checkpoint, hf_config)
    check_family(config, str(config_dir / "config.json"))
    check_training_manifest(checkpoint, config, config_dir / "config.json")
    out = check_new_output(out)
    start = time.perf_counter()
    reader = CheckpointTensors(checkpoint)
    bridge = reading_bridge(config_dir)
    units = plan_export(reader, bridge, config_dir, config, dtype)
    lora = LoraMerge(reader, config)
    with staged_output(out) as stage:
        summary = write_hf_weights(reader, bridge, units, stage, max_shard_bytes,
                                   config["vocab_size"], lora)
        (stage / "config.json").write_text(json.dumps(_export_config(config, dtype), indent=2)
                                           + "\n")
        copy_model_files(config_dir, stage)
    return {**summary, "out": str(out), "checkpoint": str(checkpoint),
            "seconds": time.perf_counter() - start}
