"""Next-token sampling for a batch of rows with per-row parameters, and the reported log-probs.

Per row: stop tokens are masked to ``-inf`` until ``min_new_tokens`` (as SGLang's penalizer does),
logits are divided by the temperature, the reported log-prob is ``log_softmax`` of that (SGLang's
default), and the token is drawn from the distribution after top-k, top-p and min-p filtering
(all three measured on the temperature-scaled probabilities, as SGLang's torch sampler does).
Greedy rows (temperature 0 or top_k 1) take the arg-max and report ``log_softmax(logits)``.

:class:`BatchSampling` holds the rows' settings as tensors; the engine builds it once per batch
composition, so a decode step does no per-row Python work here beyond seeded rows' draws.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

LOGPROB_FLOOR = torch.finfo(torch.float32).min


@dataclass(frozen=True)
class RowSampling:
    """The sampling settings of one batch row."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    generator: torch.Generator | None = None
    """The row's own random stream (seeded requests); None draws from the engine's stream."""
    seed: int = 0
    """The row's key for the GPU's in-graph sampler (:class:`FusedSampling`): a token's draw is
    a function of this seed, the token's position and the logits alone."""

    @property
    def greedy(self) -> bool:
        """Whether the row takes the arg-max."""
        return self.temperature == 0.0 or self.top_k == 1


@dataclass
class BatchSampling:
    """The settings of every row of a batch, as tensors on the logits' device."""

    temperatures: torch.Tensor
    """``[B, 1]``; 1 for greedy rows."""
    sampled: torch.Tensor | None
    """Indices of the rows that sample (None when every row is greedy)."""
    filtered: list[int]
    """Positions within ``sampled`` whose top-k / top-p / min-p exclude tokens."""
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    generators: list[tuple[int, torch.Generator]]
    """(position within ``sampled``, generator) of seeded rows."""
    fused: FusedSampling | None = None
    """The rows' settings for the in-graph sampler; None when a row filters its distribution
    (top-k / top-p / min-p), which only :func:`sample_next` does."""

    @classmethod
    def build(cls, rows: Sequence[RowSampling], device: torch.device) -> BatchSampling:
        """Collect the rows' settings."""
        sampled = [i for i, r in enumerate(rows) if not r.greedy]
        sub = [rows[i] for i in sampled]
        filtered = [k for k, r in enumerate(sub) if r.top_k > 0 or r.top_p < 1 or r.min_p > 0]
        temps = [1.0 if r.greedy else r.temperature for r in rows]
        return cls(
            temperatures=torch.tensor(temps, device=device).unsqueeze(1),
            sampled=torch.tensor(sampled, device=device) if sampled else None,
            filtered=filtered,
            top_k=torch.tensor([sub[k].top_k for k in filtered], device=device),
            top_p=torch.tensor([sub[k].top_p for k in filtered], device=device,
                               dtype=torch.float64),
            min_p=torch.tensor([sub[k].min_p for k in filtered], device=device,
                               dtype=torch.float64),
            generators=[(k, r.generator) for k, r in enumerate(sub) if r.generator is not None],
            fused=None if filtered else FusedSampling(
                temperatures=torch.tensor([0.0 if r.greedy else r.temperature for r in rows],
                                          device=device),
                seeds=torch.tensor([r.seed for r in rows], dtype=torch.long, device=device)),
        )


@dataclass
class FusedSampling:
    """Per-row inputs of the fused GPU sampler that runs inside the decode step's CUDA graph
    (:func:`megarl.rollout.local.sampling_triton.gumbel_sample`): the same distribution as
    :func:`sample_next` for rows without top-k / top-p / min-p (exact Gumbel-max sampling from
    ``softmax(logits / temperature)``, the same reported log-prob), with each draw keyed by the
    row's seed and the token's position instead of a sequential random stream."""

    temperatures: torch.Tensor
    """``[B]`` fp32; 0 for greedy rows."""
    seeds: torch.Tensor
    """``[B]`` int64: :attr:`RowSampling.seed` of each row."""


