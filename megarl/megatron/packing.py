"""Packed (remove-padding, THD) micro-batches and dynamic micro-batching by a token budget.

A micro-batch is the concatenation of its sequences into one row ``[1, T]``; attention stays
inside each sequence through ``cu_seqlens``. Each sequence is padded at its end to a multiple
of ``align`` (the TP size under sequence parallelism, so that every rank gets whole tokens);
padding is causal-invisible to the real tokens and its outputs are dropped when unpacking.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams


@dataclass
class PackedBatch:
    """Sequences packed into one row, with the offsets megatron's THD attention needs."""

    input_ids: torch.Tensor
    """``[1, T]`` token ids, each sequence followed by its padding."""
    position_ids: torch.Tensor
    """``[1, T]`` positions restarting at 0 for each sequence."""
    targets: torch.Tensor
    """``[1, T]`` next token within the same sequence (0 where there is none)."""
    cu_seqlens: torch.Tensor
    """``[n+1]`` int32 offsets of the real tokens of each sequence (without padding)."""
    cu_seqlens_padded: torch.Tensor
    """``[n+1]`` int32 offsets of each padded sequence in the row."""
    lengths: list[int]
    """Real length of each sequence."""
    cp_gather_index: torch.Tensor | None = None
    """Under context parallelism (:func:`split_for_context_parallel`): ``[T_global]`` row, in
    the CP ranks' tokens concatenated by rank, of each position of the whole packed row; the
    other fields then hold this rank's tokens while the offsets stay those of the whole row."""

    @property
    def num_tokens(self) -> int:
        """Length T of this rank's packed row, padding included (the whole row / cp)."""
        return self.input_ids.shape[1]

    @property
    def row_tokens(self) -> int:
        """Length of the whole packed row: ``num_tokens`` times cp under context parallelism."""
        if self.cp_gather_index is None:
            return self.num_tokens
        return self.cp_gather_index.numel()

    def packed_seq_params(self) -> PackedSeqParams:
        """megatron's THD descriptor for this batch."""
        padded = self.cu_seqlens_padded
        max_len = int((padded[1:] - padded[:-1]).max())
        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=self.cu_seqlens,
            cu_seqlens_kv=self.cu_seqlens,
            cu_seqlens_q_padded=padded,
            cu_seqlens_kv_padded=padded,
            max_seqlen_q=max_len,
            max_seqlen_kv=max_len,
        )

    def unpack(self, packed: torch.Tensor) -> list[torch.Tensor]:
        """Per-sequence ``[L_i]`` slices of a ``[T]`` per-position tensor."""
        starts = self.cu_seqlens_padded[:-1].tolist()
        return [packed[s : s + n] for s, n in zip(starts, self.lengths)]

    def unpack_shifted(self, per_position: torch.Tensor) -> list[torch.Tensor]:
        """Target-aligned per-sequence values from values computed at the predicting position.

        ``per_position[p]`` belongs to ``targets[p]``, the token after position ``p``. Returns, for
        each sequence of length L, ``[L]`` with entry ``i`` for token ``i`` (entry 0, which no
        position predicts, is 0).
        """
        out = []
        for seq in self.unpack(per_position):
            out.append(torch.cat([seq.new_zeros(1), seq[:-1]]))
        return out

    def to(self, device: torch.device | str) -> PackedBatch:
        """The same batch with its tensors on ``device``."""
        return PackedBatch(
            input_ids=self.input_ids.to(device),
            position_ids=self.position_ids.to(device),
            targets=self.targets.to(device),
            cu_seqlens=self.cu_seqlens.to(device),
            cu_seqlens_padded=self.cu_seqlens_padded.to(device),
            lengths=list(self.lengths),
            cp_gather_index=None if self.cp_gather_index is None
            else self.cp_gather_index.to(device),
        )


