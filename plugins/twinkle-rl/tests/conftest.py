"""Shared fixtures of the twinkle-rl tests: the bundled chat tokenizer and a JSONL writer."""

from __future__ import annotations

import json
import os
import sys

import pytest

# the helper modules beside the tests (script_runs, rewards_for_tests) import by name
sys.path.insert(0, os.path.dirname(__file__))

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
TOKENIZER_DIR = os.path.join(REPO, "examples", "quickstart", "tokenizer")


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


@pytest.fixture
def write_jsonl(tmp_path):
    """Write rows (dicts, or raw strings written as they are) to a JSONL file; return its path."""

    def write(rows, name="pairs.jsonl"):
        path = tmp_path / name
        path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
        return str(path)

    return write
