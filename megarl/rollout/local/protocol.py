"""SGLang's ``/generate`` request and response shapes, for the embedded engine.

:func:`parse_generate` turns a request body into engine :class:`Request` objects (one per prompt)
or raises :class:`BadRequest` naming the field and the fix; :func:`sample_to_sglang` writes a
finished sample as SGLang does: ``{"text", "output_ids", "meta_info"}`` (no ``text`` without a
tokenizer, as SGLang's ``--skip-tokenizer-init`` answers) with
``output_token_logprobs`` as ``[logprob, token_id, null]`` triples and ``routed_experts`` as
base64 of int32 values ``(tokens, num_hidden_layers, top_k)``: a row for every layer, 0 for the
dense ones, as SGLang's capturer leaves them.
"""

from __future__ import annotations

import base64
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from megarl.rollout.interface import SamplingParams
from megarl.rollout.local.engine import Request, SampleResult
from megarl.rollout.routed_experts import RoutedExpertsLayout

# Top-level /generate fields that would change the answer and that megarl does not implement.
UNSUPPORTED_TRUTHY = ("stream", "top_logprobs_num", "token_ids_logprob", "return_hidden_states",
                      "custom_logit_processor", "image_data", "audio_data", "video_data",
                      "input_embeds")


class BadRequest(ValueError):
    """A request the server answers with HTTP 400."""


class NormalizeError(BadRequest):
    """A request that SGLang's request normalisation rejects with ValueError; answered as
    SGLang's http_server answers it: HTTP 400 ``{"error": {"message": ...}}``."""


MIXED_N_MESSAGE = ("The parallel_sample_num should be the same for all samples in sample "
                   "params.")
"""SGLang's ValueError text for a batch whose prompts ask for different ``n``."""


@dataclass(frozen=True)
class Limits:
    """What the served model accepts."""

    vocab_size: int
    context_length: int
    has_router: bool


def _per_item(value: Any, count: int, field: str) -> list[Any]:
    """A scalar broadcast to ``count`` items, or a list of exactly ``count``."""
    if isinstance(value, list):
        if len(value) != count:
            raise BadRequest(f"{field}: a list of {len(value)} for a batch of {count} prompts; "
                             "give one value or one per prompt")
        return value
    return [value] * count


def _prompts(body: dict[str, Any], tokenizer: Any) -> tuple[list[list[int]], bool]:
    """Token ids of every prompt, and whether the request was a batch."""
    if ("input_ids" in body) == ("text" in body):
        raise BadRequest("give exactly one of input_ids (token ids) or text")
    if "text" in body:
        if tokenizer is None:
            raise BadRequest("text: this model directory has no tokenizer; send input_ids")
        texts = body["text"]
        batched = isinstance(texts, list)
        texts = texts if batched else [texts]
        if not all(isinstance(t, str) for t in texts):
            raise BadRequest("text: must be a string or a list of strings")
        return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts], batched
    ids = body["input_ids"]
    if not isinstance(ids, list):
        raise BadRequest("input_ids: must be a list of token ids or a list of such lists")
    batched = bool(ids) and isinstance(ids[0], list)
    prompts = ids if batched else [ids]
    for p in prompts:
        if not isinstance(p, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                              for t in p):
            raise BadRequest("input_ids: every token id must be an integer")
    return prompts, batched


def _check_prompt(index: int, prompt: list[int], limits: Limits) -> None:
    where = f"input_ids[{index}]"
    if not prompt:
        raise BadRequest(f"{where}: the prompt is empty; send at least one token")
    bad = [t for t in prompt if t < 0 or t >= limits.vocab_size]
    if bad:
        raise BadRequest(f"{where}: token id {bad[0]} is outside the vocabulary "
                         f"[0, {limits.vocab_size}); check the tokenizer and the model")
    if len(prompt) >= limits.context_length:
        raise BadRequest(f"{where}: the prompt has {len(prompt)} tokens, the model's context "
                         f"length is {limits.context_length}; shorten the prompt")


def _sampling(raw: Any, index: int) -> SamplingParams:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise BadRequest(f"sampling_params[{index}]: must be an object")
    try:
        return SamplingParams.from_sglang(raw)
    except (TypeError, ValueError) as err:
        raise BadRequest(str(err)) from None


