"""SGLang ``/generate`` payloads out, :class:`RolloutSample` in, across SGLang versions.

Differences tolerated when decoding (see shared/reference/SGLANG_API.md):
- ``finish_reason``: ``{"type": "stop"|"length"|"abort", "matched": ...}``, or a bare string
  (old versions), or None;
- ``output_token_logprobs``: ``[logprob, token_id, text]`` or ``[logprob, token_id]`` entries;
- response token ids: top-level ``output_ids``, else the ids inside ``output_token_logprobs``;
- ``routed_experts``: base64 of int32 values or a nested list, ``(tokens, num_hidden_layers,
  top_k)`` (every layer, dense ones too); the MoE layers' rows are kept, as int16
  ``(tokens, moe_layers, top_k)`` (:class:`RoutedExpertsLayout`);
- ``weight_version``: absent before SGLang added it (then None).
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import torch

from megarl.rollout.interface import RolloutSample, SamplingParams
from megarl.rollout.routed_experts import RoutedExpertsLayout

KNOWN_META = {"id", "finish_reason", "output_token_logprobs", "routed_experts",
              "weight_version", "input_token_logprobs"}


class ResponseFormatError(ValueError):
    """An engine answer that cannot be decoded."""


def generate_payload(prompt_ids: list[int], params: SamplingParams | list[SamplingParams], *,
                     rid: str | None = None, rids: list[str] | None = None,
                     return_logprob: bool, return_routed_experts: bool) -> dict[str, Any]:
    """The JSON body of one ``/generate`` request: one prompt with ``params`` (``params.n``
    samples), or, with a list of params and ``rids``, a batch of that prompt with one item per
    params (SGLang's list form; a single item is sent as a plain request)."""
    if isinstance(params, list):
        if rids is None or len(rids) != len(params):
            raise ValueError("generate_payload: give one rid per item of params")
        if len(params) == 1:
            params, rid = params[0], rids[0]
        else:
            body: dict[str, Any] = {
                "input_ids": [list(prompt_ids) for _ in params],
                "sampling_params": [p.to_sglang() for p in params],
                "return_logprob": return_logprob,
                "rid": list(rids),
            }
            if return_routed_experts:
                body["return_routed_experts"] = True
            return body
    body = {
        "input_ids": list(prompt_ids),
        "sampling_params": params.to_sglang(),
        "return_logprob": return_logprob,
        "rid": rid,
    }
    if return_routed_experts:
        body["return_routed_experts"] = True
    return body


def parse_finish_reason(raw: Any) -> tuple[str, int | None]:
    """(``stop`` | ``length`` | ``abort``, matched stop token id or None)."""
    if raw is None:
        return "length", None
    if isinstance(raw, str):
        kind, matched = raw, None
    elif isinstance(raw, dict):
        kind, matched = str(raw.get("type", "stop")), raw.get("matched")
    else:
        raise ResponseFormatError(f"finish_reason: unexpected value {raw!r}")
    kind = {"eos": "stop", "stop_token": "stop", "max_tokens": "length"}.get(kind, kind)
    if kind not in ("stop", "length", "abort"):
        raise ResponseFormatError(f"finish_reason: unknown type {kind!r}")
    return kind, matched if isinstance(matched, int) else None


def decode_routed_experts(raw: Any, layout: RoutedExpertsLayout | None) -> torch.Tensor:
    """``meta_info.routed_experts`` (every layer) -> int16 ``[tokens, moe_layers, top_k]``."""
    if layout is None:
        raise ResponseFormatError("routed_experts: the layout is unknown; pass "
                                  "routed_experts_layout=RoutedExpertsLayout.from_model_path("
                                  "model_path) to SGLangClient")
    if isinstance(raw, str):
        data = base64.b64decode(raw)
        if len(data) % 4:
            raise ResponseFormatError(f"routed_experts: {len(data)} bytes is not a whole "
                                      "number of int32 values")
        values = np.frombuffer(data, dtype=np.int32)
    else:
        values = np.asarray(raw, dtype=np.int32).reshape(-1)
    width = layout.num_layers * layout.top_k
    if values.size % width:
        raise ResponseFormatError(f"routed_experts: {values.size} values do not divide into "
                                  f"rows of {layout.num_layers} layers x {layout.top_k} "
                                  "experts; check routed_experts_layout against the served "
                                  "model's config.json")
    routes = torch.from_numpy(values.astype(np.int16)).view(-1, layout.num_layers, layout.top_k)
    return layout.moe_rows(routes).contiguous()


def _one_sample(item: dict[str, Any], prompt_ids: list[int], prompt_index: int,
                sample_index: int, layout: RoutedExpertsLayout | None) -> RolloutSample:
    if not isinstance(item, dict) or "meta_info" not in item:
        raise ResponseFormatError(f"generate answer item without meta_info: {str(item)[:200]}")
    meta = item["meta_info"]
    logprob_entries = meta.get("output_token_logprobs")
    log_probs = None
    if logprob_entries is not None:
        log_probs = [float(e[0]) if isinstance(e, (list, tuple)) else float(e)
                     for e in logprob_entries]
    ids = item.get("output_ids")
    if ids is None and logprob_entries is not None:
        ids = [int(e[1]) for e in logprob_entries]
    if ids is None:
        raise ResponseFormatError("generate answer has neither output_ids nor "
                                  "output_token_logprobs; start SGLang with "
                                  "--skip-tokenizer-init or ask return_logprob")
    reason, matched = parse_finish_reason(meta.get("finish_reason"))
    routes = meta.get("routed_experts")
    version = meta.get("weight_version")
    return RolloutSample(
        prompt_index=prompt_index, sample_index=sample_index, prompt_ids=list(prompt_ids),
        response_ids=[int(t) for t in ids], log_probs=log_probs, finish_reason=reason,
        weight_version=None if version is None else str(version),
        routed_experts=None if routes is None else decode_routed_experts(routes, layout),
        rid=str(meta.get("id", "")), matched_stop=matched,
        extra={k: v for k, v in meta.items() if k not in KNOWN_META},
    )


def decode_generate_answer(answer: Any, prompt_ids: list[int], prompt_index: int,
                           layout: RoutedExpertsLayout | None = None) -> list[RolloutSample]:
    """The samples of one prompt's ``/generate`` answer (an object, or a list when n > 1)."""
    items = answer if isinstance(answer, list) else [answer]
    return [_one_sample(item, prompt_ids, prompt_index, j, layout)
            for j, item in enumerate(items)]
