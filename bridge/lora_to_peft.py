"""``megarl-convert lora-to-peft``: the LoRA adapters of a megarl run checkpoint as a PEFT adapter
directory (``adapter_config.json`` + ``adapter_model.safetensors``) of the HF model, which
``peft.PeftModel.from_pretrained`` loads.

The checkpoint's manifest (``megarl.json``) holds the ``actor.lora`` settings that built the
adapters. One rank builds the model from the HF config with those adapters, loads the
checkpoint's weights into it (any saved layout: the adapters are global tensors like the rest)
and writes the adapters under PEFT's names, whole (into a staged directory renamed at the end).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from bridge.checks import ConversionError, check_new_output, inspect_hf_model, staged_output
from bridge.launch import spawn_ranks


def export_on_rank(hf_dir: str, checkpoint: str, out: str, lora: dict[str, Any]) -> str:
    """Run on the one rank: build the HF model's actor with the adapters, load the checkpoint,
    write the PEFT adapter directory; returns it."""
    import torch

    from megarl.megatron.checkpoint import load_model_weights
    from megarl.megatron.lora import apply_lora, save_peft_adapter
    from megarl.megatron.model import build_actor_model
    from megarl.megatron.parallel import ParallelSizes
    from megarl.megatron.settings import LoraSettings

    targets = lora["target_modules"]
    settings = LoraSettings(**{**lora, "exclude_modules": tuple(lora["exclude_modules"]),
                               "target_modules": None if targets is None else tuple(targets)})
    model = build_actor_model(hf_dir, ParallelSizes(), torch.float32, spec="native",
                              load_weights=False)
    apply_lora(model, settings)
    load_model_weights(checkpoint, model)
    return str(save_peft_adapter(model, settings, out, base_model=hf_dir))


def lora_to_peft(checkpoint: str | Path, out: str | Path, hf: str | Path,
                 runner: Callable[..., list] | None = None) -> dict[str, Any]:
    """Export the adapters of the run checkpoint ``checkpoint`` (a step directory or a root's
    latest) for the HF model ``hf`` into the new directory ``out``; returns a summary."""
    from megarl.megatron.checkpoint import read_manifest, resolve_checkpoint

    try:
        path = resolve_checkpoint(checkpoint)
        manifest = read_manifest(path)
    except (FileNotFoundError, ValueError) as err:
        raise ConversionError(f"--mcore {checkpoint}: {err}") from err
    if not manifest.get("lora"):
        raise ConversionError(f"--mcore {path}: the checkpoint has no LoRA adapters (its run "
                              "had actor.lora.rank=0); use mcore-to-hf for its weights")
    model = inspect_hf_model(hf)
    target = check_new_output(out)
    with staged_output(target) as stage:
        (runner or spawn_ranks)(1, export_on_rank, str(model.path), str(path), str(stage),
                                manifest["lora"])
    return {"out": target, "checkpoint": path, "rank": manifest["lora"]["rank"]}
