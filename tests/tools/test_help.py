"""`--help` as users read it: the tools' examples keep their line continuations, flags do not
contradict their defaults."""

from __future__ import annotations

import argparse
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


def _undocumented(parser) -> list[str]:
    found = []
    for action in parser._actions:
        if action.option_strings and not action.help and "--help" not in action.option_strings:
            found.append("/".join(action.option_strings))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += _undocumented(sub)
    return found


def test_every_flag_has_help_text():
    """Issue 31: `--lr`, `--save`, `--eval-interval` and 50 more had no help; a new flag without any fails."""
    from diffmeg.training.arguments import build_parser
    from tests.conversion.helpers import tool_main

    assert _undocumented(build_parser()) == []
    convert = tool_main("convert_checkpoint").__wrapped__.__globals__["build_parser"]()
    assert _undocumented(convert) == []
    (commands,) = [a for a in convert._actions if isinstance(a, argparse._SubParsersAction)]
    for name in ("upcycle", "hf-to-mcore"):  # the pass-through is part of their help
        assert "-- PRETRAIN_DIFF_FLAGS" in commands.choices[name].format_help()
    help_text = re.sub(r"\s+", " ", build_parser().format_help())
    assert "--lr LR peak learning rate" in help_text and "(default: None)" not in help_text
