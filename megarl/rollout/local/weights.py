"""Writing weights into a live HF model by checkpoint (HF) name, in place.

transformers 5 stores some tensors differently from their checkpoints: MoE experts are fused
into 3-D ``gate_up_proj`` / ``down_proj`` parameters while checkpoints (and the trainer's
Megatron -> HF stream) name every expert separately (``...experts.3.gate_proj.weight``).
:class:`WeightMap` resolves each checkpoint name to a writable *view* of the live parameter,
found by running transformers' own reverse conversion on a tensor of element indices: every
conversion transformers uses for these models only rearranges elements, so the indices that
come out say exactly where each checkpoint tensor lives, and are checked to form a strided view.
Names of the live parameters themselves (``model.state_dict()``) are accepted as well.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from megarl.rollout.local.fp8_layers import expert_scale_view
from megarl.weights.fp8 import FP8_DTYPE, SCALE_SUFFIX


class UnknownWeight(KeyError):
    """A weight name that is neither a checkpoint name nor a parameter of the model."""


def _strided_spec(index: torch.Tensor, probe: torch.Tensor
                  ) -> tuple[tuple[int, ...], tuple[int, ...], int] | None:
    """(size, stride, offset) such that ``probe.as_strided(...) == index``, or None; ``probe``
    is ``arange`` over the whole parameter (made once per parameter: one per checkpoint name
    cost time proportional to experts x parameter size)."""
    if index.numel() == 0:
        return None
    offset = int(index.reshape(-1)[0])
    strides = []
    for dim, size in enumerate(index.shape):
        if size == 1:
            strides.append(1)
            continue
        unit = [0] * index.dim()
        unit[dim] = 1
        strides.append(int(index[tuple(unit)]) - offset)
    size = tuple(index.shape)
    if any(st < 0 for st in strides):
        return None
    if offset + 1 + sum((s - 1) * st for s, st in zip(size, strides)) > probe.numel():
        return None
    if not torch.equal(probe.as_strided(size, strides, offset), index):
        return None
    return size, tuple(strides), offset


DROPPED = ("the weights were released without --enable-weights-cpu-backup (dropped; start the "
           "server with it to keep them in host memory)")
"""Why a released model's weights are unwritten (:meth:`WeightMap.drop`)."""