def filter_probs(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor) -> torch.Tensor:
    """Zero the probabilities that top-k / top-p / min-p exclude; ``[B, V]`` -> ``[B, V]``.

    ``top_k`` <= 0 keeps all; a token is kept by top-p when the mass strictly before it (in
    descending order) is <= ``top_p``; min-p keeps tokens with ``p >= min_p * max(p)``.
    """
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device).unsqueeze(0)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    k = torch.where(top_k > 0, top_k, probs.shape[-1]).unsqueeze(1)
    drop = (rank >= k) | (mass_before > top_p.unsqueeze(1))
    drop |= sorted_probs < (min_p * sorted_probs[:, 0]).unsqueeze(1)
    drop[:, 0] = False
    kept = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, kept)


CDF_CHUNK = 2048
"""Vocabulary chunk of the two-level inverse-CDF search on GPUs."""


def inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row of ``weights [B, V]`` (unnormalised, >= 0), the first index whose running sum
    exceeds ``uniform * total``, never past the last positive weight: inverse-CDF sampling.

    On the CPU one cumulative sum over the row; on GPUs, where a scan over a few long rows is
    slow, :func:`chunked_inverse_cdf`.
    """
    if weights.device.type != "cpu" and weights.shape[-1] > CDF_CHUNK:
        return chunked_inverse_cdf(weights, uniforms)
    cdf = weights.cumsum(dim=-1)
    targets = uniforms * cdf[:, -1]
    picks = torch.searchsorted(cdf, targets.unsqueeze(1), right=True).squeeze(1)
    return torch.minimum(picks, (weights > 0).cumsum(-1).argmax(-1))


def chunked_inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """:func:`inverse_cdf` with the running sum found per ``CDF_CHUNK`` chunk of the vocabulary
    first, then inside the chosen chunk (the same picks up to fp64 rounding)."""
    rows, vocab = weights.shape
    chunks = -(-vocab // CDF_CHUNK)
    padded = F.pad(weights, (0, chunks * CDF_CHUNK - vocab)).view(rows, chunks, CDF_CHUNK)
    chunk_cdf = padded.sum(dim=-1).cumsum(dim=-1)
    targets = (uniforms * chunk_cdf[:, -1]).unsqueeze(1)
    chunk = torch.searchsorted(chunk_cdf, targets, right=True).clamp(max=chunks - 1)
    before = chunk_cdf.gather(1, (chunk - 1).clamp(min=0)) * (chunk > 0)
    inside = padded.gather(1, chunk.unsqueeze(-1).expand(-1, 1, CDF_CHUNK)).squeeze(1)
    offset = torch.searchsorted(inside.cumsum(dim=-1) + before, targets, right=True)
    picks = (chunk * CDF_CHUNK + offset.clamp(max=CDF_CHUNK - 1)).squeeze(1)
    index = torch.arange(vocab, device=weights.device)
    last_positive = torch.where(weights > 0, index, -1).amax(dim=-1)
    return torch.minimum(picks, last_positive)


def sample_next(
    logits: torch.Tensor, batch: BatchSampling, default_generator: torch.Generator,
    banned: Mapping[int, Sequence[int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits [B, V]``; returns (token ids [B], log-probs [B]) on
    the CPU. ``banned`` maps a row to token ids masked out for this step."""
    logits = logits.float()
    if banned:
        logits = logits.clone()
        for row, ids in banned.items():
            logits[row, list(ids)] = float("-inf")
    log_probs = torch.log_softmax(logits / batch.temperatures, dim=-1)
    tokens = logits.argmax(dim=-1)
    if batch.sampled is not None:
        kept = log_probs.index_select(0, batch.sampled).exp().double()
        if batch.filtered:
            rows = torch.tensor(batch.filtered, device=kept.device)
            kept[rows] = filter_probs(kept[rows], batch.top_k, batch.top_p, batch.min_p)
        uniforms = torch.rand(kept.shape[0], generator=default_generator, dtype=torch.float64)
        for k, generator in batch.generators:
            uniforms[k] = torch.rand(1, generator=generator, dtype=torch.float64)[0]
        tokens[batch.sampled] = inverse_cdf(kept, uniforms.to(kept.device))
    chosen = log_probs.gather(1, tokens.unsqueeze(1)).squeeze(1).clamp(min=LOGPROB_FLOOR)
    both = torch.stack([tokens.double(), chosen.double()]).cpu()  # one device sync per step
    return both[0].long(), both[1].float()