def parse_generate(body: Any, limits: Limits, tokenizer: Any = None) -> tuple[list[Request], bool]:
    """Engine requests for a ``/generate`` body, and whether the answer is a list."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    for key in UNSUPPORTED_TRUTHY:
        if body.get(key):
            raise BadRequest(f"{key}: not supported by the embedded engine; remove it")
    prompts, batched = _prompts(body, tokenizer)
    if not prompts:
        raise BadRequest("input_ids: the batch is empty; send at least one prompt")
    count = len(prompts)
    sampling = _per_item(body.get("sampling_params"), count, "sampling_params")
    logprob = _per_item(body.get("return_logprob", False), count, "return_logprob")
    start_len = _per_item(body.get("logprob_start_len", -1), count, "logprob_start_len")
    routes = _per_item(body.get("return_routed_experts", False), count, "return_routed_experts")
    routes_start = _per_item(body.get("routed_experts_start_len", 0), count,
                             "routed_experts_start_len")
    rids = _per_item(body.get("rid"), count, "rid")
    loras = _per_item(body.get("lora_path"), count, "lora_path")
    if any(x is not None and not isinstance(x, str) for x in loras):
        raise BadRequest("lora_path: the name of a loaded LoRA adapter, or a list of them")
    if len({p.get("n", 1) for p in sampling if isinstance(p, dict)}) > 1:
        raise NormalizeError(MIXED_N_MESSAGE)
    requests = []
    for i, prompt in enumerate(prompts):
        _check_prompt(i, prompt, limits)
        params = _sampling(sampling[i], i)
        if start_len[i] is not None and not isinstance(start_len[i], int):
            raise BadRequest("logprob_start_len: must be an integer (-1 = output tokens only)")
        if start_len[i] is not None and 0 <= start_len[i] < len(prompt):
            raise BadRequest("logprob_start_len: input-token log-probs are not supported by "
                             "the embedded engine; use -1 (output tokens only)")
        if routes[i] and not limits.has_router:
            raise BadRequest("return_routed_experts: the model has no MoE router")
        if not isinstance(routes_start[i], int) or routes_start[i] < 0:
            raise BadRequest("routed_experts_start_len: must be an integer >= 0")
        rid = rids[i] if rids[i] is not None else uuid.uuid4().hex
        requests.append(Request(
            rid=str(rid), prompt_ids=prompt, params=params, return_logprob=bool(logprob[i]),
            return_routed_experts=bool(routes[i]), routed_experts_start_len=routes_start[i],
            lora=loras[i]))
    return requests, batched or any(r.params.n > 1 for r in requests)


def encode_routed_experts(routes: torch.Tensor, layout: RoutedExpertsLayout) -> str:
    """base64 of the int32 values of ``(tokens, num_hidden_layers, top_k)`` (SGLang's format)
    for the MoE layers' routes ``(tokens, moe_layers, top_k)``."""
    array = np.ascontiguousarray(layout.all_layers(routes).numpy().astype(np.int32))
    return base64.b64encode(array.tobytes()).decode("ascii")


def sample_to_sglang(result: SampleResult, tokenizer: Any = None,
                     layout: RoutedExpertsLayout | None = None) -> dict[str, Any]:
    """One element of SGLang's ``/generate`` answer (``id``: the sample's own rid)."""
    meta: dict[str, Any] = {
        "id": result.rid,
        "finish_reason": result.finish_reason,
        "prompt_tokens": len(result.prompt_ids),
        "completion_tokens": len(result.output_ids),
        "cached_tokens": 0,
        "weight_version": result.weight_version,
        "e2e_latency": result.e2e_latency,
    }
    if result.logprobs is not None:
        meta["output_token_logprobs"] = [
            [lp, tok, None] for lp, tok in zip(result.logprobs, result.output_ids)]
        meta["input_token_logprobs"] = []
    if result.routed_experts is not None:
        if layout is None:
            raise ValueError("routed experts captured but the model's layout is unknown")
        meta["routed_experts"] = encode_routed_experts(result.routed_experts, layout)
    if tokenizer is None:  # SGLang 0.5.10 tokenizer_manager.py: BatchTokenIDOutput has no text
        return {"output_ids": result.output_ids, "meta_info": meta}
    return {"text": tokenizer.decode(result.output_ids), "output_ids": result.output_ids,
            "meta_info": meta}
