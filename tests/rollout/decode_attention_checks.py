"""Checks of the split-K decode attention kernel, shared by the CPU test (Triton's interpreter,
tests/rollout/test_decode_attention_interpreted.py) and the GPU test
(tests/gpu/test_decode_attention_gpu.py). Each returns the largest error it saw."""

from __future__ import annotations

import torch

from megarl.rollout.local import decode_attention_triton as t


def _inputs(device: str, rows: int, heads: int, kv_heads: int, dim: int, length: int,
            used: list[int], dtype=torch.bfloat16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, heads, dim, generator=gen).to(device, dtype)
    keys = torch.randn(rows + 3, length, kv_heads, dim, generator=gen).to(device, dtype)
    values = torch.randn(rows + 3, length, kv_heads, dim, generator=gen).to(device, dtype)
    # what lies past a row's used tokens must not matter: fill it with huge values
    for r, n in enumerate(used):
        keys[r, n:] = 1e4
        values[r, n:] = -1e4
    return q, keys, values, torch.tensor(used, dtype=torch.int32, device=device)


def check_matches_reference(device: str, splits: int | None, heads: int = 8, kv_heads: int = 2,
                            dim: int = 64, length: int = 640) -> float:
    """Rows of very different lengths (1 token, a partial block, a whole split, the whole cache),
    GQA groups of 4: equal to fp32 attention within bf16 rounding of the probabilities."""
    used = [1, 37, 64, 300, length, 129]
    q, keys, values, used_t = _inputs(device, len(used), heads, kv_heads, dim, length, used)
    scale = dim ** -0.5
    got = t.decode_attention(q, keys, values, used_t, scale, splits=splits)
    ref = t.reference_decode_attention(q, keys, values, used_t, scale)
    assert got.dtype == q.dtype and got.shape == q.shape
    err = float((got.float() - ref).abs().max())
    torch.testing.assert_close(got.float(), ref, atol=1e-2, rtol=1.6e-2, msg=f"splits={splits}")
    # one token: the output is that token's value, whatever the scores
    torch.testing.assert_close(got[0].float(), values[0, 0].float().repeat_interleave(
        heads // kv_heads, dim=0), atol=1e-2, rtol=0)
    return err


def check_splits_agree(device: str) -> float:
    """One split and many give the same output (the partials' combination is exact up to fp32
    rounding and one bf16 rounding of the output)."""
    used = [5, 200, 511, 512, 1]
    q, keys, values, used_t = _inputs(device, len(used), 4, 4, 32, 512, used, seed=1)
    one = t.decode_attention(q, keys, values, used_t, 0.2, splits=1).float()
    worst = 0.0
    for splits in (2, 3, 8):
        many = t.decode_attention(q, keys, values, used_t, 0.2, splits=splits).float()
        worst = max(worst, float((one - many).abs().max()))
    assert worst < 2e-2, worst
    return worst


def check_qwen_shapes(device: str) -> float:
    """Head layouts of the e2e shapes: Qwen3-1.7B (16 heads over 8 KV heads) and the
    Qwen3-30B-A3B slice (32 over 4), head_dim 128, odd lengths; the default splits."""
    worst = 0.0
    for heads, kv_heads in ((16, 8), (32, 4)):
        used = [3, 700, 1025]
        q, keys, values, used_t = _inputs(device, 3, heads, kv_heads, 128, 1100, used, seed=2)
        got = t.decode_attention(q, keys, values, used_t, 128 ** -0.5)
        ref = t.reference_decode_attention(q, keys, values, used_t, 128 ** -0.5)
        torch.testing.assert_close(got.float(), ref, atol=1e-2, rtol=1.6e-2)
        worst = max(worst, float((got.float() - ref).abs().max()))
    return worst


def check_paged(device: str, page: int = 16, splits: int | None = None) -> float:
    """Page pools and a page table: each row's tokens scattered over pages in shuffled order
    (rows sharing none); equal to the rectangle the same tokens make, and to fp32 attention.
    Table entries past a row's pages point at page 0, which holds huge values."""
    used = [1, page - 1, page, page + 1, 5 * page + 3]
    q, keys, values, used_t = _inputs(device, len(used), 8, 2, 64, 6 * page, used, seed=3)
    cols = keys.shape[1] // page
    order = torch.randperm(len(used) * cols, generator=torch.Generator().manual_seed(4)) + 1
    table = torch.zeros(len(used) + 2, cols, dtype=torch.int32)  # two spare rows, all page 0
    pool_k = torch.full((len(order) + 1, page, *keys.shape[2:]), 3e4, dtype=keys.dtype)
    pool_v = torch.full_like(pool_k, -3e4)
    for r, n in enumerate(used):
        for c in range(-(-n // page)):
            table[r, c] = order[r * cols + c]
            pool_k[table[r, c]] = keys[r, c * page:(c + 1) * page].cpu()
            pool_v[table[r, c]] = values[r, c * page:(c + 1) * page].cpu()
    pool_k, pool_v, table = pool_k.to(device), pool_v.to(device), table.to(device)
    scale = 64 ** -0.5
    got = t.decode_attention(q, pool_k, pool_v, used_t, scale, splits=splits, pages=table)
    rect = t.decode_attention(q, keys, values, used_t, scale, splits=splits)
    ref = t.reference_decode_attention(q, pool_k, pool_v, used_t, scale, pages=table)
    torch.testing.assert_close(ref, t.reference_decode_attention(q, keys, values, used_t, scale))
    torch.testing.assert_close(got.float(), ref, atol=1e-2, rtol=1.6e-2, msg=f"splits={splits}")
    err = float((got.float() - rect.float()).abs().max())
    assert err < 2e-2, err
    return err


def check_refuses_bad_inputs(device: str) -> str:
    q = torch.zeros(2, 6, 64, dtype=torch.bfloat16, device=device)
    cache = torch.zeros(2, 128, 4, 64, dtype=torch.bfloat16, device=device)  # 6 % 4 != 0
    used = torch.ones(2, dtype=torch.int32, device=device)
    try:
        t.decode_attention(q, cache, cache, used, 1.0)
    except ValueError as err:
        message = str(err)
    else:
        raise AssertionError("6 query heads over 4 KV heads was accepted")
    good = torch.zeros(2, 8, 64, dtype=torch.bfloat16, device=device)
    for pages in (torch.zeros(2, 4, dtype=torch.int64, device=device),  # not int32
                  torch.zeros(1, 4, dtype=torch.int32, device=device)):  # fewer rows than q
        try:
            t.decode_attention(good, cache, cache, used, 1.0, pages=pages)
        except ValueError:
            continue
        raise AssertionError(f"a page table {tuple(pages.shape)} {pages.dtype} was accepted")
    return message
