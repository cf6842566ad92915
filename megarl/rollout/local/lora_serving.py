"""LoRA adapters served by the embedded engine (``--enable-lora``), SGLang's way (issue 33).

An adapter is loaded by name, from a PEFT directory (``/load_lora_adapter``) or from tensors
(``/load_lora_adapter_from_tensors``: PEFT's ``adapter_config.json`` as ``config_dict`` and
its ``state_dict`` names), and a ``/generate`` request picks one per prompt with ``lora_path``
(the adapter's name), as in SGLang; rows of different adapters (or none) share a batch. The
base weights are never changed: a forward hook on each adapted linear layer adds
``scale * B(A x)`` to the rows of its adapter (``scale = lora_alpha / r``, or
``lora_alpha / sqrt(r)`` with ``use_rslora``), which is what the merged weight
``W + scale * B @ A`` computes. Routed experts take SGLang's per-expert adapters
(``mlp.experts.{e}.gate_proj``...; lora_experts.py): an adapted experts module runs an expert
loop that adds them. The engine sets the rows' adapters before every forward
(:meth:`LoraServing.set_rows`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megarl.rollout.local.lora_experts import (
    EXPERT_KEY,
    PROJECTIONS,
    ExpertWeights,
    expert_weights,
    experts_forward,
)
from megarl.weights.expert_adapters import PEFT_PREFIX


class AdapterError(ValueError):
    """An adapter that cannot be loaded, unloaded or used (answered with HTTP 400)."""


@dataclass
class Adapter:
    """One loaded adapter: per module name, its (A [r, in], B [out, r]) and the scale; per
    experts module, its per-expert matrices."""

    name: str
    path: str
    scale: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    experts: dict[str, ExpertWeights]


def _scale(config: Mapping[str, Any], rank: int) -> float:
    """PEFT's scaling of an adapter of ``rank``."""
    alpha = float(config.get("lora_alpha", rank))
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def read_peft_dir(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(adapter_config.json, adapter_model.safetensors) of a PEFT adapter directory."""
    import json

    from safetensors.torch import load_file

    path = Path(path)
    config_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    for needed in (config_file, weights_file):
        if not needed.exists():
            raise AdapterError(f"lora_path {path}: no {needed.name}; pass a PEFT adapter "
                               "directory (save_pretrained of a PeftModel)")
    return json.loads(config_file.read_text()), load_file(str(weights_file))


class LoraServing:
    """The adapters of one model and the hooks that apply them."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.adapters: dict[str, Adapter] = {}
        self._hooks: dict[str, Any] = {}
        self._experts: set[str] = set()  # experts modules running experts_forward
        self._masks: dict[str, torch.Tensor] = {}
        self._rows = 0

    def _submodule(self, name: str) -> nn.Module:
        try:
            return self.model.get_submodule(name)
        except AttributeError:
            raise AdapterError(f"{name}: not a module of the served model") from None

    def _module(self, name: str) -> nn.Module:
        module = self._submodule(name)
        if not hasattr(module, "in_features"):
            raise AdapterError(f"{name}: not a linear layer of the served model")
        return module

    def _expert_adapters(self, module_name: str):
        def applied() -> list[tuple[ExpertWeights, float, torch.Tensor]]:
            out = []
            for name, mask in self._masks.items():
                adapter = self.adapters[name]
                if module_name in adapter.experts:
                    out.append((adapter.experts[module_name], adapter.scale, mask))
            return out

        return applied

    def load(self, name: str, config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor],
             path: str = "__tensor__") -> None:
        """Add adapter ``name`` (PEFT config and state dict); raises :class:`AdapterError`
        naming what does not fit the model."""
        if not name:
            raise AdapterError("lora_name: empty")
        if name in self.adapters:
            raise AdapterError(f"LoRA adapter {name!r} is already loaded; unload it first or "
                               "use another lora_name")
        if config.get("use_dora"):
            raise AdapterError(f"{name}: DoRA adapters (use_dora) are not supported")
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        expert_pairs: dict[str, dict[tuple[int, str], dict[str, torch.Tensor]]] = {}
        for key, tensor in tensors.items():
            module, _, part = key.removeprefix(PEFT_PREFIX).rpartition(".lora_")
            if part not in ("A.weight", "B.weight"):
                raise AdapterError(f"{name}: tensor {key!r} is not a lora_A / lora_B weight "
                                   "in PEFT's names")
            expert = EXPERT_KEY.match(module)
            if expert is not None and expert["proj"] in PROJECTIONS:
                slot = (int(expert["expert"]), PROJECTIONS[expert["proj"]])
                expert_pairs.setdefault(expert["module"], {}).setdefault(slot, {})[part[0]] = \
                    tensor
            else:
                pairs.setdefault(module, {})[part[0]] = tensor
        if not pairs and not expert_pairs:
            raise AdapterError(f"{name}: the adapter holds no tensors")
        rank = int(config.get("r", 0))
        device, dtype = self._device_dtype()
        weights = {}
        for module_name, pair in pairs.items():
            if set(pair) != {"A", "B"}:
                raise AdapterError(f"{name}: {module_name} has lora_{next(iter(pair))} only")
            linear = self._module(module_name)
            a, b = pair["A"], pair["B"]
            if (a.dim() != 2 or b.dim() != 2 or a.shape[1] != linear.in_features
                    or b.shape[0] != linear.out_features or a.shape[0] != b.shape[1]):
                raise AdapterError(
                    f"{name}: {module_name} lora_A {list(a.shape)} / lora_B {list(b.shape)} do "
                    f"not fit a layer of {linear.in_features} -> {linear.out_features}")
            if rank and a.shape[0] != rank:
                raise AdapterError(f"{name}: {module_name} has rank {a.shape[0]}, the config "
                                   f"says r={rank}")
            weights[module_name] = (a.to(device, dtype), b.to(device, dtype))
        # without r in the config: the first A's rows
        rank = rank or next((t.shape[0] for k, t in tensors.items()
                             if k.endswith("lora_A.weight")), 0)
        experts = {module_name: expert_weights(name, module_name, self._submodule(module_name),
                                               found, rank, device, dtype, AdapterError)
                   for module_name, found in expert_pairs.items()}
        self.adapters[name] = Adapter(name, path, _scale(config, rank), weights, experts)
        for module_name in weights:
            if module_name not in self._hooks:
                self._hooks[module_name] = self._module(module_name).register_forward_hook(
                    self._hook(module_name))
        for module_name in experts:
            if module_name not in self._experts:
                module = self._submodule(module_name)
                module.forward = experts_forward(module, self._expert_adapters(module_name))
                self._experts.add(module_name)

    def unload(self, name: str) -> None:
        """Remove adapter ``name`` and the hooks no other adapter needs."""
        if self.adapters.pop(name, None) is None:
            raise AdapterError(f"LoRA adapter {name!r} is not loaded (loaded: "
                               f"{sorted(self.adapters)})")
        needed = {m for a in self.adapters.values() for m in a.weights}
        for module_name in [m for m in self._hooks if m not in needed]:
            self._hooks.pop(module_name).remove()
        needed = {m for a in self.adapters.values() for m in a.experts}
        for module_name in [m for m in self._experts if m not in needed]:
            del self._submodule(module_name).forward  # the class's own forward again
            self._experts.discard(module_name)
        self._masks.pop(name, None)

    def check(self, names: Sequence[str | None]) -> None:
        """Raise when a request names an adapter that is not loaded."""
        missing = sorted({n for n in names if n is not None and n not in self.adapters})
        if missing:
            raise AdapterError(f"lora_path {missing[0]!r} is not a loaded LoRA adapter "
                               f"(loaded: {sorted(self.adapters)}); load it with "
                               "/load_lora_adapter first")

    def set_rows(self, names: Sequence[str | None]) -> None:
        """The adapter of each row of the next forward (None: the base model)."""
        device, dtype = self._device_dtype()
        self._rows = len(names)
        self._masks = {}
        for adapter in {n for n in names if n is not None}:
            mask = torch.tensor([n == adapter for n in names], dtype=dtype)
            self._masks[adapter] = mask.to(device)

    def _hook(self, module_name: str):
        def add_adapters(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
            for name, mask in self._masks.items():
                pair = self.adapters[name].weights.get(module_name)
                if pair is None:
                    continue
                if output.shape[0] != self._rows:
                    raise RuntimeError(f"LoRA: a forward of {output.shape[0]} rows after "
                                       f"set_rows of {self._rows}")
                x = args[0]
                delta = F.linear(F.linear(x.to(pair[0].dtype), pair[0]), pair[1])
                shape = (-1,) + (1,) * (output.dim() - 1)
                output = output + (delta * self.adapters[name].scale
                                   * mask.view(shape)).to(output.dtype)
            return output

        return add_adapters

    def _device_dtype(self) -> tuple[torch.device, torch.dtype]:
        weight = self.model.get_input_embeddings().weight
        return weight.device, weight.dtype

    def loaded(self) -> dict[str, str]:
        """``{name: path}`` of the loaded adapters (``__tensor__`` for those sent as tensors)."""
        return {name: a.path for name, a in self.adapters.items()}
