"""What `pretrain_diff.py`'s parser was before its flags were declared once (issue 45): a committed snapshot.

Every option of `build_parser()` with its dest, default, choices, nargs, type, help text, metavar and argument
group, the `--help` text itself at a fixed width, every numeric flag's range (`RANGES`) and the defaults
under the presets (`DEFAULTS`); tests/fixtures/parser_snapshot.json holds what the
parser built with `add_argument` calls measured, written by

    python3 -m tests.training.parser_snapshot --write

and tests/training/test_parser_snapshot.py holds today's parser to it: a flag whose spelling, default,
choices or help moves fails there, so every existing command line and `--help` behave as before.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

FIXTURE = Path(__file__).parents[1] / "fixtures" / "parser_snapshot.json"
HELP_COLUMNS = "110"
"""The terminal width `--help` is rendered at (argparse reads $COLUMNS)."""


def _plain(value: object) -> object:
    """A default or choice as JSON holds it (types by name, anything else by repr)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return repr(value)


def snapshot() -> dict:
    """The parser's options, in declaration order, and its `--help` text."""
    from diffmeg.training.arguments import build_parser

    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_COLUMNS
    try:
        parser = build_parser()
        text = parser.format_help()
    finally:
        if old is None:
            os.environ.pop("COLUMNS")
        else:
            os.environ["COLUMNS"] = old
    groups = {id(a): g.title for g in parser._action_groups for a in g._group_actions}
    options = []
    for action in parser._actions:
        options.append(
            {
                "option_strings": list(action.option_strings),
                "dest": action.dest,
                "action": type(action).__name__,
                "default": _plain(action.default),
                "const": _plain(action.const),
                "choices": _plain(action.choices),
                "nargs": _plain(action.nargs),
                "type": None if action.type is None else getattr(action.type, "__name__", repr(action.type)),
                "metavar": _plain(action.metavar),
                "required": action.required,
                "help": action.help,
                "group": groups.get(id(action)),
            }
        )
    from diffmeg.training.arguments import DEFAULTS, RANGES

    return {
        "prog": parser.prog,
        "options": options,
        "help_text": text.splitlines(),
        "ranges": {name: list(rule) for name, rule in sorted(RANGES.items())},
        "defaults": {name: _plain(value) for name, value in sorted(DEFAULTS.items())},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {FIXTURE}")
    args = parser.parse_args()
    text = json.dumps(snapshot(), indent=1) + "\n"
    if args.write:
        FIXTURE.write_text(text)
        print(f"wrote {FIXTURE}")
    else:
        print(text, end="")


if __name__ == "__main__":
    main()
