"""Shared fixtures of the data tests: the tiny char-level tokenizer."""

from __future__ import annotations

import pytest

from megarl.data.tiny_model import build_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    """The tiny models' tokenizer (91 tokens, chat template)."""
    return build_tokenizer(128)

