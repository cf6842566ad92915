"""Prompt datasets in verl's schema, read from parquet or JSONL files.

A row holds ``prompt`` (a list of chat messages ``{role, content}``; a plain string becomes one
user message), ``data_source``, ``reward_model: {ground_truth, style}`` and ``extra_info``.
:class:`PromptDataset` reads one or more files (concatenated in order), applies the tokenizer's
chat template, checks every token id against the model's vocabulary (PITFALLS T4) and filters
prompts longer than ``max_prompt_length`` tokens, counting them (``num_filtered``) and logging
one line. A row whose ``input_ids`` column is set (not null) is pre-tokenized: those ids are the
prompt, checked against the vocabulary the same way, and the chat template is not applied. Every problem with the input is one :class:`DatasetError` line naming the file, the
row and the fix.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SUPPORTED_EXTENSIONS = (".parquet", ".jsonl")
IDS_COLUMN = "input_ids"
"""Column of a pre-tokenized prompt: used as the prompt's token ids instead of the template's."""


class DatasetError(ValueError):
    """A data file that cannot be used; the message names the file, the row and the fix."""


def check_data_files(paths: str | Path | Sequence[str | Path]) -> list[Path]:
    """Check that every data file exists and has a supported extension; return them as paths.

    Cheap enough to run before any worker starts (PITFALLS S3); reading happens later.
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    if not paths:
        raise DatasetError("no data files given; set data.train_files to a parquet or jsonl file")
    checked = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            raise DatasetError(f"{path}: is a directory; list its .parquet / .jsonl files in "
                               "data.*_files")
        if path.suffix not in SUPPORTED_EXTENSIONS:
            raise DatasetError(
                f"{path}: unsupported extension {path.suffix!r}; "
                f"use one of {', '.join(SUPPORTED_EXTENSIONS)}"
            )
        if not path.is_file():
            raise DatasetError(f"{path}: data file not found; check the path in data.*_files")
        checked.append(path)
    return checked


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Read the raw rows of one parquet or JSONL file as dicts (no validation of the schema)."""
    path = check_data_files(path)[0]
    rows = _read_parquet(path) if path.suffix == ".parquet" else _read_jsonl(path)
    if not rows:
        raise DatasetError(
            f"{path}: file has no rows; regenerate it or remove it from data.*_files"
        )
    return rows


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DatasetError(
            f"{path}: cannot read parquet ({first_line}); the file is corrupt or not parquet, "
            "regenerate it"
        ) from None
    return table.to_pylist()


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(
                    f"{path}: line {line_no} (row {len(rows)}) is not valid JSON ({exc.msg}); "
                    "each line must be one JSON object"
                ) from None
            if not isinstance(row, dict):
                raise DatasetError(
                    f"{path}: line {line_no} (row {len(rows)}) is a JSON {type(row).__name__}, "
                    "expected an object with the keys prompt, data_source, reward_model"
                )
            rows.append(row)
    return rows


def _missing_key(where: str, key: str, row: dict[str, Any], fix: str) -> DatasetError:
    present = ", ".join(sorted(map(str, row))) or "none"
    return DatasetError(f"{where}: missing key {key!r} (keys present: {present}); {fix}")


def normalize_prompt(value: Any, where: str) -> list[dict[str, str]]:
    """Return the prompt as a list of ``{role, content}`` messages; a string is one user turn."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, (list, tuple)) or not value:
        raise DatasetError(
            f"{where}: prompt must be a non-empty list of {{role, content}} messages or a "
            f"string, got {type(value).__name__} {value!r:.60}"
        )
    messages = []
    for i, msg in enumerate(value):
        if not (isinstance(msg, dict) and isinstance(msg.get("role"), str)
                and isinstance(msg.get("content"), str)):
            raise DatasetError(
                f"{where}: prompt message {i} must be a dict with string 'role' and 'content', "
                f"got {msg!r:.80}"
            )
        messages.append({"role": msg["role"], "content": msg["content"]})
    return messages


def parse_row(row: dict[str, Any], where: str, prompt_key: str = "prompt") -> dict[str, Any]:
    """Validate a raw row; return its raw_prompt, data_source, ground_truth, style, extra_info."""
    if prompt_key not in row:
        raise _missing_key(where, prompt_key, row,
                           "set data.prompt_key to the column that holds the chat messages")
    if row[prompt_key] is None:
        raise DatasetError(f"{where}: {prompt_key} is null (in parquet, a row written without "
                           f"the key reads as null); give every row a {prompt_key} or drop the "
                           "row")
    if not isinstance(row.get("data_source"), str):
        raise _missing_key(where, "data_source", row,
                           "every row needs a string data_source naming its reward function")
    reward_model = row.get("reward_model")
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        raise _missing_key(where, "reward_model.ground_truth", row,
                           "every row needs reward_model: {ground_truth, style}")
    extra_info = row.get("extra_info") or {}
    if not isinstance(extra_info, dict):
        raise DatasetError(f"{where}: extra_info must be a dict, got {type(extra_info).__name__}")
    return {
        "raw_prompt": normalize_prompt(row[prompt_key], where),
        "data_source": row["data_source"],
        "ground_truth": reward_model["ground_truth"],
        "style": reward_model.get("style") or "rule",
        "extra_info": dict(extra_info),
    }


