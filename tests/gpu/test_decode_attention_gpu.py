"""The split-K decode attention kernel on CUDA: the checks of
tests/rollout/test_decode_attention_interpreted.py, on the device, and inside a CUDA graph whose
rows' lengths change between replays (the decode graphs' case)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rollout"))

import decode_attention_checks as c

from megarl.rollout.local import decode_attention_triton as t


@pytest.mark.parametrize("splits", [None, 1, 2, 5])
def test_decode_attention_equals_fp32_attention(splits):
    c.check_matches_reference("cuda", splits)


@pytest.mark.parametrize("page, splits", [(16, None), (64, None), (64, 1), (64, 3)])
def test_paged_attention_equals_the_rectangle_and_fp32(page, splits):
    c.check_paged("cuda", page=page, splits=splits)


def test_one_split_and_many_agree_and_the_e2e_layouts():
    c.check_splits_agree("cuda")
    c.check_qwen_shapes("cuda")
    assert "q (2, 6, 64)" in c.check_refuses_bad_inputs("cuda")


def test_inside_a_cuda_graph_the_lengths_are_read_at_replay():
    q = torch.randn(4, 16, 128, device="cuda", dtype=torch.bfloat16)
    keys, values = (torch.randn(4, 2048, 8, 128, device="cuda", dtype=torch.bfloat16)
                    for _ in range(2))
    used = torch.tensor([1, 900, 2047, 3], dtype=torch.int32, device="cuda")
    graph = torch.cuda.CUDAGraph()
    t.decode_attention(q, keys, values, used, 0.1)  # compile outside the capture
    with torch.cuda.graph(graph):
        out = t.decode_attention(q, keys, values, used, 0.1)
    for lengths in ([1, 900, 2047, 3], [2047, 1, 64, 1500]):
        used.copy_(torch.tensor(lengths, dtype=torch.int32))
        graph.replay()
        ref = t.reference_decode_attention(q, keys, values, used, 0.1)
        torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1.6e-2)
