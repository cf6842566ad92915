"""The split-K decode attention kernel on CPU, through Triton's interpreter
(``TRITON_INTERPRET=1``): the checks of tests/gpu/test_decode_attention_gpu.py, in one child
process (the variable must be set before Triton loads) whose path has the Triton that ``make
test`` installs beside the venv (see tests/rollout/test_fp8_moe_interpreted.py)."""

from __future__ import annotations

import pytest

from tests.rollout.interpreted import result, run_child

CHILD = """
import decode_attention_checks as c

for splits in (None, 1, 2, 5):
    part(f"reference_{splits}", lambda: c.check_matches_reference("cpu", splits))
part("splits_agree", lambda: c.check_splits_agree("cpu"))
part("qwen_shapes", lambda: c.check_qwen_shapes("cpu"))
for splits in (None, 1, 3):
    part(f"paged_{splits}", lambda: c.check_paged("cpu", splits=splits))
part("paged_page_64", lambda: c.check_paged("cpu", page=64))  # a tile in one page
part("refuses", lambda: c.check_refuses_bad_inputs("cpu"))
from megarl.rollout.local.decode_attention_triton import MIN_CHUNK, num_splits
part("num_splits", lambda: [MIN_CHUNK, num_splits(512, 8, 2560, 264), num_splits(4, 4, 2560, 264),
                            num_splits(4, 4, 100_000, 264), num_splits(1, 1, 10, 264)])
"""


@pytest.fixture(scope="module")
def report() -> dict:
    return run_child(CHILD)


@pytest.mark.parametrize("splits", [None, 1, 2, 5])
def test_decode_attention_equals_fp32_attention(report, splits):
    print("largest error:", result(report, f"reference_{splits}"))


def test_one_split_and_many_agree(report):
    print("largest error:", result(report, "splits_agree"))


def test_the_e2e_shapes_head_layouts(report):
    print("largest error:", result(report, "qwen_shapes"))


@pytest.mark.parametrize("case", ["None", "1", "3", "page_64"])
def test_paged_attention_equals_the_rectangle_and_fp32(report, case):
    """16-token pages (each key tile spans pages) at 1, 3 and the default splits; 64-token
    pages (each tile in one page: one page id per tile)."""
    print("largest error against the rectangle:", result(report, f"paged_{case}"))


def test_bad_inputs_are_refused_with_the_shapes(report):
    assert "q (2, 6, 64)" in result(report, "refuses")


def test_num_splits_fills_the_device_with_long_enough_chunks(report):
    min_chunk, *got = result(report, "num_splits")
    # 512 rows x 8 KV heads already fill 264 programs: one split; 4 rows x 4 KV heads: as
    # many splits as 264 programs want (17), each over at least MIN_CHUNK keys
    assert got == [1, 2560 // min_chunk, 17, 1]
