"""What the trainer hands the Megatron workers: the actor's and critic's specs and the settings
they carry. Plain dataclasses without megatron-core, so that the driver builds them from the run
config without importing megatron (seconds of every start); the modules that use them
(optimizer, update, model, critic, the workers) re-export their names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from megarl.config.lora_layers import LORA_TARGETS
from megarl.megatron.offload import OffloadSettings
from megarl.megatron.parallel import ParallelSizes


@dataclass(frozen=True)
class OptimizerSettings:
    """Optimizer and schedule of the actor (field names follow ``actor.optim`` in the config)."""

    lr: float = 1e-6
    """Peak learning rate."""
    weight_decay: float = 0.01
    """Decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam beta1, beta2."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0 to ``lr``."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """Decay after warm-up, down to ``min_lr`` at ``total_steps``."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    total_steps: int = 1
    """Optimizer steps of the whole run (the decay horizon)."""
    grad_clip: float = 1.0
    """Global gradient-norm clipping threshold; 0 turns clipping off."""
    use_distributed_optimizer: bool = True
    """Shard optimizer states over data-parallel ranks."""
    optimizer: Literal["adam", "sgd"] = "adam"
    """Adam (training) or plain SGD without momentum (exact-update tests)."""

    def __post_init__(self) -> None:
        if self.optimizer == "sgd" and self.use_distributed_optimizer:
            raise ValueError(
                "optimizer='sgd' with use_distributed_optimizer=True: megatron shards Adam "
                "states only; set use_distributed_optimizer=False"
            )


@dataclass(frozen=True)
class LoraSettings:
    """LoRA adapters on the actor's linear layers (field names follow ``actor.lora``)."""

    rank: int = 0
    """Adapter rank r; 0 = no adapters (full fine-tuning)."""
    alpha: float = 16.0
    """The adapter's output is scaled by ``alpha / rank``."""
    dropout: float = 0.0
    """Dropout on the adapter's input while training."""
    target_modules: tuple[str, ...] | None = None
    """Which linear layers get adapters (:data:`LORA_TARGETS`); None = those of
    :data:`~megarl.config.lora_layers.DEFAULT_TARGETS` the model has."""
    exclude_modules: tuple[str, ...] = ()
    """fnmatch patterns over ``layers.{i}.{path}`` (global layer index ``i``, e.g.
    ``layers.0.self_attention.linear_qkv``, ``layers.1.*``) of targeted layers left without."""
    seed: int = 1234
    """Seed of the adapters' initial A matrices (the same on every layout)."""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.target_modules or ()) - set(LORA_TARGETS))
        if unknown:
            raise ValueError(f"LoRA target_modules {unknown} unknown; choose from "
                             f"{', '.join(LORA_TARGETS)}")
        if self.rank < 0 or self.target_modules == ():
            raise ValueError("LoRA needs rank >= 0 and target_modules None or not empty")

    @property
    def enabled(self) -> bool:
        """Whether adapters are trained instead of the full weights."""
        return self.rank > 0

    @property
    def scale(self) -> float:
        """``alpha / rank``: the factor on ``B @ A``."""
        return self.alpha / self.rank


@dataclass(frozen=True)
class LossSettings:
    """The actor's loss (field names follow ``actor.*`` in the config)."""

    loss_mode: str = "vanilla"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    clip_cov_ratio: float = 2e-4
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 2e-4
    ppo_kl_coef: float = 1.0
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    loss_agg_mode: str = "token-mean"
    norm_len: float | None = None
    """The constant of ``seq-mean-token-sum-norm`` (``data.max_response_length``)."""
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"


@dataclass(frozen=True)
class ValueLossSettings:
    """The critic's loss (``critic.cliprange_value``; aggregation as the actor's)."""

    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"
    norm_len: float | None = None
    """The constant of ``seq-mean-token-sum-norm`` (``data.max_response_length``)."""