def pack_sequences(sequences: Sequence[torch.Tensor], align: int = 1) -> PackedBatch:
    """Pack 1-D token-id tensors into one row, padding each to a multiple of ``align``."""
    if not sequences:
        raise ValueError("pack_sequences: no sequences given")
    ids, pos, tgt, lengths, padded_lengths = [], [], [], [], []
    for i, seq in enumerate(sequences):
        seq = torch.as_tensor(seq, dtype=torch.long).flatten()
        n = seq.numel()
        if n == 0:
            raise ValueError(f"pack_sequences: sequence {i} is empty")
        n_pad = -(-n // align) * align
        pad = seq.new_zeros(n_pad - n)
        ids.append(torch.cat([seq, pad]))
        pos.append(torch.arange(n_pad))
        tgt.append(torch.cat([seq[1:], seq.new_zeros(n_pad - n + 1)]))
        lengths.append(n)
        padded_lengths.append(n_pad)
    zero = torch.zeros(1, dtype=torch.int32)
    return PackedBatch(
        input_ids=torch.cat(ids)[None],
        position_ids=torch.cat(pos)[None],
        targets=torch.cat(tgt)[None],
        cu_seqlens=torch.cat([zero, torch.tensor(lengths).cumsum(0).to(torch.int32)]),
        cu_seqlens_padded=torch.cat([zero, torch.tensor(padded_lengths).cumsum(0).to(torch.int32)]),
        lengths=lengths,
    )


def context_parallel_positions(
    cu_seqlens_padded: Sequence[int], cp_size: int, cp_rank: int
) -> torch.Tensor:
    """Row positions of the tokens CP rank ``cp_rank`` holds, in its order: each padded sequence
    is cut into ``2 * cp_size`` equal chunks and the rank takes chunks ``cp_rank`` and
    ``2 * cp_size - 1 - cp_rank`` (megatron-core's load-balanced causal split)."""
    parts = []
    for start, end in itertools.pairwise(cu_seqlens_padded):
        chunk, rest = divmod(end - start, 2 * cp_size)
        if rest:
            raise ValueError(
                f"context parallel: a padded sequence of {end - start} tokens does not split "
                f"into 2 x cp = {2 * cp_size} chunks; pack with align a multiple of {2 * cp_size}"
            )
        for k in (cp_rank, 2 * cp_size - 1 - cp_rank):
            parts.append(torch.arange(start + k * chunk, start + (k + 1) * chunk))
    return torch.cat(parts)


def split_for_context_parallel(batch: PackedBatch, cp_size: int, cp_rank: int) -> PackedBatch:
    """This CP rank's share of a packed row (from :func:`pack_sequences` with ``align`` a
    multiple of ``2 * cp_size``): its tokens, positions and targets, the whole row's offsets
    (megatron-core's THD convention under CP) and the index that reorders the ranks' gathered
    per-token values into the row (:func:`gather_context_parallel`)."""
    cu = batch.cu_seqlens_padded.tolist()
    mine = context_parallel_positions(cu, cp_size, cp_rank)
    by_rank = torch.cat([context_parallel_positions(cu, cp_size, r) for r in range(cp_size)])
    return PackedBatch(
        input_ids=batch.input_ids[:, mine],
        position_ids=batch.position_ids[:, mine],
        targets=batch.targets[:, mine],
        cu_seqlens=batch.cu_seqlens,
        cu_seqlens_padded=batch.cu_seqlens_padded,
        lengths=list(batch.lengths),
        cp_gather_index=torch.argsort(by_rank),
    )


def split_further(lengths: Sequence[int], groups: list[list[int]], count: int) -> list[list[int]]:
    """``groups`` (micro-batches of sequence indices, in order) split until there are ``count``:
    each time the group of most tokens that holds two sequences or more is cut in two where its
    tokens are most even. Ranks whose micro-batches take part in the same collectives (expert
    parallelism) need the same number of them; a rank with fewer sequences than ``count`` cannot
    have that many, which is an error."""
    groups = [list(g) for g in groups]
    if count > sum(len(g) for g in groups):
        raise ValueError(f"cannot make {count} micro-batches of {sum(map(len, groups))} sequences")
    while len(groups) < count:
        splittable = [i for i, g in enumerate(groups) if len(g) > 1]
        i = max(splittable, key=lambda j: sum(lengths[k] for k in groups[j]))
        group = groups[i]
        total, running, cut, best = sum(lengths[k] for k in group), 0, 1, None
        for j in range(1, len(group)):
            running += lengths[group[j - 1]]
            gap = abs(total - 2 * running)
            if best is None or gap < best:
                cut, best = j, gap
        groups[i:i + 1] = [group[:cut], group[cut:]]
    return groups


def split_by_token_budget(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Group sequence indices, in order, into micro-batches of at most ``max_tokens`` tokens.

    A sequence longer than the budget gets a micro-batch of its own.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens}: the token budget must be >= 1")
    groups: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, n in enumerate(lengths):
        if current and used + n > max_tokens:
            groups.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        groups.append(current)
    return groups
