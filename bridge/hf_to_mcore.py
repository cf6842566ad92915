"""HF safetensors -> megatron dist checkpoint, on the ranks of a TP/PP/EP layout.

Every rank builds its shard of the Megatron model through mbridge (megarl's model builder),
checks that ``config.json`` and the safetensors agree tensor by tensor, loads the HF weights
one tensor at a time (mbridge's memory-efficient path) and joins one collective
``dist_checkpointing.save``. The driver checks paths, family and layout first, writes into a
``<out>.incomplete-<pid>`` directory and renames it when everything succeeded.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from bridge.checks import (
    ConversionError,
    HFModel,
    Layout,
    TensorEntry,
    check_new_output,
    copy_model_files,
    inspect_hf_model,
    staged_output,
    weights_dtype,
)
from bridge.launch import Runner, spawn_ranks
from bridge.mcore_checkpoint import HF_SUBDIR, save_model, write_convert_info
from megarl.weights.fp8 import SCALE_SUFFIX

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# HF tensors that a model legitimately does not load (older checkpoints store RoPE buffers).
IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)
HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def mtp_layer_tensors(config: dict[str, Any], names: Any) -> list[str]:
    """The tensors of DeepSeek-V3's multi-token-prediction layers (numbered from
    ``num_hidden_layers`` on, ``num_nextn_predict_layers`` of them): HF transformers' model
    does not load them, and neither does the conversion."""
    first = int(config.get("num_hidden_layers", 0))
    last = first + int(config.get("num_nextn_predict_layers") or 0)
    return sorted(n for n in names
                  if (m := HF_LAYER.match(n)) is not None and first <= int(m.group(1)) < last)


def build_model(hf_dir: str, layout: Layout, dtype: str, load_weights: bool) -> Any:
    """This rank's ActorModel for ``layout``; megarl's own config errors become one line."""
    from megarl.megatron.model import build_actor_model

    try:
        return build_actor_model(hf_dir, layout.sizes(), TORCH_DTYPES[dtype],
                                 load_weights=load_weights)
    except ValueError as err:
        raise ConversionError(f"{hf_dir}: {err}") from err


def _global_shape(name: str, param: torch.Tensor, bridge: Any) -> tuple[int, ...]:
    """The shape of a (possibly tensor-parallel) parameter on one rank of TP (or ETP) size 1."""
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        split = bridge.mpu.etp_size if ".mlp.experts.linear_fc" in name else bridge.mpu.tp_size
        shape[param.partition_dim] *= split
    return tuple(shape)


def _expected_hf_shapes(bridge: Any, global_name: str, shape: tuple[int, ...]) -> dict:
    """HF tensor name -> shape that megatron's ``global_name`` of ``shape`` converts to."""
    meta = torch.empty(shape, device="meta")
    names, tensors = bridge._weight_to_hf_format(global_name, meta)
    return {n: tuple(t.shape) for n, t in zip(names, tensors)}


def _tensors_needed(model: Any, tensors: dict[str, TensorEntry], hf_dir: str) -> set[str]:
    """The HF tensors this rank's parameters load; a one-line error for the first that is
    missing or has another shape than ``config.json`` implies."""
    bridge, used = model.bridge, set()
    for chunk in model.chunks:
        params = chunk.state_dict(keep_vars=True)
        for local, global_name in bridge._weight_name_mapping_mcore_local_to_global(chunk).items():
            if "_extra_state" in local:
                continue
            wanted = _expected_hf_shapes(
                bridge, global_name, _global_shape(local, params[local], bridge))
            for hf_name, shape in wanted.items():
                entry = tensors.get(hf_name)
                if entry is None:
                    raise ConversionError(
                        f"{hf_dir}: config.json implies tensor {hf_name}, which the safetensors "
                        "files lack; config.json does not describe these weights (check "
                        "num_hidden_layers, num_experts, tie_word_embeddings)")
                if entry.shape != shape:
                    raise ConversionError(
                        f"{hf_dir}: {hf_name} has shape {list(entry.shape)} in {entry.file} but "
                        f"config.json implies {list(shape)}; config.json does not describe these "
                        "weights")
                used.add(hf_name)
    return used


def check_weights_match(model: Any, tensors: dict[str, TensorEntry], hf_dir: str) -> int:
    """Raise a one-line error (the same on every rank) unless every tensor the ranks need exists
    with the shape ``config.json`` implies and every HF tensor is used by some rank. Returns how
    many HF tensors this rank reads."""
    import torch.distributed as dist

    try:
        used, problem = _tensors_needed(model, tensors, hf_dir), None
    except ConversionError as err:
        used, problem = set(), str(err)
    everyone: list[tuple[str | None, set[str]] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (problem, used))
    problems = [p for p, _ in everyone if p is not None]
    if problems:
        raise ConversionError(problems[0])
    unused = sorted(n for n in set(tensors).difference(*(u for _, u in everyone))
                    if not n.endswith(IGNORED_HF_SUFFIXES))
    if unused:
        raise ConversionError(
            f"{hf_dir}: {len(unused)} tensors of the weights are not part of the model "
            f"config.json describes, e.g. {unused[0]}; config.json does not describe these "
            "weights")
    return len(used)


