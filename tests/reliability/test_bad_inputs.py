"""The bad-input corpus, part 1: prompt data, configs and reward functions.

Each case builds its malformed input under ``tmp_path``, runs the real entry point (the prompt
dataset, the config loader, ``megarl train``, the reward manager) and checks the exception, its
one-line message (naming the file/field/row and the fix) and that no file under ``tmp_path``
changed: nothing is left half-written. Part 2 (test_bad_model_inputs.py): model directories,
engine input, checkpoints.
"""

from __future__ import annotations

import json
import re
import textwrap
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pytest

from megarl.config.loader import ConfigError, load_config
from megarl.data.dataset import DatasetError, PromptDataset
from megarl.reward import RewardError, RewardManager, RewardSample

from .corpus import GOOD_ROW, expect_one_line, snapshot, write_parquet


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    """The tiny model's char-level tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------
# Prompt data


def _truncated(path: Path) -> Path:
    good = write_parquet(path.with_name("whole.parquet"), [GOOD_ROW] * 4)
    path.write_bytes(good.read_bytes()[:200])
    good.unlink()
    return path


def _text(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _without(key: str, **extra: object) -> dict:
    return {**{k: v for k, v in GOOD_ROW.items() if k != key}, **extra}


# case -> (how to make the input under a directory, the expected message)
DATA_CASES: dict[str, tuple[Callable[[Path], Path], str]] = {
    "missing file": (
        lambda d: d / "nope.parquet",
        r"nope\.parquet: data file not found; check the path in data\.\*_files"),
    "zero-byte parquet": (
        lambda d: _text(d / "z.parquet", ""),
        (r"z\.parquet: cannot read parquet \(.*size is 0 bytes\); the file is corrupt or not "
        r"parquet, regenerate it")),
    "truncated parquet": (
        lambda d: _truncated(d / "t.parquet"),
        r"t\.parquet: cannot read parquet \(.*\); the file is corrupt"),
    "not parquet at all": (
        lambda d: _text(d / "j.parquet", "{}"),
        r"j\.parquet: cannot read parquet"),
    "parquet without rows": (
        lambda d: write_parquet(d / "e.parquet", [], pa.Table.from_pylist([GOOD_ROW]).schema),
        r"e\.parquet: file has no rows; regenerate it or remove it from data\.\*_files"),
    "rows without the prompt key": (
        lambda d: write_parquet(d / "k.parquet", [_without("prompt", question="1+1=")]),
        (r"k\.parquet: row 0: missing key 'prompt' \(keys present: data_source, question, "
        r"reward_model\); set data\.prompt_key to the column that holds the chat messages")),
    "one row without the prompt key": (
        lambda d: write_parquet(d / "n.parquet", [GOOD_ROW, _without("prompt")]),
        r"n\.parquet: row 1: prompt is null .*; give every row a prompt or drop the row"),
    "prompt of the wrong type": (
        lambda d: write_parquet(d / "w.parquet", [dict(GOOD_ROW, prompt=7)]),
        (r"w\.parquet: row 0: prompt must be a non-empty list of \{role, content\} messages or "
        r"a string, got int 7")),
    "message without content": (
        lambda d: write_parquet(d / "m.parquet", [dict(GOOD_ROW, prompt=[{"role": "user"}])]),
        r"m\.parquet: row 0: prompt message 0 must be a dict with string 'role' and 'content'"),
    "row without ground truth": (
        lambda d: write_parquet(d / "g.parquet", [{"prompt": "hi", "data_source": "x"}]),
        r"g\.parquet: row 0: missing key 'reward_model\.ground_truth'"),
    "jsonl line that is not JSON": (
        lambda d: _text(d / "b.jsonl", json.dumps(GOOD_ROW) + "\n{oops\n"),
        (r"b\.jsonl: line 2 \(row 1\) is not valid JSON \(.*\); each line must be one JSON "
        r"object")),
    "jsonl line that is a list": (
        lambda d: _text(d / "l.jsonl", json.dumps(GOOD_ROW) + "\n[1, 2]\n"),
        r"l\.jsonl: line 2 \(row 1\) is a JSON list, expected an object"),
    "unsupported format": (
        lambda d: _text(d / "x.csv", "a,b"),
        r"x\.csv: unsupported extension '\.csv'; use one of \.parquet, \.jsonl"),
    "a directory": (
        lambda d: d,
        r": is a directory; list its \.parquet / \.jsonl files"),
}


@pytest.mark.parametrize("case", list(DATA_CASES))
def test_bad_prompt_data(case, tokenizer, tmp_path):
    make, pattern = DATA_CASES[case]
    path = make(tmp_path)
    expect_one_line(lambda: PromptDataset([path], tokenizer, max_prompt_length=64,
                                          vocab_size=128),
                    DatasetError, pattern, tmp_path)


def test_token_ids_outside_the_model_vocabulary(tokenizer, tmp_path):
    path = write_parquet(tmp_path / "v.parquet", [GOOD_ROW])
    expect_one_line(lambda: PromptDataset([path], tokenizer, max_prompt_length=64, vocab_size=20),
                    DatasetError, r"v\.parquet: row 0: token id \d+ at position \d+ is outside "
                    r"the model's vocabulary \(vocab_size=20\); the tokenizer does not match the "
                    r"model", tmp_path)


def test_over_long_prompts_are_filtered_and_counted(tokenizer, tmp_path, caplog):
    long_row = dict(GOOD_ROW, prompt=[{"role": "user", "content": "x" * 300}])
    path = write_parquet(tmp_path / "long.parquet", [GOOD_ROW, long_row, GOOD_ROW, long_row])
    with caplog.at_level("WARNING"):
        data = PromptDataset([path], tokenizer, max_prompt_length=64, vocab_size=128)
    assert (len(data), data.num_rows, data.num_filtered) == (2, 4, 2)
    assert [row["index"] for row in data] == [0, 2]
    (line,) = [r.getMessage() for r in caplog.records]
    assert "filtered 2 of 4 prompts longer than max_prompt_length=64 tokens" in line
    only_long = write_parquet(tmp_path / "only_long.parquet", [long_row])
    expect_one_line(lambda: PromptDataset([only_long], tokenizer, max_prompt_length=64,
                                          vocab_size=128),
                    DatasetError, r"all 1 prompts in .*only_long\.parquet are longer than "
                    r"max_prompt_length=64 tokens; raise data\.max_prompt_length", tmp_path)


# ---------------------------------------------------------------------------------------------
# Config: every kind of type error, one line each

BAD_CONFIG = """\
model:
  path: {model}
  dtype: float64
