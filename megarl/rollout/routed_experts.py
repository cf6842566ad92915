"""Where the MoE layers sit among a model's layers, for routed experts (R3) on the wire.

SGLang returns ``routed_experts`` with a row for EVERY decoder layer, ``[tokens,
num_hidden_layers, num_experts_per_tok]``; dense layers are never written by its capturer and
stay 0 (``layers/moe/routed_experts_capturer.py``). Its ``/model_info`` says nothing about
MoE, so the layout comes from the model's ``config.json``. megarl's trainer (router replay,
:attr:`RolloutSample.routed_experts`) keeps only the MoE layers' rows, in layer order:
``[tokens, moe_layers, top_k]``. :class:`RoutedExpertsLayout` converts between the two.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from megarl.config.model_info import ModelInfo, load_model_info


@dataclass(frozen=True)
class RoutedExpertsLayout:
    """SGLang's routed-experts rows: ``num_layers`` layers, ``top_k`` experts, MoE at ``moe_layers``."""

    num_layers: int
    """``num_hidden_layers``: rows per token on the wire."""
    moe_layers: tuple[int, ...]
    """Indices (ascending) of the layers that route tokens to experts."""
    top_k: int
    """``num_experts_per_tok``."""

    def __post_init__(self) -> None:
        if self.top_k < 1 or not self.moe_layers:
            raise ValueError(f"routed experts layout: top_k={self.top_k}, moe_layers="
                             f"{self.moe_layers}; the model has no routed experts")
        if list(self.moe_layers) != sorted(set(self.moe_layers)) or not (
                0 <= self.moe_layers[0] and self.moe_layers[-1] < self.num_layers):
            raise ValueError(f"routed experts layout: moe_layers {self.moe_layers} must be "
                             f"ascending indices below num_layers={self.num_layers}")

    @classmethod
    def from_model_info(cls, info: ModelInfo) -> RoutedExpertsLayout | None:
        """The layout of a model's config (None for a dense model)."""
        if not info.is_moe:
            return None
        dense = set(info.dense_layers)
        moe = tuple(i for i in range(info.num_layers) if i not in dense)
        return cls(info.num_layers, moe, info.top_k) if moe else None

    @classmethod
    def from_model_path(cls, path: str | Path) -> RoutedExpertsLayout | None:
        """The layout read from ``path/config.json`` (None for a dense model)."""
        return cls.from_model_info(load_model_info(path))

    def moe_rows(self, routes: torch.Tensor) -> torch.Tensor:
        """``[tokens, num_layers, top_k]`` (the wire) -> ``[tokens, len(moe_layers), top_k]``."""
        if routes.dim() != 3 or tuple(routes.shape[1:]) != (self.num_layers, self.top_k):
            raise ValueError(f"routed experts of shape {tuple(routes.shape)}; expected "
                             f"[tokens, {self.num_layers}, {self.top_k}]")
        return routes[:, list(self.moe_layers)]

    def all_layers(self, routes: torch.Tensor) -> torch.Tensor:
        """``[tokens, len(moe_layers), top_k]`` -> ``[tokens, num_layers, top_k]``, dense
        layers 0 (as SGLang leaves them)."""
        if routes.dim() != 3 or tuple(routes.shape[1:]) != (len(self.moe_layers), self.top_k):
            raise ValueError(f"routed experts of shape {tuple(routes.shape)}; expected "
                             f"[tokens, {len(self.moe_layers)}, {self.top_k}]")
        out = routes.new_zeros((routes.shape[0], self.num_layers, self.top_k))
        out[:, list(self.moe_layers)] = routes
        return out
