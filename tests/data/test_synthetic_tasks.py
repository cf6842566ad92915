"""Synthetic tasks: deterministic generation, tiny-tokenizer alphabet, short prompts, rewards."""

from __future__ import annotations

import pytest

from megarl.data.dataset import PromptDataset, read_rows
from megarl.data.synthetic import TASKS, data_source_of, generate_rows, write_synthetic_dataset
from megarl.data.tiny_model import ALPHABET
from megarl.reward.synthetic import SYNTHETIC_SOURCES, extract_answer, score


@pytest.mark.parametrize("task", list(TASKS))
def test_generation_is_deterministic_by_seed(task):
    a, b = generate_rows(task, 50, seed=1), generate_rows(task, 50, seed=1)
    assert a == b
    assert a != generate_rows(task, 50, seed=2)
    assert len({r["prompt"][0]["content"] for r in a}) > 5


@pytest.mark.parametrize("task", list(TASKS))
def test_rows_fit_the_tiny_tokenizer_and_demo_lengths(task, tmp_path, tokenizer):
    path = write_synthetic_dataset(tmp_path / f"{task}.parquet", task, 300, seed=0)
    rows = read_rows(path)
    assert rows == generate_rows(task, 300, seed=0)
    for row in rows:
        assert set(row["prompt"][0]["content"]) <= set(ALPHABET)
        assert len(f"Answer: {row['reward_model']['ground_truth']}") <= 13
    ds = PromptDataset(path, tokenizer, max_prompt_length=64, vocab_size=128)
    assert ds.num_filtered == 0 and len(ds) == 300
    # every character is its own token (none became unknown) and prompts fit in 64 tokens
    for item, row in zip(ds, rows, strict=True):
        content = row["prompt"][0]["content"]
        assert tokenizer.decode(item["input_ids"]) == (
            f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n")
        assert len(item["input_ids"]) == len(content) + 19


def test_jsonl_output_matches_parquet(tmp_path):
    a = read_rows(write_synthetic_dataset(tmp_path / "a.jsonl", "sorting", 20, seed=5))
    b = read_rows(write_synthetic_dataset(tmp_path / "b.parquet", "sorting", 20, seed=5))
    assert a == b


def test_answers_are_right():
    for row in generate_rows("arithmetic", 200, seed=0):
        expr = row["prompt"][0]["content"].split("What is ")[1].split("?")[0]
        a, op, b = (expr.partition("+") if "+" in expr else expr.partition("-"))
        value = int(a) + int(b) if op == "+" else int(a) - int(b)
        assert str(value) == row["reward_model"]["ground_truth"] and value >= 0
    for row in generate_rows("counting", 200, seed=0):
        _, letter, _, text = row["prompt"][0]["content"].split(".")[0].split(" ")
        assert str(text.count(letter)) == row["reward_model"]["ground_truth"]
    for row in generate_rows("sorting", 200, seed=0):
        digits = row["prompt"][0]["content"].split("digits ")[1].split(".")[0]
        assert "".join(sorted(digits)) == row["reward_model"]["ground_truth"]
    for row in generate_rows("copy_digit", 50, seed=0):
        assert row["prompt"][0]["content"] == "Copy " + row["reward_model"]["ground_truth"] * 16
    for row in generate_rows("copy_number", 50, seed=0):
        truth = row["reward_model"]["ground_truth"]
        assert len(truth) == 3 and row["prompt"][0]["content"] == "Copy " + truth * 6


def wrong_answer(truth: str, task: str) -> str:
    """An answer that differs from ``truth`` after every task's normalisation (for
    copy_number: in every digit, since it gives partial credit)."""
    if task == "copy_number":
        return "".join(str((int(c) + 1) % 10) for c in truth)
    return "9" + truth if truth.startswith("0") and len(truth) > 1 else str(int(truth) + 1)


@pytest.mark.parametrize("task", list(TASKS))
def test_reward_is_one_for_the_truth_and_zero_for_a_wrong_answer(task):
    assert data_source_of(task) in SYNTHETIC_SOURCES
    for row in generate_rows(task, 100, seed=3):
        source, truth = row["data_source"], row["reward_model"]["ground_truth"]
        assert score(source, f"Answer: {truth}", truth) == 1.0
        assert score(source, f"Let me think.\nAnswer: {truth}<|im_end|>", truth) == 1.0
        assert score(source, f"Answer: {wrong_answer(truth, task)}", truth) == 0.0
        assert score(source, "", truth) == 0.0
        assert score(source, f"Answer: {wrong_answer(truth, task)}", truth,
                     format_score=0.1) == 0.1
    assert set(SYNTHETIC_SOURCES) == {data_source_of(t) for t in TASKS}


def test_extraction_rules():
    assert extract_answer("Answer: 12.") == "12"
    assert extract_answer("Answer: 1\nAnswer: 2") == "2"
    assert extract_answer("no answer") is None
    assert score("synthetic/arithmetic", "Answer: 07", "7") == 1.0
    assert score("synthetic/arithmetic", "Answer: 7 apples", "7") == 0.0
    assert score("synthetic/arithmetic", "7", "7") == 0.0
    assert score("synthetic/sorting", "Answer: 1, 2, 3", "123") == 1.0
    assert score("synthetic/sorting", "Answer: 132", "123") == 0.0
    assert score("synthetic/copy_digit", "xx4y", "4") == 1.0
    assert score("synthetic/copy_digit", "x5 4", "4") == 0.0
    assert score("synthetic/copy_number", "1 2 9 7", "127") == pytest.approx(2 / 3)
    assert score("synthetic/copy_number", "x7", "127") == 0.0
    assert score("synthetic/copy_number", "<|im_end|>127", "127") == 1.0
    # tool_multiply: the last integer after the last tool response, never the tool's result
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "38*47"}}</tool_call>'
    result = "\nuser\n<tool_response>\n1786\n</tool_response>\nassistant\n"
    assert score("synthetic/tool_multiply", call + result + "1786", "1786") == 1.0
    assert score("synthetic/tool_multiply", call + result + "1787", "1786") == 0.0
    assert score("synthetic/tool_multiply", call + result, "1786") == 0.0
    assert score("synthetic/tool_multiply", "1786", "1786") == 1.0  # a right guess counts
    assert score("synthetic/tool_multiply", "17 1786", "1786") == 1.0


