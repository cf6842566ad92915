"""The engine's admission arithmetic (megarl/rollout/local/admission.py): expected lengths, the
ratio's decay and reset, and which rows a short KV pool retracts."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest

from megarl.rollout.local.admission import (
    DECAY_STEPS,
    INIT_RATIO,
    MIN_RATIO,
    RETRACT_STEPS,
    KVAdmission,
    final_length,
)


@dataclass
class Row:
    prompt_length: int
    max_new_tokens: int
    stop_ids: frozenset[int] = frozenset({2})
    output_ids: list[int] = field(default_factory=list)


def test_expected_length_counts_a_ratio_of_what_a_row_may_still_draw():
    admission = KVAdmission()
    row = Row(100, 1000, output_ids=[5] * 200)
    assert admission.expected_length(row) == 100 + 200 + 560  # 0.7 x 800
    assert final_length(row) == 1100
    forced = Row(100, 1000, stop_ids=frozenset(), output_ids=[5] * 200)
    assert admission.expected_length(forced) == 1100  # it cannot stop: all of it
    assert admission.expected_length(Row(10, 3)) == 10 + 3  # 0.7 x 3 rounds up to 3
    assert admission.expected_length(Row(10, 100_000)) == 10 + 2868  # 0.7 x 4,096 at most


@pytest.mark.parametrize("page", [64, 1, 0])
def test_held_counts_each_row_at_its_expected_length_in_whole_pages(page):
    admission = KVAdmission()
    for _ in range(50):
        admission.decoded()
    rows = [Row(100, 1000, output_ids=[5] * 200), Row(7, 30),
            Row(300, 2048, stop_ids=frozenset(), output_ids=[5] * 10), Row(10, 100_000)]
    longest, slots = admission.held(rows, page)
    assert longest == max(final_length(r) for r in rows) == 100_010
    want = sum(-(-admission.expected_length(r) // page) * page for r in rows) if page else 0
    assert slots == want
    if page == 64:  # by hand: 100 + 200 + ceil(r x 800) tokens etc., in 64-token pages
        r = admission.ratio
        by_hand = [100 + 200 + math.ceil(800 * r), 7 + math.ceil(30 * r), 300 + 2048,
                   10 + math.ceil(4096 * r)]
        assert slots == sum(-(-n // 64) * 64 for n in by_hand)
    assert admission.held([], page) == (0, 0)


def test_the_ratio_decays_to_its_floor_and_follows_the_rows_left_after_a_retraction():
    admission = KVAdmission()
    for _ in range(DECAY_STEPS // 2):
        admission.decoded()
    assert admission.ratio == pytest.approx((INIT_RATIO + MIN_RATIO) / 2)
    for _ in range(DECAY_STEPS):
        admission.decoded()
    assert admission.ratio == MIN_RATIO
    assert MIN_RATIO == pytest.approx(0.098)  # SGLang's 0.7 x 0.14
    rows = [Row(10, 100, output_ids=[1] * 5), Row(10, 100, output_ids=[1] * 9)]
    assert admission.to_retract(rows, held=[1, 1], wants=[True, True], free=1) == [0]
    assert admission.retractions == 1
    assert admission.ratio == pytest.approx((9 + RETRACT_STEPS) / 101)  # row 1 stays
    rows = [Row(10, 100, output_ids=[1] * 5), Row(10, 50, output_ids=[1] * 45)]
    admission.to_retract(rows, held=[1, 1], wants=[True, True], free=1)
    assert admission.ratio == 1.0  # 45 + 20 of 50: capped


def test_retraction_takes_the_fewest_drawn_tokens_first_and_keeps_one_row():
    admission = KVAdmission()
    rows = [Row(10, 100, output_ids=[1] * 50), Row(30, 100, output_ids=[1] * 3),
            Row(10, 100, output_ids=[1] * 3), Row(10, 100, output_ids=[1] * 70)]
    # 3 pages wanted, none free: row 1 (3 drawn, the longer prompt) gives back its page and
    # its want (2 of 3), then row 2 its page and want: enough
    assert admission.to_retract(rows, held=[2, 1, 1, 3], wants=[True, True, True, False],
                                free=0) == [1, 2]
    assert admission.to_retract(rows, held=[2, 2, 1, 3], wants=[True, True, True, False],
                                free=0) == [1]  # row 1 alone gives back 3
    assert admission.to_retract(rows, held=[2, 2, 1, 3], wants=[True] * 4, free=4) == []
    # nothing frees enough: all but one row go
    assert admission.to_retract(rows, held=[0, 0, 0, 0], wants=[True] * 4, free=0) == [1, 2, 0]
    assert admission.retractions == 6
