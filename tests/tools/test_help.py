"""`--help` as users read it: the tools' examples keep their line continuations, flags do not
contradict their defaults."""

from __future__ import annotations

import ast
import re

import pytest

from tests.data.helpers import REPO_ROOT
from tests.tools.helpers import run_tool


def _continued_lines(tool: str) -> list[tuple[str, str]]:
    """(line ending in a backslash, the line after it) pairs of the tool's module docstring source."""
    source = (REPO_ROOT / "tools" / f"{tool}.py").read_text()
    doc = ast.parse(source).body[0]
    text = ast.get_source_segment(source, doc.value)
    lines = text.splitlines()
    return [(line, lines[i + 1]) for i, line in enumerate(lines) if line.endswith("\\")]


@pytest.mark.parametrize("tool", ["generate", "length_upsample", "merge_datasets", "preprocess_data"])
def test_help_shows_the_examples_with_their_line_breaks(tool):
    pairs = _continued_lines(tool)
    assert pairs, f"tools/{tool}.py has no multi-line example"
    proc = run_tool(tool, "--help")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for first, second in pairs:
        assert first in lines, f"{first!r} not a line of:\n{proc.stdout}"
        assert lines[lines.index(first) + 1] == second


def test_no_diff_attention_help_does_not_claim_a_default_of_true():
    from diffmeg.training.arguments import build_parser

    text = re.sub(r"\s+", " ", build_parser().format_help())
    entry = re.search(r"--diff-attention, --no-diff-attention (.*?)(?= --diff-version)", text)
    assert entry, text
    assert "default:" not in entry[1] and "Transformer baseline" in entry[1], entry[1]