class PromptDataset(Sequence):
    """Tokenized prompts from parquet/JSONL files, filtered by length, ids checked against vocab.

    Each item is a dict with ``input_ids`` (the row's ``input_ids`` column when set, else the
    prompt with the chat template applied and the generation prompt added),
    ``raw_prompt`` (the messages), ``data_source``, ``ground_truth``, ``style``, ``extra_info`` and
    ``index`` (the row's position in the concatenation of all files, counted before filtering).
    """

    def __init__(
        self,
        files: str | Path | Sequence[str | Path],
        tokenizer: Any,
        *,
        max_prompt_length: int,
        vocab_size: int,
        prompt_key: str = "prompt",
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if max_prompt_length <= 0:
            raise DatasetError(f"data.max_prompt_length must be > 0, got {max_prompt_length}")
        if getattr(tokenizer, "chat_template", None) is None:
            raise DatasetError(
                f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; "
                "use the model's instruct tokenizer or set tokenizer.chat_template"
            )
        self.files = check_data_files(files)
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        self.vocab_size = vocab_size
        self.prompt_key = prompt_key
        self._template_kwargs = dict(chat_template_kwargs or {})
        self.examples: list[dict[str, Any]] = []
        self.num_rows = 0
        self.num_filtered = 0
        longest_filtered = 0
        for path in self.files:
            for row_idx, row in enumerate(read_rows(path)):
                where = f"{path}: row {row_idx}"
                example = parse_row(row, where, prompt_key)
                example["input_ids"] = self._prompt_ids(row, example["raw_prompt"], where)
                example["index"] = self.num_rows
                self.num_rows += 1
                if len(example["input_ids"]) > max_prompt_length:
                    self.num_filtered += 1
                    longest_filtered = max(longest_filtered, len(example["input_ids"]))
                    continue
                self.examples.append(example)
        if self.num_filtered:
            logger.warning(
                "data: filtered %d of %d prompts longer than max_prompt_length=%d tokens "
                "(longest %d) from %s",
                self.num_filtered, self.num_rows, max_prompt_length, longest_filtered,
                ", ".join(map(str, self.files)),
            )
        if not self.examples:
            raise DatasetError(
                f"all {self.num_rows} prompts in {', '.join(map(str, self.files))} are longer "
                f"than max_prompt_length={max_prompt_length} tokens; raise data.max_prompt_length"
            )

    def _prompt_ids(self, row: dict[str, Any], messages: list[dict[str, str]],
                    where: str) -> list[int]:
        """The row's ``input_ids`` column when set, else its messages through the template."""
        given = row.get(IDS_COLUMN)
        if given is None:
            return self._tokenize(messages, where)
        if (not isinstance(given, (list, tuple)) or not given
                or not all(isinstance(i, int) and not isinstance(i, bool) for i in given)):
            raise DatasetError(
                f"{where}: column {IDS_COLUMN!r} must be a non-empty list of integer token ids, "
                f"got {given!r:.60}; fix the column, or drop it to tokenize the {self.prompt_key}"
                " column with the chat template")
        self._check_vocab(list(given), f"{where}: column {IDS_COLUMN!r}",
                          "the ids were made with another tokenizer: re-tokenize with the "
                          f"model's tokenizer, or drop the column to tokenize {self.prompt_key!r}")
        return [int(i) for i in given]

    def _check_vocab(self, ids: list[int], where: str, fix: str) -> None:
        """Raise naming ``where`` and ``fix`` when an id is outside the model's vocabulary."""
        for pos, token_id in enumerate(ids):
            if not 0 <= token_id < self.vocab_size:
                raise DatasetError(
                    f"{where}: token id {token_id} at position {pos} is outside the model's "
                    f"vocabulary (vocab_size={self.vocab_size}); {fix}"
                )

    def _tokenize(self, messages: list[dict[str, str]], where: str) -> list[int]:
        try:
            ids = self.encode_prompt(messages)
        except Exception as exc:  # jinja errors from the template: name the row that caused them
            raise DatasetError(
                f"{where}: the tokenizer's chat template failed on this prompt "
                f"({type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}); "
                "fix the row's messages or the chat template"
            ) from exc
        self._check_vocab(ids, where, "the tokenizer does not match the model: use the "
                          "tokenizer saved with the model")
        return ids

    def encode_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of ``messages`` with the chat template and the generation prompt applied."""
        ids = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False,
            **self._template_kwargs,
        )
        return [int(i) for i in ids]

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.examples[i]


def model_vocab_size(model_path: str | Path) -> int:
    """The vocabulary size in an HF model directory's ``config.json`` (or its ``text_config``)."""
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        raise DatasetError(f"{config_file}: not found; model.path must be an HF model directory")
    config = json.loads(config_file.read_text())
    vocab_size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    if not isinstance(vocab_size, int):
        raise DatasetError(f"{config_file}: no integer vocab_size field")
    return vocab_size


def load_prompt_dataset(
    files: str | Path | Sequence[str | Path],
    model_path: str | Path,
    *,
    max_prompt_length: int,
    prompt_key: str = "prompt",
    trust_remote_code: bool = False,
) -> PromptDataset:
    """A :class:`PromptDataset` using the tokenizer and vocab size of an HF model directory
    (``trust_remote_code``: the tokenizer may run custom code shipped with the model)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_path), trust_remote_code=trust_remote_code)
    return PromptDataset(
        files, tokenizer, max_prompt_length=max_prompt_length,
        vocab_size=model_vocab_size(model_path), prompt_key=prompt_key,
    )
