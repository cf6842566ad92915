"""Helpers of the bad-input corpus: snapshots of a directory and the one-line-error check."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

GOOD_ROW = {"prompt": [{"role": "user", "content": "1+1="}], "data_source": "x",
            "reward_model": {"ground_truth": "2", "style": "rule"}}


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def expect_one_line(action: Callable[[], object], error: type[BaseException], pattern: str,
                    root: Path) -> str:
    """Run ``action``; it must raise ``error`` with a one-line message matching ``pattern``
    and leave every file under ``root`` as it was."""
    before = snapshot(root)
    with pytest.raises(error) as caught:
        action()
    message = str(caught.value)
    assert "\n" not in message, message
    assert re.search(pattern, message), message
    assert snapshot(root) == before, "the failure wrote or changed files"
    return message


def write_parquet(path: Path, rows: list[dict], schema: pa.Schema | None = None) -> Path:
    """``rows`` as a parquet file at ``path``."""
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path
