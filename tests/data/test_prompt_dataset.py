"""PromptDataset: parquet/JSONL reading, chat template, length filter, vocab check, errors."""

from __future__ import annotations

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megarl.data.dataset import (
    DatasetError,
    PromptDataset,
    load_prompt_dataset,
    model_vocab_size,
    read_rows,
)
from megarl.data.synthetic import write_rows
from megarl.data.tiny_model import build_tokenizer, make_tiny_model


def make_row(content: str, answer: str = "1", index: int = 0) -> dict:
    """One row in verl's schema with a one-message prompt."""
    return {
        "data_source": "test/src",
        "prompt": [{"role": "user", "content": content}],
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"index": index, "split": "train"},
    }


def dataset(files, tokenizer, max_len=512, vocab=128, **kw) -> PromptDataset:
    return PromptDataset(files, tokenizer, max_prompt_length=max_len, vocab_size=vocab, **kw)


def sample_rows(n: int = 6) -> list[dict]:
    rows = [make_row(f"What is {i}+{i}?", answer=str(2 * i), index=i) for i in range(n)]
    rows[1]["prompt"] = [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "Say 1."}]
    return rows


@pytest.mark.parametrize("ext", ["parquet", "jsonl"])
def test_round_trip_keeps_every_field(tmp_path, tokenizer, ext):
    rows = sample_rows()
    path = write_rows(tmp_path / f"d.{ext}", rows)
    assert read_rows(path) == rows
    ds = dataset(path, tokenizer)
    assert len(ds) == len(rows) and ds.num_filtered == 0 and ds.num_rows == len(rows)
    for i, (item, row) in enumerate(zip(ds, rows, strict=True)):
        assert item["raw_prompt"] == row["prompt"]
        assert item["data_source"] == "test/src"
        assert item["ground_truth"] == str(2 * i) and item["style"] == "rule"
        assert item["extra_info"] == {"index": i, "split": "train"}
        assert item["index"] == i


def test_chat_template_matches_the_tokenizer_called_directly(tmp_path, tokenizer):
    rows = sample_rows()
    ds = dataset(write_rows(tmp_path / "d.parquet", rows), tokenizer)
    for item, row in zip(ds, rows, strict=True):
        direct = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True,
                                               tokenize=True, return_dict=False)
        assert item["input_ids"] == list(direct)
    # and against the template written out by hand
    text = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSay 1.<|im_end|>\n"
            "<|im_start|>assistant\n")
    assert ds[1]["input_ids"] == tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ds[1]["input_ids"]) == text


def test_plain_string_prompt_is_one_user_message_and_prompt_key_is_configurable(
        tmp_path, tokenizer):
    row = make_row("ignored")
    del row["prompt"]
    row["question"] = "Say 7."
    ds = dataset(write_rows(tmp_path / "d.jsonl", [row]), tokenizer, prompt_key="question")
    assert ds[0]["raw_prompt"] == [{"role": "user", "content": "Say 7."}]
    assert tokenizer.decode(ds[0]["input_ids"]) == (
        "<|im_start|>user\nSay 7.<|im_end|>\n<|im_start|>assistant\n")


def test_several_files_are_concatenated_in_order(tmp_path, tokenizer):
    a = write_rows(tmp_path / "a.parquet", [make_row("first"), make_row("second")])
    b = write_rows(tmp_path / "b.jsonl", [make_row("third")])
    ds = dataset([a, b], tokenizer)
    assert [it["raw_prompt"][0]["content"] for it in ds] == ["first", "second", "third"]
    assert [it["index"] for it in ds] == [0, 1, 2]


def test_length_filter_counts_and_logs_one_line(tmp_path, tokenizer, caplog):
    # 19 tokens of template around the content: content of k chars -> k + 19 tokens
    rows = [make_row("x" * k) for k in (1, 11, 12, 30, 5, 40)]
    path = write_rows(tmp_path / "d.parquet", rows)
    with caplog.at_level(logging.WARNING, logger="megarl.data.dataset"):
        ds = dataset(path, tokenizer, max_len=30)
    assert [len(it["input_ids"]) for it in ds] == [20, 30, 24]
    assert [it["index"] for it in ds] == [0, 1, 4]
    assert ds.num_filtered == 3 and ds.num_rows == 6
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1
    assert "filtered 3 of 6" in lines[0] and "max_prompt_length=30" in lines[0]
    assert "longest 59" in lines[0] and "d.parquet" in lines[0]


