"""A tiny model whose greedy output names the weight version that produced it, and a stand-in
for the trainer's weight sender.

Attention and MLP output projections are zero, so every position's hidden state is its token
embedding. Version ``v`` sets every embedding row to the unit vector ``e_d(v)`` and gives
``lm_head`` a single non-zero row, ``marker(v)``, equal to ``e_d(v)``: the model then emits
``marker(v)`` at every step, whatever the prompt. Embeddings and ``lm_head`` travel in two
buckets; a model holding one bucket of version ``v`` and the other of ``w != v`` has all logits
zero and emits :data:`MIXED` (token 0), so a half-updated model is visible in its output.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from megarl.data.tiny_model import make_tiny_model
from megarl.rollout.process import free_port
from megarl.rollout.sglang.client import SGLangClient
from megarl.rollout.weight_group import close_weight_update_group, open_weight_update_group

HIDDEN, VOCAB = 64, 128
MIXED = 0
"""What a model whose two buckets come from different versions emits."""
EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


def marker(version: int) -> int:
    """The token version ``version`` emits."""
    return 10 + version % 100


def version_tensors(version: int) -> dict[str, torch.Tensor]:
    """The two tensors that make the model emit ``marker(version)``."""
    direction = torch.zeros(HIDDEN)
    direction[1 + version % (HIDDEN - 1)] = 1.0
    lm_head = torch.zeros(VOCAB, HIDDEN)
    lm_head[marker(version)] = direction
    return {EMBED: direction.expand(VOCAB, HIDDEN).clone(), LM_HEAD: lm_head}


def make_versioned_model(path: Path) -> Path:
    """A tiny dense Qwen3 at version 0 (untied embeddings, zero output projections)."""
    model_dir = make_tiny_model(path, arch="qwen3", seed=0, with_tokenizer=False,
                                tie_word_embeddings=False)
    weights_file = model_dir / "model.safetensors"
    tensors = load_file(weights_file)
    for name in tensors:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = torch.zeros_like(tensors[name])
    tensors.update(version_tensors(0))
    save_file(tensors, weights_file, metadata={"format": "pt"})
    return model_dir


class WeightPusher:
    """Plays the trainer's actor rank 0: owns a gloo weight-update group with every engine of
    ``client`` and broadcasts versioned weights the way ``megarl.trainer.workers._weight_sync``
    does (one ``update_weights_from_distributed`` per bucket, the version on the last bucket)."""

    def __init__(self, client: SGLangClient) -> None:
        self.client = client
        self.group: dist.ProcessGroup | None = None
        self.version = 0
        self.pushes = 0

    async def open(self) -> None:
        """Form the group (sender = rank 0, engine i = rank 1 + i)."""
        port, world = free_port(), 1 + len(self.client.urls)
        self.group, _ = await asyncio.gather(
            asyncio.to_thread(open_weight_update_group, "127.0.0.1", port, 0, world,
                              "weight_update_group", "gloo"),
            self.client.init_weights_update_group("127.0.0.1", port, world, backend="gloo"))

    async def push(self, version: int) -> None:
        """Send version ``version`` to every engine, embeddings first, ``lm_head`` last."""
        tensors = version_tensors(version)
        for name in (EMBED, LM_HEAD):
            tensor = tensors[name]
            last = name == LM_HEAD
            await asyncio.gather(
                asyncio.to_thread(dist.broadcast, tensor, 0, self.group),
                self.client.update_weights_from_distributed(
                    [name], ["float32"], [list(tensor.shape)],
                    weight_version=str(version) if last else None, flush_cache=last))
        self.version = version
        self.pushes += 1

    async def regroup_and_push(self, restarted: list[int]) -> str:
        """The ``resync`` of :class:`~megarl.rollout.recovery.EngineRecovery`: re-form the
        group (the survivors leave the broken one) and push the current version to all."""
        survivors = [i for i in range(len(self.client.urls)) if i not in restarted]
        if survivors:
            await self.client.destroy_weights_update_group(engines=survivors)
        self.close()
        await self.open()
        await self.push(self.version)
        return str(self.version)

    def close(self) -> None:
        """Leave the group on the sender side."""
        if self.group is not None:
            close_weight_update_group(self.group)
            self.group = None
