"""Math answers through math-verify: extraction, equivalent forms, wrong answers, garbage."""

import time

import pytest

from megarl.reward.math import compute_score, extract_answer

HALF = ["1/2", "0.5", "\\frac{1}{2}", "\\frac12", "\\dfrac{1}{2}", "0.50"]


@pytest.mark.parametrize("answer", HALF)
@pytest.mark.parametrize("ground_truth", ["1/2", "0.5", "\\frac{1}{2}"])
def test_equivalent_forms_of_one_half_are_equal(answer, ground_truth):
    assert compute_score(f"so the result is \\boxed{{{answer}}}", ground_truth) == 1.0
    assert compute_score(f"Working...\nAnswer: {answer}", ground_truth) == 1.0


@pytest.mark.parametrize("response, ground_truth", [
    ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\sqrt{2}/2"),
    ("\\boxed{\\{1,2\\}}", "\\{2,1\\}"),
    ("\\boxed{1,000}", "1000"),
    ("\\boxed{x = 3}", "3"),
    ("\\boxed{\\text{(C)}}", "C"),
    ("**Answer:** $72$.", "72"),
    ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72"),
    ("The answer is: 72<|im_end|>", "#### 72"),
    ("\\boxed 7", "7"),
])
def test_other_equivalences_and_formats(response, ground_truth):
    assert compute_score(response, ground_truth) == 1.0


@pytest.mark.parametrize("response, ground_truth", [
    ("\\boxed{0.25}", "1/2"),
    ("Answer: 73", "72"),
    ("\\boxed{\\pi}", "3.14159"),
    ("I think it is 1/2 but I will not say so clearly", "1/2"),
    ("\\boxed{1/2} was wrong, the final answer is \\boxed{1/3}", "1/2"),
])
def test_wrong_or_missing_answers_score_zero(response, ground_truth):
    assert compute_score(response, ground_truth) == 0.0


def test_last_complete_box_wins_and_truncated_box_is_ignored():
    assert extract_answer("\\boxed{3} then \\boxed{4}") == "4"
    assert extract_answer("\\boxed{3} then \\boxed{\\frac{1}{") == "3"
    assert extract_answer("\\boxed{\\frac{a}{b}}") == "\\frac{a}{b}"
    assert extract_answer("no answer here") is None


@pytest.mark.parametrize("garbage", [
    "", "\\boxed{}", "{{{{}}}", "\x00\xff\ufffd" * 100, "\\boxed{" + "(" * 5000 + "}",
    "Answer: " + "1+" * 5000 + "1", "Answer: \\frac{\\frac{\\frac{", "$" * 1000, "\\boxed{\\}",
    None, 12, "Answer: 1e99999999", "\\boxed{x^{x^{x^{x^{x^{x}}}}}}",
])
def test_garbage_never_raises_and_scores_zero_fast(garbage):
    start = time.perf_counter()
    assert compute_score(garbage, "2") == 0.0
    assert time.perf_counter() - start < 5.0
