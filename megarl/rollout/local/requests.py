"""The embedded engine's requests and their samples (one row of the running batch each), the
contexts waiting to be prefilled, and a finished sample as the HTTP layer reports it."""

from __future__ import annotations

import concurrent.futures
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from megarl.rollout.interface import SamplingParams
from megarl.rollout.local.sampling import RowSampling


@dataclass
class Request:
    """One prompt with its sampling parameters; resolves ``future`` with its samples."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    return_logprob: bool = True
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    lora: str | None = None
    """The LoRA adapter the prompt is generated with (``lora_path``; None: the base model)."""
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    created: float = field(default_factory=time.monotonic)
    samples: list[Sample] = field(default_factory=list)
    sample_rids: list[str] = field(default_factory=list)
    """The rid of each sample: ``rid`` when n == 1, else a fresh uuid per sample and ``rid``
    names none of them (as SGLang does, so aborting ``rid`` is a no-op)."""

    def __post_init__(self) -> None:
        if not self.sample_rids:
            self.sample_rids = ([self.rid] if self.params.n == 1
                                else [uuid.uuid4().hex for _ in range(self.params.n)])


@dataclass
class Sample:
    """One row being generated."""

    request: Request
    index: int
    rid: str
    """This sample's request id (what ``/abort_request`` matches)."""
    max_new_tokens: int
    sampling: RowSampling
    stop_ids: frozenset[int]
    """Tokens that end the sample (stop_token_ids, plus EOS unless ignore_eos)."""
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    route_chunks: list[torch.Tensor] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    weight_version: str = ""

    @property
    def prompt_length(self) -> int:
        """Tokens of the request's prompt."""
        return len(self.request.prompt_ids)


@dataclass
class SampleResult:
    """A finished sample as the HTTP layer reports it."""

    rid: str
    index: int
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float] | None
    finish_reason: dict[str, Any]
    weight_version: str
    routed_experts: torch.Tensor | None
    e2e_latency: float


@dataclass
class Prefill:
    """Rows that share one context to prefill (a new prompt's samples, or a retracted row)."""

    samples: list[Sample]
    context: list[int]

    @classmethod
    def retracted(cls, sample: Sample) -> Prefill:
        """A running row taken out with its tokens: prefilled again with prompt + drawn tokens."""
        return cls([sample], sample.request.prompt_ids + sample.output_ids)