class WeightMap:
    """Checkpoint name -> writable view of a live parameter, for one model."""

    def __init__(self, model: nn.Module) -> None:
        from transformers.core_model_loading import revert_weight_conversion

        self._live: dict[str, torch.Tensor] = {
            name: t for name, t in model.state_dict(keep_vars=True).items()
        }
        self._specs: dict[str, tuple[str, tuple[int, ...], tuple[int, ...], int]] = {}
        for name, tensor in self._live.items():
            if not tensor.is_contiguous():
                raise ValueError(f"parameter {name} is not contiguous; the embedded engine "
                                 "writes weights through strided views of contiguous tensors")
            probe = torch.arange(tensor.numel())
            reverted = revert_weight_conversion(model, {name: probe.view(tensor.shape)})
            for ckpt_name, ckpt_index in reverted.items():
                spec = _strided_spec(ckpt_index, probe)
                if spec is None:
                    raise ValueError(f"checkpoint tensor {ckpt_name} is not a strided view of "
                                     f"parameter {name}; this model's weight conversion is not "
                                     "supported by the embedded engine")
                self._specs[ckpt_name] = (name, *spec)
        self._add_expert_scales()
        self.unwritten_reason = DROPPED
        """How the unwritten weights lost their values (the last :meth:`drop`)."""
        self._unwritten: dict[tuple, str] = {}
        """The views of dropped parameters not written since (:meth:`drop`): (live tensor's id,
        size, stride, offset) -> a checkpoint name of it (tied names share one view)."""

    def _add_expert_scales(self) -> None:
        """Checkpoint names of the block-FP8 experts' scales (``experts.3.gate_proj.
        weight_scale_inv``): views of the fused ``<param>_scale_inv`` at the block rows of the
        expert's weight view (:mod:`megarl.rollout.local.fp8_layers`)."""
        for ckpt_name, (live_name, size, stride, offset) in list(self._specs.items()):
            scale_name = live_name + SCALE_SUFFIX
            if scale_name not in self._live or self._live[live_name].dim() != 3:
                continue  # a 2-D FP8 weight's scale is a parameter under its own name
            spec = expert_scale_view(tuple(self._live[live_name].shape),
                                     tuple(self._live[scale_name].shape), size, stride, offset)
            if spec is None:
                raise ValueError(f"checkpoint tensor {ckpt_name} is not a block of rows of "
                                 f"{live_name}; its FP8 scales cannot be located")
            self._specs[ckpt_name + SCALE_SUFFIX] = (scale_name, *spec)

    def checkpoint_names(self) -> list[str]:
        """Names as they appear in the model's HF checkpoint (what trainers send)."""
        return list(self._specs)

    def view(self, name: str) -> torch.Tensor:
        """The live tensor (a view) behind a checkpoint or parameter name."""
        if name in self._specs:
            live_name, size, stride, offset = self._specs[name]
            live = self._live[live_name].data
            return live.as_strided(size, stride, live.storage_offset() + offset)
        if name in self._live:
            return self._live[name].data
        raise UnknownWeight(f"weight {name!r} is not a checkpoint name or parameter of the "
                            f"model (e.g. {self.checkpoint_names()[:3]})")

    def knows(self, name: str) -> bool:
        """Whether ``name`` is a checkpoint name or a parameter of the model."""
        return name in self._specs or name in self._live

    def location(self, name: str) -> tuple[str, tuple[int, ...], tuple[int, ...], int]:
        """(live tensor's own name, size, stride, element offset from the live tensor's) of the
        view behind a checkpoint or parameter name."""
        if name in self._specs:
            return self._specs[name]
        if name in self._live:
            live = self._live[name]
            return name, tuple(live.shape), live.stride(), 0
        raise UnknownWeight(f"weight {name!r} is not a checkpoint name or parameter of the "
                            f"model (e.g. {self.checkpoint_names()[:3]})")

    def live(self, name: str) -> torch.Tensor:
        """The live parameter or buffer called ``name`` (its data, as it is now)."""
        return self._live[name].data

    def target(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The view ``tensor`` is written to, after checking that it can be (its shape and dtype
        only are read: a meta tensor will do)."""
        target = self.view(name)
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(f"weight {name}: got shape {tuple(tensor.shape)}, the model has "
                             f"{tuple(target.shape)}")
        if target.dtype == FP8_DTYPE and tensor.dtype != FP8_DTYPE:
            raise ValueError(f"weight {name}: the engine holds it in float8_e4m3fn "
                             f"(--quantization fp8) and got {tensor.dtype}; send FP8 weights "
                             "with their weight_scale_inv (rollout.quantization: fp8)")
        return target

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor) -> None:
        """Copy ``tensor`` into the weight called ``name`` (shapes must match)."""
        target = self.target(name, tensor)
        target.copy_(tensor.to(device=target.device, dtype=target.dtype))
        if self._unwritten:
            self._written(name)

    def mark_written(self, names: Iterable[str]) -> None:
        """A load wrote ``names`` (what :meth:`unwritten` reports no longer includes them)."""
        if self._unwritten:
            for name in names:
                self._written(name)

    def _key(self, name: str) -> tuple:
        live_name, size, stride, offset = self._specs[name]
        return id(self._live[live_name]), size, stride, offset

    def _written(self, name: str) -> None:
        if name in self._specs:
            self._unwritten.pop(self._key(name), None)
        else:  # a parameter's own name: the whole tensor
            live = id(self._live[name])
            for key in [k for k in self._unwritten if k[0] == live]:
                del self._unwritten[key]

    def drop(self, tensors: Iterable[torch.Tensor], reason: str = DROPPED) -> None:
        """``tensors`` (live parameters) lost their values (a release of the weights without
        a CPU backup; ``reason`` says how, for :func:`unusable_weights`): each checkpoint name
        that writes into them is unwritten until a load writes it (or, by the parameter's own
        name, the whole tensor)."""
        self.unwritten_reason = reason
        dropped = {id(t) for t in tensors}
        for name in self._specs:
            key = self._key(name)
            if key[0] in dropped:
                self._unwritten.setdefault(key, name)

    def unwritten(self) -> list[str]:
        """Checkpoint names of dropped weights no load has written since (one per view)."""
        return list(self._unwritten.values())

    def live_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every live parameter and buffer of the model by its own name (tied ones once)."""
        seen: set[int] = set()
        for name, tensor in self._live.items():
            if id(tensor) not in seen:
                seen.add(id(tensor))
                yield name, tensor.data

    @torch.no_grad()
    def load_many(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load every (name, tensor); returns how many were loaded. Every tensor is checked
        before any is written; those already in their weight's dtype and device are copied by
        ``torch._foreach_copy_`` (a few launches for thousands of tensors: a sync's experts),
        unless two names write the same memory (tied weights), which are loaded in order."""
        named = list(named)
        targets = [self.target(name, tensor) for name, tensor in named]
        if len({(t.data_ptr(), t.shape, t.stride()) for t in targets}) < len(targets):
            for name, tensor in named:
                self.load(name, tensor)
            return len(named)
        dsts, srcs = [], []
        for target, (_, tensor) in zip(targets, named):
            if tensor.dtype == target.dtype and tensor.device == target.device:
                dsts.append(target)
                srcs.append(tensor)
            else:
                target.copy_(tensor.to(device=target.device, dtype=target.dtype))
        if dsts:
            torch._foreach_copy_(dsts, srcs)
        self.mark_written(name for name, _ in named)
        return len(named)


def unusable_weights(released: set[str], weights: WeightMap) -> str:
    """Why ``/generate`` is refused: the weights are released, or were dropped (released
    without ``--enable-weights-cpu-backup``) and a weight update has not rewritten them all."""
    if "weights" in released:
        return ("weights are released (/release_memory_occupation); call "
                "/resume_memory_occupation first")
    missing = weights.unwritten()
    return (f"{weights.unwritten_reason}, and {len(missing)} tensors have not been written "
            f"since, e.g. {missing[:3]}: send them with /update_weights_from_tensor, "
            "_distributed or _disk first")


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every ``*.safetensors`` file in an HF model directory."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model_path {model_dir}: no *.safetensors files found; pass an "
                                "HF model directory saved with safe_serialization=True")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118  (safe_open is not a dict)
                yield key, f.get_tensor(key)


class WeightsChecker:
    """SGLang's ``/weights_checker``: snapshot, scramble, compare after a weight sync."""

    def __init__(self, weights: WeightMap) -> None:
        self._weights = weights
        self._snapshot: dict[str, torch.Tensor] | None = None

    def snapshot(self) -> str:
        """Keep a copy of every live tensor."""
        self._snapshot = {n: t.detach().clone() for n, t in self._weights.live_tensors()}
        return f"snapshot of {len(self._snapshot)} tensors taken"

    @torch.no_grad()
    def reset_tensors(self) -> str:
        """Overwrite every floating-point tensor with random values."""
        count = 0
        for _, tensor in self._weights.live_tensors():
            if tensor.is_floating_point():  # FP8 has no normal_: drawn in fp32, then cast
                tensor.copy_(torch.randn(tensor.shape, device=tensor.device))
                count += 1
        return f"{count} tensors overwritten with random values"

    def compare(self) -> tuple[bool, str]:
        """Whether every live tensor equals the snapshot; the message names the differing ones."""
        if self._snapshot is None:
            return False, "no snapshot: call weights_checker with action=snapshot first"
        differing = [n for n, t in self._weights.live_tensors()
                     if not torch.equal(t, self._snapshot[n])]
        if differing:
            return False, (f"{len(differing)} of {len(self._snapshot)} tensors differ from the "
                           f"snapshot, e.g. {differing[:5]}")
        return True, f"all {len(self._snapshot)} tensors equal the snapshot"