def test_all_prompts_too_long_is_an_error_not_an_empty_dataset(tmp_path, tokenizer):
    path = write_rows(tmp_path / "d.jsonl", [make_row("x" * 50)])
    with pytest.raises(DatasetError, match=r"all 1 prompts .* max_prompt_length=10"):
        dataset(path, tokenizer, max_len=10)


def test_token_id_outside_vocab_names_file_row_and_id(tmp_path, tokenizer):
    # '#' is the last token (id 90); a model vocab of 90 has no room for it
    assert tokenizer.convert_tokens_to_ids("#") == 90
    rows = [make_row("a"), make_row("b"), make_row("a#")]
    path = write_rows(tmp_path / "d.parquet", rows)
    with pytest.raises(DatasetError) as err:
        dataset(path, tokenizer, vocab=90)
    msg = str(err.value)
    assert str(path) in msg and "row 2" in msg and "position 7" in msg
    assert "token id 90" in msg and "vocab_size=90" in msg
    assert "\n" not in msg


def test_chat_template_failure_names_the_row(tmp_path):
    strict = build_tokenizer(128)
    strict.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                            "{{ raise_exception('no system role') }}{% endif %}"
                            "{{ m['content'] }}{% endfor %}")
    path = write_rows(tmp_path / "d.jsonl", sample_rows(3))
    expect_error(path, strict, "row 1", "chat template failed", "no system role")


def test_vocab_size_and_loading_from_a_model_dir(tmp_path):
    model = make_tiny_model(tmp_path / "m", arch="qwen3", vocab_size=112)
    assert model_vocab_size(model) == 112
    path = write_rows(tmp_path / "d.jsonl", sample_rows(3))
    ds = load_prompt_dataset(path, model, max_prompt_length=64)
    assert len(ds) == 3 and ds.vocab_size == 112


def expect_error(path, tokenizer, *fragments, **kw):
    with pytest.raises(DatasetError) as err:
        dataset(path, tokenizer, **kw)
    msg = str(err.value)
    for fragment in (str(path), *fragments):
        assert fragment in msg, (fragment, msg)
    assert "\n" not in msg
    return msg


def test_missing_file(tmp_path, tokenizer):
    expect_error(tmp_path / "nope.parquet", tokenizer, "not found")


def test_unsupported_extension(tmp_path, tokenizer):
    path = tmp_path / "d.csv"
    path.write_text("prompt\nhi\n")
    expect_error(path, tokenizer, "unsupported extension '.csv'", ".parquet", ".jsonl")


def test_empty_files(tmp_path, tokenizer):
    empty_jsonl = tmp_path / "e.jsonl"
    empty_jsonl.write_text("\n\n")
    expect_error(empty_jsonl, tokenizer, "no rows")
    empty_parquet = tmp_path / "e.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), empty_parquet)
    expect_error(empty_parquet, tokenizer, "no rows")


def test_corrupt_parquet(tmp_path, tokenizer):
    path = write_rows(tmp_path / "d.parquet", sample_rows())
    path.write_bytes(path.read_bytes()[:-40])
    expect_error(path, tokenizer, "cannot read parquet", "corrupt")
    garbage = tmp_path / "g.parquet"
    garbage.write_bytes(b"not a parquet file at all")
    expect_error(garbage, tokenizer, "cannot read parquet")


def test_bad_json_line_names_the_line(tmp_path, tokenizer):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(make_row("ok")) + "\n{broken\n")
    expect_error(path, tokenizer, "line 2 (row 1)", "not valid JSON")


