"""The rollout engine interface: sampling parameters, per-sample results, and ``RolloutEngine``.

Every rollout backend (SGLang servers, megarl's embedded engine) is driven through
:class:`RolloutEngine`. Prompts are token ids; each prompt yields ``n`` samples, each carrying the
engine's per-token log-probs, the finish reason, the ``weight_version`` that produced it and,
for MoE models when asked (R3), the experts the router chose for every token it processed.

Log-prob convention (the same as SGLang's default sampler): the log-prob of a sampled token is
``log_softmax(logits / temperature)`` at that token, i.e. after temperature scaling and before
top-k / top-p / min-p filtering; greedy decoding (``temperature == 0``) reports
``log_softmax(logits)``.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # annotations only: the rollout pool's supervisors need no torch
    import torch

FinishReason = Literal["stop", "length", "abort"]
PauseMode = Literal["abort", "retract", "in_place"]

# SGLang sampling fields that change nothing about the generated token ids; accepted and ignored.
IGNORED_SGLANG_SAMPLING_KEYS = frozenset({
    "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "custom_params",
})
# SGLang sampling fields megarl does not implement: accepted only at their neutral value.
NEUTRAL_SGLANG_SAMPLING_VALUES: dict[str, Any] = {
    "stop": None, "frequency_penalty": 0.0, "presence_penalty": 0.0,
    "repetition_penalty": 1.0, "logit_bias": None, "json_schema": None, "regex": None,
    "ebnf": None, "structural_tag": None,
}


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one prompt's responses; field names follow SGLang's ``sampling_params``."""

    max_new_tokens: int = 128
    """Upper bound on generated tokens per sample (fewer when the context length is reached)."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 keeps every token."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 keeps all."""
    min_p: float = 0.0
    """Drop tokens whose probability is below ``min_p`` times the top token's; 0 disables."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a sample (in addition to the model's EOS unless ``ignore_eos``)."""
    n: int = 1
    """Samples per prompt."""
    seed: int | None = None
    """Per-prompt sampling seed (SGLang ``sampling_seed``); the client sends sample j as its own
    request with ``seed + j``. Engines honour it only with ``--enable-deterministic-inference``,
    and then give all samples of one n > 1 request the same seed."""
    ignore_eos: bool = False
    """Do not stop at the model's EOS token."""
    min_new_tokens: int = 0
    """Stop tokens are masked out until this many tokens were generated."""

    def __post_init__(self) -> None:
        problems = self._type_problems()
        if problems:
            raise ValueError("; ".join(problems))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        problems = self.problems()
        if problems:
            raise ValueError("; ".join(problems))

    def _type_problems(self) -> list[str]:
        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        out = [f"sampling_params.{name}: expected an integer, got {getattr(self, name)!r}"
               for name in ("max_new_tokens", "top_k", "n", "min_new_tokens")
               if not is_int(getattr(self, name))]
        out += [f"sampling_params.{name}: expected a number, got {getattr(self, name)!r}"
                for name in ("temperature", "top_p", "min_p")
                if not (is_int(getattr(self, name)) or isinstance(getattr(self, name), float))]
        if self.seed is not None and not is_int(self.seed):
            out.append(f"sampling_params.sampling_seed: expected an integer, got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            out.append(f"sampling_params.ignore_eos: expected true/false, got {self.ignore_eos!r}")
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(is_int(t) for t in ids):
            out.append(f"sampling_params.stop_token_ids: expected a list of token ids, got {ids!r}")
        return out

    def problems(self) -> list[str]:
        """Every invalid field, as ``field: what is wrong — fix`` lines."""
        out = []
        if self.max_new_tokens <= 0:
            out.append(f"sampling_params.max_new_tokens: {self.max_new_tokens} must be > 0")
        if self.temperature < 0:
            out.append(f"sampling_params.temperature: {self.temperature} must be >= 0 "
                       "(0 = greedy)")
        if not 0.0 < self.top_p <= 1.0:
            out.append(f"sampling_params.top_p: {self.top_p} must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            out.append(f"sampling_params.top_k: {self.top_k} must be -1 (all) or >= 1")
        if not 0.0 <= self.min_p <= 1.0:
            out.append(f"sampling_params.min_p: {self.min_p} must be in [0, 1]")
        if self.n < 1:
            out.append(f"sampling_params.n: {self.n} must be >= 1")
        if self.min_new_tokens < 0:
            out.append(f"sampling_params.min_new_tokens: {self.min_new_tokens} must be >= 0")
        if any(t < 0 for t in self.stop_token_ids):
            out.append("sampling_params.stop_token_ids: token ids must be >= 0")
        return out

    @property
    def greedy(self) -> bool:
        """True when decoding takes the arg-max token."""
        return self.temperature == 0.0 or self.top_k == 1

    def to_sglang(self) -> dict[str, Any]:
        """The ``sampling_params`` object of an SGLang ``/generate`` request."""
        out = asdict(self)
        out["stop_token_ids"] = list(self.stop_token_ids)
        seed = out.pop("seed")
        if seed is not None:
            out["sampling_seed"] = seed
        return out

    @classmethod
    def from_sglang(cls, data: dict[str, Any]) -> SamplingParams:
        """Parse SGLang's ``sampling_params``; unknown or unsupported fields raise ValueError."""
        known = {f for f in cls.__dataclass_fields__ if f != "seed"} | {"sampling_seed"}
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if key in IGNORED_SGLANG_SAMPLING_KEYS:
                continue
            if key in NEUTRAL_SGLANG_SAMPLING_VALUES:
                if value not in (NEUTRAL_SGLANG_SAMPLING_VALUES[key], None, [], ""):
                    raise ValueError(f"sampling_params.{key}: not supported by this engine; "
                                     "remove it (use stop_token_ids for stopping)")
                continue
            if key not in known:
                raise ValueError(f"sampling_params.{key}: unknown field; known fields: "
                                 f"{', '.join(sorted(known))}")
            kwargs["seed" if key == "sampling_seed" else key] = value
        if kwargs.get("stop_token_ids") is None:
            kwargs.pop("stop_token_ids", None)
        top_k = kwargs.get("top_k")
        if isinstance(top_k, int) and top_k < 0:
            kwargs["top_k"] = -1
        return cls(**{k: v for k, v in kwargs.items() if v is not None or k == "seed"})


@dataclass
class RolloutSample:
    """One generated response and what the trainer needs from the engine about it."""

    prompt_index: int
    """Position of the prompt in the ``generate`` call."""
    sample_index: int
    """Which of the prompt's ``n`` samples this is."""
    prompt_ids: list[int]
    response_ids: list[int]
    log_probs: list[float] | None
    """Engine log-prob of each response token (see the module docstring); None if not asked."""
    finish_reason: FinishReason
    weight_version: str | None
    """The engine's weight version when the sample finished."""
    routed_experts: torch.Tensor | None = None
    """int16 ``[len(prompt) + len(response) - 1, moe_layers, top_k]``: experts chosen for each
    token the model processed (row t = token t of prompt+response); the last response token was
    never fed back, so it has no row."""
    rid: str = ""
    matched_stop: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    """Other ``meta_info`` fields of the engine's answer (latency, cached tokens, ...)."""
    token_weight_versions: list[str] | None = None
    """Per response token, the weight version that generated it, for a partial rollout that
    was resumed under newer weights (:mod:`megarl.scheduler.partial`); None = every token
    comes from ``weight_version``."""
    response_mask: list[int] | None = None
    """Per response token, 1 if the model generated it (trained on) and 0 if an environment
    added it (tool output, chat-template glue of a multi-turn episode,
    :mod:`megarl.rollout.agent`); None = every response token is the model's."""

    def response_routed_experts(self) -> torch.Tensor | None:
        """``[len(response), moe_layers, top_k]``: the routes of the forward step that produced
        each response token's logits (rows ``len(prompt) - 1 ...`` of ``routed_experts``)."""
        if self.routed_experts is None:
            return None
        return self.routed_experts[len(self.prompt_ids) - 1:]


class RolloutEngine(abc.ABC):
    """Asynchronous handle on one or more rollout engines (generation plus weight receiving)."""

    @abc.abstractmethod
    async def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        return_logprob: bool = True,
        return_routed_experts: bool = False,
        rids: Sequence[str] | None = None,
    ) -> list[RolloutSample]:
        """Generate ``params.n`` samples per prompt; results are prompt-major
        (index ``i * n + j``). ``rids`` name the prompts for :meth:`abort`."""

    @abc.abstractmethod
    async def abort(self, rid: str | None = None) -> None:
        """Abort one request (by rid) or, with None, every request in flight."""

    @abc.abstractmethod
    async def pause(self, mode: PauseMode = "retract") -> None:
        """Stop scheduling generation (``abort`` drops in-flight requests, ``retract`` re-runs
        them after :meth:`resume`, ``in_place`` keeps their state)."""

    @abc.abstractmethod
    async def resume(self) -> None:
        """Continue generation after :meth:`pause`."""

    @abc.abstractmethod
    async def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Free engine memory (``weights``, ``kv_cache``, ``cuda_graph``; None = all) while
        colocated training runs."""

    @abc.abstractmethod
    async def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """Take back the memory freed by :meth:`release_memory`."""

    @abc.abstractmethod
    async def init_weights_update_group(
        self, master_address: str, master_port: int, world_size: int,
        group_name: str = "weight_update_group", backend: str = "nccl",
    ) -> None:
        """Join a process group with the trainer's sender (rank 0) for weight broadcasts."""

    @abc.abstractmethod
    async def update_weights_from_distributed(
        self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]], *,
        group_name: str = "weight_update_group", weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> None:
        """Receive one bucket of tensors that the sender broadcasts, in this order."""

    @abc.abstractmethod
    async def update_weights_from_disk(
        self, model_path: str, *, weight_version: str | None = None,
    ) -> None:
        """Reload weights from an HF model directory."""

    @abc.abstractmethod
    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[Any]:
        """The first ``truncate_size`` rows of a parameter (by HF name), from each engine."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections (servers keep running)."""
