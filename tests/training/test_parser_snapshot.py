"""The parser against its committed snapshot (tests/training/parser_snapshot.py): every flag's spelling,
dest, default, choices, nargs, type, help and group, the `--help` text, the flags' ranges and the defaults
under the presets, as they were."""

from __future__ import annotations

import json

from tests.training.parser_snapshot import FIXTURE, snapshot


def test_the_parser_matches_its_snapshot():
    want = json.loads(FIXTURE.read_text())
    got = snapshot()
    assert got["prog"] == want["prog"]
    assert [o["option_strings"] for o in got["options"]] == [o["option_strings"] for o in want["options"]]
    for mine, theirs in zip(got["options"], want["options"], strict=True):
        assert mine == theirs, mine["option_strings"]
    assert got["help_text"] == want["help_text"]
    assert got["ranges"] == want["ranges"] and got["defaults"] == want["defaults"]