def _load_hf_weights(model: Any, hf_dir: str, count: int, show: bool) -> None:
    """mbridge's tensor-by-tensor load of the HF weights, with a progress bar on rank 0."""
    from tqdm import tqdm

    from megarl.megatron.hf_reader import HFWeightReader

    bar = tqdm(total=count, desc="load HF tensors", unit="tensor", disable=not show)

    class CountingIO(HFWeightReader):
        """megarl's safetensors reader (FP8 weights dequantized), advancing the progress bar
        per tensor read."""

        def load_some_hf_weight(self, hf_weight_names: list[str]) -> dict:
            """Read the named tensors (mbridge calls this with one name at a time)."""
            loaded = super().load_some_hf_weight(hf_weight_names)
            bar.update(len(hf_weight_names))
            return loaded

    model.bridge._get_safetensor_io = lambda path: CountingIO(path)
    with torch.no_grad():
        model.bridge.load_weights(model.chunks, hf_dir, memory_efficient=True)
    bar.close()


def save_on_rank(hf_dir: str, stage: str, layout: Layout, dtype: str,
                 tensors: dict[str, TensorEntry]) -> dict[str, float]:
    """Run on every rank: build, check, load the HF weights, save this rank's part; returns
    the seconds each phase took on this rank."""
    import torch.distributed as dist

    show = dist.get_rank() == 0
    times, start = {}, time.perf_counter()
    model = build_model(hf_dir, layout, dtype, load_weights=False)
    count = check_weights_match(model, tensors, hf_dir)
    times["build"], start = time.perf_counter() - start, time.perf_counter()
    _load_hf_weights(model, hf_dir, count, show)
    times["load"], start = time.perf_counter() - start, time.perf_counter()
    save_model(model.chunks, Path(stage))
    times["save"] = time.perf_counter() - start
    return times


def hf_to_mcore(hf: str | Path, out: str | Path, layout: Layout, dtype: str | None = None,
                runner: Runner | None = None) -> dict[str, Any]:
    """Convert the HF model at ``hf`` into a megatron dist checkpoint at ``out``.

    ``dtype`` (``float32``/``bfloat16``/``float16``) defaults to the weights' own; ``runner``
    defaults to spawning ``layout.world_size`` local ranks. Returns a summary (sizes, timings).
    """
    model = inspect_hf_model(hf)
    layout.check(model.info)
    dtype = dtype or weights_dtype(model.tensors)
    out = check_new_output(out)
    skipped = set(mtp_layer_tensors(model.config, model.tensors))
    # an FP8 weight's scale is read with the weight (HFWeightReader), not as a tensor of its own
    scales = {name for name in model.tensors if name.endswith(SCALE_SUFFIX)}
    tensors = {name: entry for name, entry in model.tensors.items()
               if name not in skipped and name not in scales}
    nbytes = sum(entry.nbytes for entry in tensors.values())
    start = time.perf_counter()
    with staged_output(out) as stage:
        phases = (runner or spawn_ranks)(layout.world_size, save_on_rank, str(model.path),
                                         str(stage), layout, dtype, tensors)[0]
        _write_hf_files(model, stage / HF_SUBDIR)
        write_convert_info(stage, {
            "model_type": model.model_type,
            "dtype": dtype,
            "layout": {"tp": layout.tp, "pp": layout.pp, "ep": layout.ep, "etp": layout.etp},
            "source": str(model.path),
            "hf_tensors": len(tensors),
            "hf_bytes": nbytes,
            "dequantized_fp8_tensors": len(scales - skipped),
        })
    seconds = time.perf_counter() - start
    return {"out": str(out), "bytes": nbytes, "tensors": len(tensors),
            "seconds": seconds, "dtype": dtype, "rank0_phases": phases,
            "skipped_mtp_tensors": len(skipped),
            "dequantized_fp8_tensors": len(scales - skipped)}


def _write_hf_files(model: HFModel, directory: Path) -> None:
    """The HF config and tokenizer files next to the checkpoint, for mcore-to-hf. The
    checkpoint holds dequantized weights, so the config loses an FP8 ``quantization_config``."""
    directory.mkdir()
    if "quantization_config" in model.config:
        config = {k: v for k, v in model.config.items() if k != "quantization_config"}
        (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    else:
        shutil.copy2(model.path / "config.json", directory / "config.json")
    copy_model_files(model.path, directory)
