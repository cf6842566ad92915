"""megatron-core's DDP, (distributed) optimizer and LR schedule around an ActorModel, and one
guarded optimizer step: a non-finite loss or gradient norm skips the update (PITFALLS T5)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megarl.megatron.model import ActorModel
from megarl.megatron.settings import OptimizerSettings
from megarl.megatron.wgrad_fusion import fuse_weight_gradients


@dataclass
class StepResult:
    """What one optimizer step did."""

    updated: bool
    """False when the step was skipped (non-finite loss or gradient)."""
    grad_norm: float
    """Global gradient norm before clipping (may be nan/inf when skipped)."""
    lr: float
    """Learning rate used (or that would have been used) by this step."""


class TrainableActor:
    """An ActorModel whose chunks are wrapped in megatron DDP, with optimizer and schedule."""

    def __init__(self, model: ActorModel, settings: OptimizerSettings,
                 fuse_wgrad: bool = True) -> None:
        """``fuse_wgrad``: megatron's linear layers add their weight gradients straight into
        the fp32 gradient buffers on CUDA (:mod:`~megarl.megatron.wgrad_fusion`; off for CUDA
        graphs)."""
        config = model.config
        moe_with_tp = config.num_moe_experts and config.tensor_model_parallel_size > 1
        if moe_with_tp and not config.sequence_parallel:
            raise ValueError(
                "training an MoE model with tp > 1 needs sequence parallelism (a megatron "
                "requirement); leave parallel.sequence_parallel unset or True"
            )
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=settings.use_distributed_optimizer,
        )
        model.chunks = [
            DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=i > 0)
            for i, chunk in enumerate(model.chunks)
        ]
        self.model = model
        self.settings = settings
        self.fused_wgrad_layers = fuse_weight_gradients(model.chunks) if fuse_wgrad else 0
        self.optimizer = get_megatron_optimizer(_optimizer_config(model, settings), model.chunks)
        fuse_torch_adam(self.optimizer)
        self.scheduler = _scheduler(self.optimizer, settings)
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = self.optimizer.scale_loss

    def zero_grad(self) -> None:
        """Clear the DDP gradient buffers and the optimizer's gradients."""
        for chunk in self.model.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()

    def current_lr(self) -> float:
        """The learning rate of the first parameter group."""
        return float(self.optimizer.param_groups[0]["lr"])

    @torch.no_grad()
    def step(self, loss_is_finite: bool) -> StepResult:
        """Clip and apply the reduced gradients unless the loss or gradient norm is non-finite.

        Every rank must call this with the same ``loss_is_finite`` (the grad norm is global).
        """
        lr = self.current_lr()
        found_inf = self.optimizer.prepare_grads()
        grad_norm = float(self.optimizer.get_grad_norm())
        if found_inf or not loss_is_finite or not math.isfinite(grad_norm):
            self.zero_grad()
            return StepResult(updated=False, grad_norm=grad_norm, lr=lr)
        self._clip(grad_norm)
        self.optimizer.step_with_ready_grads()
        self.scheduler.step(increment=1)
        return StepResult(updated=True, grad_norm=grad_norm, lr=lr)

    def _clip(self, grad_norm: float) -> None:
        """Scale the main gradients so that their global norm is at most ``grad_clip``.

        (megatron's ``clip_grad_by_total_norm_fp32`` asserts CUDA tensors; this is the same
        scaling, on any device.)
        """
        coeff = self.settings.grad_clip / (grad_norm + 1e-6)
        if self.settings.grad_clip <= 0 or coeff >= 1.0:
            return
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            for param in opt.get_parameters():
                if param.grad is not None:
                    param.grad.mul_(coeff)


def fuse_torch_adam(optimizer: Any) -> int:
    """Switch torch's Adam(W), which megatron falls back to without TE and apex, to its fused
    CUDA kernel where every parameter of a group is a CUDA tensor: one kernel per group instead
    of the foreach path, which also holds a temporary the size of the fp32 parameters (the
    square roots of ``exp_avg_sq``) through the step. Returns the groups switched. The state's
    ``step`` is made on the parameter's device for a fused group on its first step, so this
    must run before the first step (or a checkpoint's load, which places it as torch does)."""
    switched = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW) or inner.state:
            continue
        for group in inner.param_groups:
            params = group["params"]
            if params and not group.get("differentiable") and all(
                    p.device.type == "cuda" and p.dtype.is_floating_point for p in params):
                group["fused"], group["foreach"] = True, False
                switched += 1
    return switched


def _optimizer_config(model: ActorModel, settings: OptimizerSettings) -> OptimizerConfig:
    config = model.config
    return OptimizerConfig(
        optimizer=settings.optimizer,
        lr=settings.lr,
        min_lr=settings.min_lr,
        weight_decay=settings.weight_decay,
        adam_beta1=settings.betas[0],
        adam_beta2=settings.betas[1],
        sgd_momentum=0.0,
        bf16=config.bf16,
        fp16=config.fp16,
        params_dtype=config.params_dtype,
        # clipping is applied by TrainableActor.step after the finiteness check
        clip_grad=0.0,
        use_distributed_optimizer=settings.use_distributed_optimizer,
    )


def _scheduler(optimizer: Any, settings: OptimizerSettings) -> OptimizerParamScheduler:
    warmup = settings.lr_warmup_steps
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if warmup else settings.lr,
        max_lr=settings.lr,
        min_lr=settings.min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=max(settings.total_steps, warmup + 1),
        lr_decay_style=settings.lr_decay_style,
        start_wd=settings.weight_decay,
        end_wd=settings.weight_decay,
        wd_incr_steps=max(settings.total_steps, 1),
        wd_incr_style="constant",
    )