@pytest.mark.parametrize("ext", ["parquet", "jsonl"])
def test_row_without_prompt_key_names_file_row_key_and_present_keys(tmp_path, tokenizer, ext):
    rows = sample_rows(4)
    rows[3] = {"data_source": "s", "question": "hi",
               "reward_model": {"ground_truth": "1", "style": "rule"}, "extra_info": {}}
    if ext == "parquet":  # parquet rows share one schema: the missing column is null there
        rows = [{k: v for k, v in r.items() if k != "prompt"} | {"question": "q"} for r in rows]
        rows[3] = rows[3] | {"extra_info": {"index": 3, "split": "train"}}
    path = write_rows(tmp_path / f"d.{ext}", rows)
    row = 0 if ext == "parquet" else 3
    expect_error(path, tokenizer, f"row {row}", "missing key 'prompt'",
                 "keys present: data_source, extra_info, question, reward_model",
                 "data.prompt_key")


def test_row_without_reward_model_or_data_source(tmp_path, tokenizer):
    rows = sample_rows(2)
    del rows[1]["reward_model"]
    expect_error(write_rows(tmp_path / "a.jsonl", rows), tokenizer,
                 "row 1", "'reward_model.ground_truth'", "keys present: data_source")
    rows = sample_rows(2)
    del rows[0]["data_source"]
    expect_error(write_rows(tmp_path / "b.jsonl", rows), tokenizer, "row 0", "'data_source'")


def test_malformed_prompt_messages(tmp_path, tokenizer):
    rows = sample_rows(3)
    rows[2]["prompt"] = [{"role": "user"}]
    expect_error(write_rows(tmp_path / "a.jsonl", rows), tokenizer, "row 2", "message 0")
    rows[2]["prompt"] = []
    expect_error(write_rows(tmp_path / "b.jsonl", rows), tokenizer, "row 2", "non-empty list")


@pytest.mark.parametrize("ext", ["parquet", "jsonl"])
def test_an_input_ids_column_is_the_prompt(tmp_path, tokenizer, ext):
    rows = sample_rows(3)
    rows[0]["input_ids"] = [5, 6, 7, 8]
    rows[2]["input_ids"] = [9, 10]
    path = write_rows(tmp_path / f"d.{ext}", rows)
    ds = dataset(path, tokenizer, max_len=3)
    # row 0 (4 ids) is filtered by its given length; row 1 has no ids (null in parquet) and is
    # tokenized from its text, which is longer than 3 tokens too; row 2 keeps its own ids.
    assert ds.num_filtered == 2 and [item["index"] for item in ds] == [2]
    assert ds[0]["input_ids"] == [9, 10] and ds[0]["raw_prompt"] == rows[2]["prompt"]
    ds = dataset(path, tokenizer)
    assert [item["input_ids"] for item in ds][::2] == [[5, 6, 7, 8], [9, 10]]
    assert ds[1]["input_ids"] == tokenizer.apply_chat_template(
        rows[1]["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False)


@pytest.mark.parametrize("ext", ["parquet", "jsonl"])
def test_input_ids_outside_the_vocab_name_file_row_and_column(tmp_path, tokenizer, ext):
    rows = sample_rows(2)
    rows[0]["input_ids"], rows[1]["input_ids"] = [1, 2], [3, 500]
    path = write_rows(tmp_path / f"d.{ext}", rows)
    with pytest.raises(DatasetError) as err:
        dataset(path, tokenizer)
    message = str(err.value)
    assert f"{path}: row 1: column 'input_ids'" in message
    assert "token id 500 at position 1" in message and "vocab_size=128" in message


def test_input_ids_that_are_not_token_ids_are_refused(tmp_path, tokenizer):
    for bad in ([], [1.5, 2], "1 2 3", [True]):
        row = make_row("x")
        row["input_ids"] = bad
        path = tmp_path / "d.jsonl"
        path.write_text(json.dumps(row) + "\n")
        with pytest.raises(DatasetError, match=r"d.jsonl: row 0: column 'input_ids' must be a "
                                               "non-empty list of integer token ids"):
            dataset(path, tokenizer)