data:
  train_files: [{data}]
  train_batch_size: lots
  max_prompt_length: 12.5
  shuffle: maybe
actor:
  ppo_epochs: -1
  optim:
    lr: fast
    betas: [0.9]
  parallel: 4
  clip_ratio_hight: 0.3
rollout:
  n: true
  top_p: 2
  api_key: 1234
  max_num_seqs: many
trainer:
  loggers: [console, carrier_pigeon]
  experiment_name: [a, b]
  total_steps: null
rollouts:
  n: 4
"""

CONFIG_LINES = [
    "model.dtype: 'float64' (from {file}) is not one of 'bfloat16', 'float16' or 'float32'",
    "data.train_batch_size: 'lots' (from {file}) is not a whole number",
    "data.max_prompt_length: 12.5 (from {file}) is not a whole number",
    "data.shuffle: 'maybe' (from {file}) is not true or false",
    "actor.ppo_epochs: -1 (from {file}) is out of range, it must be >= 1",
    "actor.optim.lr: 'fast' (from {file}) is not a number",
    "actor.optim.betas.1: required but not set",
    "actor.parallel: 4 (from {file}) is not a mapping of its fields",
    "actor.clip_ratio_hight: unknown key (in {file}) — did you mean actor.clip_ratio_high?",
    "rollout.n: True (from {file}) is not a whole number",
    "rollout.top_p: 2 (from {file}) is out of range, it must be <= 1.0",
    "rollout.api_key: '***' (a secret, not shown) (from {file}) is not a string",
    "rollout.max_num_seqs: 'many' (from {file}) is not a whole number or one of 'auto'",
    ("trainer.loggers.1: 'carrier_pigeon' (from {file}) is not one of 'console', 'jsonl', "
     "'tensorboard' or 'wandb'"),
    "trainer.experiment_name: ['a', 'b'] (from {file}) is not a string",
    "trainer.total_steps: None (from {file}) is not a whole number",
    "rollouts.n: unknown key (in {file}) — did you mean rollout.n?",
]


def test_config_with_every_kind_of_type_error(model_dir, tmp_path):
    data = write_parquet(tmp_path / "train.parquet", [GOOD_ROW] * 4)
    config = tmp_path / "bad.yaml"
    config.write_text(BAD_CONFIG.format(model=model_dir, data=data))
    before = snapshot(tmp_path)
    with pytest.raises(ConfigError) as caught:
        load_config(config, [])
    assert snapshot(tmp_path) == before
    lines = caught.value.lines
    assert len(lines) == len(CONFIG_LINES), "\n".join(lines)
    for expected in CONFIG_LINES:
        text = expected.format(file=config, data=data)
        assert sum(line.startswith(text) for line in lines) == 1, (text, lines)
        line = next(line for line in lines if line.startswith(text))
        assert "\n" not in line and " — " in line, line


@pytest.mark.parametrize("text,expected", [
    ("model: [\n", r"line \d+, column \d+: YAML syntax error: .* — fix the file"),
    ("- a\n- b\n", r"the top level is a list, not a mapping of sections"),
])
def test_config_files_that_are_not_configs(text, expected, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(text)
    expect_one_line(lambda: load_config(config, []), ConfigError, expected, tmp_path)


def _train_config(tmp_path: Path, model: Path, *overrides: str) -> list[str]:
    data = write_parquet(tmp_path / "train.parquet", [GOOD_ROW] * 16)
    return ["--config", str(REPO / "configs" / "tiny-moe-cpu.yaml"), f"model.path={model}",
            f"data.train_files=[{data}]", "data.val_files=[]",
            f"trainer.output_dir={tmp_path / 'run'}", *overrides]


@pytest.mark.parametrize("case", ["type error", "model without weights", "exposed engines",
                                  "corrupt parquet"])
def test_megarl_train_refuses_bad_input_before_writing_anything(case, model_dir, tmp_path,
                                                                 capsys):
    from megarl.trainer import train_main

    model, overrides, expected = model_dir, [], ""
    if case == "type error":
        overrides, expected = ["rollout.n=many"], "error: rollout.n: 'many' (from override) is "
    elif case == "model without weights":
        model = tmp_path / "card"
        model.mkdir()
        (model / "config.json").write_bytes((model_dir / "config.json").read_bytes())
        expected = f"model.path: {model} has a config.json but no weights (*.safetensors)"
    elif case == "corrupt parquet":
        bad = tmp_path / "corrupt.parquet"
        bad.write_bytes(b"PAR1" + b"\x00" * 64)
        overrides = [f"data.train_files=[{bad}]", "actor.parallel.ep=1"]
        expected = f"error: {bad}"
    else:
        overrides = ["rollout.host=0.0.0.0"]
        expected = ("rollout.host, rollout.api_key: host 0.0.0.0 opens the engines' generation, "
                    "control and weight-update endpoints to the network without an API key")
    argv = _train_config(tmp_path, model, *overrides)
    before = snapshot(tmp_path)
    assert train_main(argv) == 2
    errors = capsys.readouterr().err.splitlines()
    assert any(line.startswith(expected) for line in errors), errors
    assert not (tmp_path / "run").exists() and snapshot(tmp_path) == before


# ---------------------------------------------------------------------------------------------
# Reward functions

REWARDS = textwrap.dedent("""\
    def raises(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": 1.0}["answer"]

    def nan(data_source, solution_str, ground_truth, extra_info=None):
        return float("nan")
""")


@pytest.mark.parametrize("name,pattern", [
    ("raises", (r"reward\.function='.*rewards\.py:raises' failed on sample 0 "
                r"\(data_source='x', response\[:200\]='one'\): raised KeyError: 'answer'")),
    ("nan", r"reward\.function='.*rewards\.py:nan' .*sample 0 .*(nan|not finite)"),
])
def test_reward_function_that_raises_or_returns_nan(name, pattern, tmp_path):
    functions = tmp_path / "rewards.py"
    functions.write_text(REWARDS)
    manager = RewardManager(f"{functions}:{name}", num_workers=0)
    samples = [RewardSample("x", text, "2", {}) for text in ("one", "two")]
    before = snapshot(tmp_path)
    with pytest.raises(RewardError) as caught:
        manager.score(samples)
    first_line = str(caught.value).splitlines()[0]  # then the function's own traceback
    assert re.search(pattern, first_line), first_line
    assert snapshot(tmp_path) == before


