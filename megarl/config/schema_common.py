"""Building blocks shared by several sections of the run config: the strict base class and the
parallel layout, optimizer and offload blocks that the actor, reference and critic each carry."""

from __future__ import annotations

import ipaddress
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

Dtype = Literal["bfloat16", "float16", "float32"]


class Section(BaseModel):
    """Base of every config section: unknown keys are rejected, defaults are validated too."""

    model_config = ConfigDict(extra="forbid", validate_default=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        """Refuse ``true``/``false`` where a number is expected (pydantic would read 1 or 0)."""
        if isinstance(value, bool) and info.field_name is not None:
            kinds = scalar_kinds(cls.model_fields[info.field_name].annotation)
            if bool not in kinds and kinds & {int, float}:
                kind = "int_type" if int in kinds else "float_type"
                raise PydanticCustomError(kind, "Input should be a number, not true/false")
        return value


def scalar_kinds(annotation: Any) -> set[type]:
    """The scalar types a field annotation admits (through unions, Optional and Literal)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return set().union(*(scalar_kinds(arg) for arg in typing.get_args(annotation)))
    if origin is Literal:
        return {type(arg) for arg in typing.get_args(annotation)}
    if origin is typing.Annotated:
        return scalar_kinds(typing.get_args(annotation)[0])
    return {annotation} if isinstance(annotation, type) else set()


class ParallelConfig(Section):
    """Megatron parallel layout of one role (actor, reference or critic) on the train pool.

    The train pool's GPUs are split as ``tp x pp x cp x dp``; expert layers are split as
    ``etp x ep x expert_dp`` inside each pipeline stage (megatron-core's rule).
    """

    tp: int = Field(1, ge=1, description=(
        "tensor-model-parallel size (Megatron `tensor_model_parallel_size`); must divide the "
        "model's attention heads"))
    pp: int = Field(1, ge=1, description=(
        "pipeline-model-parallel size (`pipeline_model_parallel_size`); must divide the number "
        "of layers"))
    vpp: int | None = Field(None, ge=1, description=(
        "virtual pipeline stages per pipeline rank (`virtual_pipeline_model_parallel_size`, "
        "interleaved schedule); null = off; needs pp > 1"))
    ep: int = Field(1, ge=1, description=(
        "expert-model-parallel size (`expert_model_parallel_size`); must divide the number of "
        "routed experts"))
    etp: int | None = Field(None, ge=1, description=(
        "expert-tensor-parallel size (`expert_tensor_parallel_size`); null = same as tp "
        "(megatron-core's default); 1 is usual for MoE"))
    cp: int = Field(1, ge=1, description=(
        "context-parallel size (`context_parallel_size`): each packed sequence is padded to a "
        "multiple of 2 x cp (x tp under sequence parallelism) and cut into 2 x cp chunks, rank "
        "r keeping chunks r and 2cp-1-r; the longest sequence must be divisible by 2 x cp; "
        "not with MLA models or actor.cuda_graphs"))
    sequence_parallel: bool = Field(True, description=(
        "Megatron sequence parallelism inside the TP group; only active when tp > 1, and "
        "required for MoE models with tp > 1"))

    @property
    def expert_tp(self) -> int:
        """The effective expert-tensor-parallel size (``etp``, or ``tp`` when unset)."""
        return self.tp if self.etp is None else self.etp


class OptimConfig(Section):
    """Optimizer (Adam) and learning-rate schedule of one trained role."""

    lr: float = Field(1e-6, gt=0, description="peak learning rate")
    weight_decay: float = Field(0.01, ge=0, description="decoupled weight decay (AdamW)")
    betas: tuple[float, float] = Field((0.9, 0.999), description="Adam beta1, beta2")
    lr_warmup_steps: int = Field(0, ge=0, description=(
        "optimizer steps of linear warm-up from 0 to `lr`"))
    lr_decay_style: Literal["constant", "linear", "cosine"] = Field("constant", description=(
        "learning-rate decay after warm-up, down to `min_lr` at the last optimizer step"))
    min_lr: float = Field(0.0, ge=0, description="learning rate at the end of the decay")


class OffloadConfig(Section):
    """What a trained role moves to host memory between its phases (verl's Megatron offload):
    while the engines generate, brought back by the phase that needs it. The critic keeps what
    is switched on in host memory outside its two phases (values, update). Gradients and
    optimizer state follow ``rollout.colocate`` unless set: colocated engines need the memory
    back (slime turns train offload on with ``--colocate`` for the same reason)."""

    param_offload: bool = Field(False, description=(
        "keep parameters in host memory (pinned) from the end of the weight sync to the next "
        "forward (old log-probs, values or a checkpoint); off by default"))
    grad_offload: bool | None = Field(None, description=(
        "free the gradient buffers from the end of an update to the next (they are zeroed "
        "before every update, so nothing is copied); null = on when `rollout.colocate` is true "
        "(the engines use the memory while they generate), off with a separate rollout pool"))
    optimizer_offload: bool | None = Field(None, description=(
        "keep fp32 main params and Adam states in host memory (pinned) between updates and "
        "through each update's forwards and backwards: they come to the GPU for the optimizer "
        "steps only, so the activations have their memory (one more round trip per extra "
        "mini-batch); null = on when `rollout.colocate` is true, off with a separate rollout "
        "pool"))
    optimizer_step_chunk_mb: int = Field(1024, ge=0, description=(
        "with `optimizer_offload`: an optimizer step brings the Adam moments (8 of the 12 bytes "
        "of state a parameter) to the GPU this many MiB at a time, the next chunk copied in and "
        "the last one out while one is updated, so the step holds ~3 chunks of them instead of "
        "all (same result, bit for bit); 0 = the whole state comes back for the step"))


def is_loopback_host(host: str) -> bool:
    """Whether binding ``host`` keeps a server reachable from this machine only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
