"""docs/plan.md quotes `flashmemory plan`: every text block there is lines of the output of the command named just
before it, so the page cannot drift from the model."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from flashmemory.cli import main

PAGE = Path(__file__).resolve().parents[2] / "docs" / "plan.md"
QUOTE = re.compile(r"`\.venv/bin/flashmemory plan([^`]*)`[^`]*?```text\n(.*?)```", re.S)


def test_every_quoted_block_is_the_commands_output(capsys: pytest.CaptureFixture[str]) -> None:
    quotes = QUOTE.findall(PAGE.read_text())
    assert len(quotes) == 4
    for flags, block in quotes:
        assert main(["plan", *shlex.split(flags)]) == 0
        out = capsys.readouterr().out.splitlines()
        for line in block.strip("\n").splitlines():
            assert line in out, (flags, line)