@dataclass(frozen=True)
class RecomputeSettings:
    """Activation recomputation of a trained model (``actor.recompute``)."""

    granularity: Literal["none", "selective", "full"] = "none"
    """none; selective = megatron's core-attention recompute; full = whole layers."""
    method: Literal["uniform", "block"] = "uniform"
    """full only: uniform = units of ``num_layers`` layers; block = the first ``num_layers``
    layers of each chunk."""
    num_layers: int = 1
    """full only: layers per unit (uniform) or recomputed layers per chunk (block)."""
    modules: tuple[str, ...] = ("core_attn",)
    """selective only: megatron's ``recompute_modules``."""

    def config_overrides(self) -> dict[str, Any]:
        """The TransformerConfig fields that turn it on (none for ``granularity="none"``)."""
        if self.granularity == "none":
            return {}
        if self.granularity == "selective":
            return {"recompute_granularity": "selective", "recompute_modules": list(self.modules)}
        return {"recompute_granularity": "full", "recompute_method": self.method,
                "recompute_num_layers": self.num_layers}


def recompute_settings(section: Any) -> RecomputeSettings:
    """The settings of an ``actor.recompute`` config section."""
    return RecomputeSettings(granularity=section.granularity, method=section.method,
                             num_layers=section.num_layers, modules=tuple(section.modules))


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ActorSpec:
    """What an ActorWorker needs to know, taken from the run config by the trainer."""

    model_path: str
    dtype: str
    sizes: ParallelSizes
    optim: OptimizerSettings
    loss: LossSettings
    with_ref: bool
    temperature: float
    max_tokens_per_micro_batch: int | None
    seed: int
    log_prob_max_tokens_per_micro_batch: int | None = None
    """Token budget of one micro-batch of the old-log-prob forward
    (``actor.log_prob_micro_batch_size_per_gpu``); None = ``max_tokens_per_micro_batch``."""
    ref_max_tokens_per_micro_batch: int | None = None
    """The same for the reference forward (``ref.log_prob_micro_batch_size_per_gpu``)."""
    init_checkpoint: str | None = None
    """A dist checkpoint with the first weights (``model.mcore_checkpoint``); None = the HF
    safetensors."""
    router_replay: bool = False
    """Build the actor's MoE routers able to record and replay routes (router replay R2/R3,
    or measuring how often the trainer routes like the rollout engine)."""
    cuda_graphs: bool = False
    """Replay the update's forward/backward from CUDA graphs (``actor.cuda_graphs``)."""
    cuda_graph_bucket_tokens: int = 1024
    offload: OffloadSettings = field(default_factory=OffloadSettings)
    """What the actor keeps in host memory while idle (``actor.offload``): offloaded when the
    worker starts (before colocated engines take the device) and after each update and weight
    sync (the trainer calls :meth:`ActorWorker.offload`); each phase brings back what it
    needs."""
    ref_param_offload: bool = False
    """Keep the reference model in host memory between its forwards (``ref.offload``)."""
    recompute: RecomputeSettings = field(default_factory=RecomputeSettings)
    """Activation recomputation of the actor (``actor.recompute``); the reference model only
    runs forwards without gradients and keeps no activations to recompute."""
    trust_remote_code: bool = False
    """Let the HF config load custom code shipped with the model (``model.trust_remote_code``)."""
    lora: LoraSettings = field(default_factory=LoraSettings)
    """LoRA adapters trained instead of the full weights (``actor.lora``; rank 0 = none): the
    actor is built with the native spec, frozen, given adapters, and syncs merged weights."""


@dataclass(frozen=True)
class CriticSpec:
    """What a CriticWorker needs to know, taken from the run config by the trainer."""

    model_path: str
    """HF directory the value model's body starts from (``critic.model_path``)."""
    dtype: str
    """Parameter dtype name (``model.dtype``)."""
    sizes: ParallelSizes
    """Megatron layout (``critic.parallel``)."""
    optim: OptimizerSettings
    """Optimizer and schedule (``critic.optim``, ``critic.grad_clip``)."""
    loss: ValueLossSettings
    """Value-loss clipping and aggregation."""
    max_tokens_per_micro_batch: int | None
    """Token budget of one packed micro-batch (None: one micro-batch per call)."""
    seed: int
    """Seed of the megatron RNGs and of the value head's initial weights."""
    recompute: RecomputeSettings = field(default_factory=RecomputeSettings)
    """Activation recomputation (``actor.recompute``, which the critic follows)."""
    offload: OffloadSettings = field(default_factory=OffloadSettings)
    """What the critic keeps in host memory between its phases (``critic.offload``); each
    phase brings back what it needs."""
    trust_remote_code: bool = False
    """Let the HF config load custom code shipped with the model (``model.trust_remote_code``)."""
