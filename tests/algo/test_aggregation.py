"""Loss aggregation: naive references, and invariance to micro-batch and data-parallel splits."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megarl.algo import LOSS_AGG_MODES, aggregate_loss, loss_counts
from megarl.net import free_port

NORM_LEN = 16.0


def _naive(loss: torch.Tensor, mask: torch.Tensor, mode: str) -> float:
    rows = []
    for i in range(loss.shape[0]):
        values = [float(loss[i, t]) for t in range(loss.shape[1]) if mask[i, t] > 0]
        if values:
            rows.append(values)
    tokens = [v for row in rows for v in row]
    if mode == "token-mean":
        return sum(tokens) / len(tokens)
    if mode == "token-sum":
        return sum(tokens)
    if mode == "seq-mean-token-sum":
        return sum(sum(row) for row in rows) / len(rows)
    if mode == "seq-mean-token-mean":
        return sum(sum(row) / len(row) for row in rows) / len(rows)
    return sum(sum(row) / NORM_LEN for row in rows) / len(rows)


def _batch(make_mask, seed: int = 0, batch: int = 10, length: int = 12):
    mask = make_mask(batch, length, seed=seed)
    loss = torch.randn(batch, length, generator=torch.Generator().manual_seed(seed + 1),
                       dtype=torch.float64)
    loss[mask == 0] = float("nan")  # padding must never reach the result
    return loss, mask


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_modes_match_naive(make_mask, mode: str) -> None:
    loss, mask = _batch(make_mask)
    value = aggregate_loss(loss, mask, mode, norm_len=NORM_LEN)
    assert value.item() == pytest.approx(_naive(loss, mask, mode), rel=1e-12)


def _micro_batches(loss: torch.Tensor, mask: torch.Tensor, sizes: list[int]):
    """Split rows by `sizes`, each micro-batch trimmed to its own longest row (as packing would)."""
    out, start = [], 0
    for size in sizes:
        rows = slice(start, start + size)
        lengths = mask[rows].sum(dim=-1)
        width = max(int(lengths.max()), 1)
        out.append((loss[rows, :width], mask[rows, :width]))
        start += size
    return out


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batch_split_sums_to_unsplit(make_mask, mode: str) -> None:
    loss, mask = _batch(make_mask, seed=2)
    leaf = torch.nan_to_num(loss).requires_grad_()
    full = aggregate_loss(leaf, mask, mode, norm_len=NORM_LEN)
    (full_grad,) = torch.autograd.grad(full, leaf)
    parts = _micro_batches(leaf, mask, [3, 1, 4, 2])
    global_counts = sum(loss_counts(part_mask) for _, part_mask in parts)
    torch.testing.assert_close(global_counts, loss_counts(mask))
    split = sum(aggregate_loss(part_loss, part_mask, mode, global_counts=global_counts,
                               norm_len=NORM_LEN) for part_loss, part_mask in parts)
    (split_grad,) = torch.autograd.grad(split, leaf)
    torch.testing.assert_close(split, full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(split_grad, full_grad, rtol=1e-12, atol=1e-12)
    if mode != "token-sum":  # local normalisers would give a different (wrong) answer
        local = sum(aggregate_loss(part_loss, part_mask, mode, norm_len=NORM_LEN)
                    for part_loss, part_mask in parts)
        assert abs(local.item() - full.item()) > 1e-6


def _data_parallel_worker(
    rank: int, world: int, port: int, loss: torch.Tensor, mask: torch.Tensor, results: dict
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    rows = [slice(0, 6), slice(6, 10)][rank]  # unequal shards
    micro = [[3, 3], [1, 3]][rank]  # and unequal micro-batches
    parts = _micro_batches(loss[rows], mask[rows], micro)
    counts = sum(loss_counts(part_mask) for _, part_mask in parts)
    dist.all_reduce(counts)
    out = {}
    for mode in LOSS_AGG_MODES:
        local = sum(aggregate_loss(part_loss, part_mask, mode, global_counts=counts,
                                   norm_len=NORM_LEN) for part_loss, part_mask in parts)
        # Data-parallel gradient reduction averages; scaling by world size makes it a sum.
        scaled = (local * world).detach()
        dist.all_reduce(scaled)
        out[mode] = (scaled / world).item()
        out[mode + "/unsplit"] = aggregate_loss(loss, mask, mode, norm_len=NORM_LEN).item()
    results[rank] = out
    dist.destroy_process_group()


def test_data_parallel_ranks_with_global_counts_match_unsplit(make_mask) -> None:
    loss, mask = _batch(make_mask, seed=4)
    loss = torch.nan_to_num(loss)
    ctx = mp.get_context("fork")
    with ctx.Manager() as manager:
        results = manager.dict()
        port = free_port()
        procs = [
            ctx.Process(target=_data_parallel_worker, args=(rank, 2, port, loss, mask, results))
            for rank in range(2)
        ]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(timeout=60)
        assert [proc.exitcode for proc in procs] == [0, 0]
        for rank in range(2):
            for mode in LOSS_AGG_MODES:
                assert results[rank][mode] == pytest.approx(results[rank][mode + "/unsplit"],
                                                             rel=1e-12)


def test_bf16_losses_reduce_in_fp32() -> None:
    mask = torch.ones(4, 70000)
    loss = torch.full((4, 70000), 0.5, dtype=torch.bfloat16)
    counts = loss_counts(mask)
    value = aggregate_loss(loss, mask, "token-mean", global_counts=counts * 2)
    assert value.dtype == torch.float32 and value.item() == pytest.approx(0.25, rel=1e-6)


def test_empty_mask_gives_zero_loss_and_gradient() -> None:
    loss = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    mask = torch.zeros(3, 4)
    for mode in LOSS_AGG_MODES:
        value = aggregate_loss(loss, mask, mode, norm_len=NORM_LEN)
        (grad,) = torch.autograd.grad(value, loss)
        assert value.item() == 0 and grad.abs().sum() == 0
    assert torch.equal(loss_counts(mask), torch.zeros(2, dtype=torch.float64))


def test_errors_name_the_fix(make_mask) -> None:
    loss, mask = _batch(make_mask)
    with pytest.raises(ValueError, match="valid modes: token-mean, token-sum"):
        aggregate_loss(loss, mask, "seq-mean")
    with pytest.raises(ValueError, match="needs norm_len > 0"):
        aggregate_loss(loss, mask, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="loss_mask: shape"):
        aggregate_loss(loss, mask[:, :3], "token-mean")
