"""Partial rollouts: samples paused at a weight sync continue under the new weights.

At a sync in ``fully_async`` mode with ``scheduler.partial_rollout``, the engines are paused with
``mode=abort``: every request in flight returns what it generated so far (finish reason
``abort``). After the new weights are in, each such sample is sent again as a *continuation*:
its prompt is the original prompt plus the tokens generated so far (the engine prefills them
with the new weights), it asks for the tokens still allowed, and keeps the sample's seed. The
answer is appended to the prefix; :func:`merge` records per token the weight version that
generated it (``RolloutSample.token_weight_versions``), so staleness and off-policy corrections
know which tokens came from which weights. The engine's log-probs of each token are the ones
of the weights that sampled it, and so are its routed experts (R3): the continuation's prefill
recomputes routes for the prompt and the earlier tokens under the new weights, but those are
not the routes that produced the earlier tokens, so :func:`merge` keeps the prefix's recorded
routes and takes from the continuation only the rows of the forward steps it sampled from.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from megarl.rollout.interface import RolloutSample, SamplingParams


def continuation(sample: RolloutSample,
                 params: SamplingParams) -> tuple[list[int], SamplingParams] | None:
    """The prompt and sampling parameters that continue an aborted sample generated with
    ``params`` (one sample); None when it already has every token it may have."""
    done = len(sample.response_ids)
    remaining = params.max_new_tokens - done
    if remaining <= 0:
        return None
    return (list(sample.prompt_ids) + list(sample.response_ids),
            replace(params, n=1, max_new_tokens=remaining,
                    min_new_tokens=max(0, params.min_new_tokens - done)))


def merge(prefix: RolloutSample, piece: RolloutSample) -> RolloutSample:
    """``prefix`` followed by the continuation ``piece`` (whose prompt is prefix's prompt plus
    its response): tokens, log-probs and routed experts (see :func:`stitch_routes`)
    concatenated, per-token versions recorded; finish reason and final version come from the
    piece."""
    if list(piece.prompt_ids) != list(prefix.prompt_ids) + list(prefix.response_ids):
        raise ValueError(f"sample {prefix.rid}: the continuation's prompt is not the original "
                         "prompt plus the tokens generated so far")
    log_probs = None
    if prefix.log_probs is not None and piece.log_probs is not None:
        log_probs = list(prefix.log_probs) + list(piece.log_probs)
    versions = (list(prefix.token_weight_versions) if prefix.token_weight_versions is not None
                else [str(prefix.weight_version)] * len(prefix.response_ids))
    versions += [str(piece.weight_version)] * len(piece.response_ids)
    return replace(
        prefix, response_ids=list(prefix.response_ids) + list(piece.response_ids),
        log_probs=log_probs, finish_reason=piece.finish_reason,
        weight_version=piece.weight_version, routed_experts=stitch_routes(prefix, piece),
        matched_stop=piece.matched_stop, token_weight_versions=versions,
        extra={**prefix.extra, "resumed": int(prefix.extra.get("resumed", 0)) + 1})


def stitch_routes(prefix: RolloutSample, piece: RolloutSample) -> torch.Tensor | None:
    """Routed experts of ``prefix`` + ``piece``: the ``len(prompt) + len(response) - 1`` rows
    the prefix recorded while it generated (prompt and earlier tokens under the earlier
    weights), then the continuation's rows from there on (the forward steps whose logits
    sampled its tokens, the first being the prefill of the prefix's last token). The
    continuation's rows before that are its prefill's recomputation under the new weights and
    are dropped. Without routes of the prefix (an engine that returns none for an aborted
    request) only the continuation's, recomputed ones, are there to use."""
    if piece.routed_experts is None or prefix.routed_experts is None:
        return prefix.routed_experts if not piece.response_ids else piece.routed_experts
    kept = len(prefix.prompt_ids) + len(prefix.response_ids) - 1
    if prefix.routed_experts.shape[0] != kept or piece.routed_experts.shape[0] < kept:
        raise ValueError(
            f"sample {prefix.rid}: routed experts have {prefix.routed_experts.shape[0]} rows "
            f"before the abort and {piece.routed_experts.shape[0]} in the continuation; "
            f"expected {kept} and at least {kept} (one per token fed to the model)")
    return torch.cat([prefix.routed_experts, piece.routed_experts[kept:]])