def test_unknown_source_lists_the_known_ones():
    known = ("synthetic/arithmetic, synthetic/counting, synthetic/sorting, synthetic/copy_digit, "
             "synthetic/copy_number, synthetic/tool_multiply")
    with pytest.raises(ValueError, match=f"'openai/gsm8k'; known sources: {known}$"):
        score("openai/gsm8k", "Answer: 1", "1")


def test_warm_start_demonstrations_are_agent_loop_episodes():
    """The warm start's demonstrations hold the tokens an episode of the agent loop would: the
    calculator call, the tool's result in the Hermes glue (mask 0), the answer; or a guess."""
    from megarl.data.tiny_model import build_tokenizer
    from megarl.data.warm_start import demonstrations

    tok = build_tokenizer(128)
    rows = generate_rows("tool_multiply", 40, seed=3)
    examples = demonstrations(rows, tok, call_fraction=0.5, seed=0)
    calls = 0
    for row, (ids, mask) in zip(rows, examples):
        a, b = row["prompt"][0]["content"].split()[-1].split("*")
        answer = row["reward_model"]["ground_truth"]
        assert answer == str(int(a) * int(b)) and len(ids) == len(mask)
        prompt = tok.apply_chat_template(row["prompt"], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)
        assert ids[:len(prompt)] == list(prompt) and not any(mask[:len(prompt)])
        trained = tok.decode([i for i, m in zip(ids, mask) if m])
        shown = tok.decode([i for i, m in zip(ids[len(prompt):], mask[len(prompt):]) if not m])
        if "<tool_call>" in trained:
            calls += 1
            assert trained == ('<tool_call>{"name": "calculator", "arguments": {"expression": "'
                               f'{a}*{b}"}}}}</tool_call><|im_end|>{answer}<|im_end|>')
            assert shown == ("\n<|im_start|>user\n<tool_response>\n"
                             f"{answer}\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
            assert score("synthetic/tool_multiply", tok.decode(ids[len(prompt):],
                         skip_special_tokens=True), answer) == 1.0
        else:
            assert shown == "" and trained.endswith("<|im_end|>") and trained[:-10].isdigit()
    assert 10 < calls < 30  # about half
