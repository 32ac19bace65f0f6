"""`--config FILE`: a run's flags from a TOML, YAML or JSON file, so a recipe is a file plus a few flags.

A key is a flag's name, with dashes or underscores (`train-iters`, `train_iters`; `no-diff-attention` too),
given flat or inside a section named after the flag's argument group (`[training]`, or the group's whole
`--help` title). A value has the flag's type: a boolean for an on/off flag, an integer, a number, a string,
a list (or a string of words) for a flag of several values (`data-path = [0.7, "web", 0.3, "code"]`); a
null value leaves the flag unset. Flags typed on the command line beat the file's.

A run's saved arguments.json (and a checkpoint's args.json) is itself a valid config: its keys are the
flags' dests plus what the run derived and recorded (`RECORDED`, re-derived rather than read), and its
`explicit_flags` say which of its values were typed; the others were resolved (a preset's, a default, a
derived size) and sit where a preset's values sit, so a flag given again re-derives what follows from it
(`--train-tokens` the iteration count), while everything else stays as that run had it.

Every problem is one line naming the file and the key: an unknown key with the nearest flag (difflib), a
value of the wrong type with the type expected, a value outside the flag's choices.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import tomllib
from dataclasses import dataclass, field

from diffmeg.errors import DiffmegError

RECORDED = frozenset(
    (
        "explicit_flags",
        "dropped_flags",
        "run_warnings",
        "data_parallel_size",
        "virtual_pipeline_model_parallel_size",
        "tokenizer_fingerprint",
    )
)
"""What a run's resolved arguments hold beyond its flags (`resolve_args` derives them): read back from an
arguments.json they are skipped, and derived again (a test keeps this list equal to what it adds)."""

FORMATS = {".toml": "TOML", ".yaml": "YAML", ".yml": "YAML", ".json": "JSON"}


@dataclass
class ConfigFile:
    """A config file's flag values under their dests, and which of them count as typed."""

    values: dict[str, object] = field(default_factory=dict)
    typed: frozenset[str] = frozenset()
    """Every key of a hand-written file; of a run's saved arguments, its `explicit_flags`."""

    @property
    def typed_values(self) -> dict[str, object]:
        return {k: v for k, v in self.values.items() if k in self.typed}

    @property
    def recorded_values(self) -> dict[str, object]:
        return {k: v for k, v in self.values.items() if k not in self.typed}


def section_names(title: str) -> tuple[str, ...]:
    """The names a config's section may give an argument group: its title and the title's first word
    (`logging` for "logging and evaluation")."""
    short = re.split(r"[\s(]", title, maxsplit=1)[0]
    return (title,) if short == title else (title, short)


class _Flags:
    """The parser's flags by every spelling a key may use, and its groups by their section names."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.by_name: dict[str, argparse.Action] = {}
        self.negated: set[str] = set()  # `no-x` of a --x/--no-x flag
        for action in parser._actions:
            if not action.option_strings or action.dest in ("help", "config"):
                continue
            for option in action.option_strings:
                name = option.lstrip("-")
                self.by_name[name] = action
                if isinstance(action, argparse.BooleanOptionalAction) and name.startswith("no-"):
                    self.negated.add(name)
            self.by_name.setdefault(action.dest.replace("_", "-"), action)
        self.sections: dict[str, str] = {}
        self.group_of: dict[str, str] = {}
        for group in parser._action_groups:
            names = section_names(group.title or "")
            if not any(a.option_strings and a.dest not in ("help", "config") for a in group._group_actions):
                continue  # argparse's own "options" group: --help and --config
            for name in names:
                self.sections[name] = names[-1]
            for action in group._group_actions:
                self.group_of[action.dest] = names[-1]

    def nearest(self, name: str, sections: bool) -> str:
        """The flag (or section) nearest to a key that is neither, as the error line names it."""
        names = [f"--{n}" for n in self.by_name] + ([f"[{s}]" for s in self.sections] if sections else [])
        found = difflib.get_close_matches(f"--{name}", names, n=1, cutoff=0.0)
        return found[0] if found else "--help lists every flag"


def load_file(path: str) -> dict:
    """The file's top-level table, or one line saying why it has none."""
    kind = FORMATS.get(os.path.splitext(path)[1].lower())
    if kind is None:
        raise DiffmegError(f"--config {path}: give a .toml, .yaml (.yml) or .json file")
    if not os.path.isfile(path):
        raise DiffmegError(f"--config {path}: no such file")
    try:
        if kind == "TOML":
            with open(path, "rb") as f:
                data = tomllib.load(f)
        elif kind == "JSON":
            with open(path) as f:
                data = json.load(f)
        else:
            data = _load_yaml(path)
    except (ValueError, OSError) as exc:  # TOMLDecodeError and JSONDecodeError are ValueErrors
        raise DiffmegError(f"--config {path} is not valid {kind}: {_one_line(exc)}") from None
    if data is None:
        return {}  # an empty YAML file
    if not isinstance(data, dict):
        raise DiffmegError(
            f"--config {path}: the file must hold a table of flags, not a {type(data).__name__}"
        )
    return data


def _load_yaml(path: str) -> object:
    try:
        import yaml
    except ImportError:
        raise DiffmegError(
            f"--config {path} is YAML and PyYAML is not installed: pip install pyyaml (or the diffmeg[yaml] "
            "extra), or write the file as TOML"
        ) from None
    with open(path) as f:
        try:
            return yaml.safe_load(f)
        except yaml.YAMLError as exc:
            raise ValueError(_one_line(exc)) from None


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


def read_config(path: str, parser: argparse.ArgumentParser) -> ConfigFile:
    """The flag values of a config file, checked against `parser`'s flags (names, types, choices)."""
    data = load_file(path)
    flags = _Flags(parser)
    values: dict[str, object] = {}
    spelled: dict[str, str] = {}  # dest -> the key that gave it (a flag given twice is refused)
    explicit_flags = data.get("explicit_flags")

    def take(key: object, value: object, section: str | None) -> None:
        name = str(key).strip().lstrip("-").replace("_", "-")
        where = f"[{section}] " if section else ""
        if name.replace("-", "_") in RECORDED and section is None:
            return  # derived by the run that wrote it, derived again by this one
        if name == "config":
            raise DiffmegError(f"--config {path}: key 'config': a config file cannot name another one")
        action = flags.by_name.get(name)
        if action is None:
            is_section = section is None and isinstance(value, dict)
            raise DiffmegError(
                f"--config {path}: unknown key {where}{key!r}; the nearest flag is "
                f"{flags.nearest(name, sections=is_section)}"
            )
        if section is not None and flags.group_of.get(action.dest) != section:
            raise DiffmegError(
                f"--config {path}: key {key!r} is a flag of [{flags.group_of.get(action.dest)}], not of "
                f"[{section}]; move it there or to the top level"
            )
        if action.dest in spelled:
            raise DiffmegError(f"--config {path}: {key!r} and {spelled[action.dest]!r} set the same flag")
        spelled[action.dest] = str(key)
        if value is None:
            return  # null: unset, as if the key were absent
        values[action.dest] = _convert(path, f"{where}{key!r}", action, value, negated=name in flags.negated)

    for key, value in data.items():
        section = flags.sections.get(str(key)) if isinstance(value, dict) else None
        if section is None:
            take(key, value, None)
            continue
        for inner, inner_value in value.items():
            take(inner, inner_value, section)
    if isinstance(explicit_flags, list):  # a run's saved arguments: only what that run was typed counts
        typed = frozenset(k for k in explicit_flags if isinstance(k, str))
    else:
        typed = frozenset(values)
    return ConfigFile(values=values, typed=typed)


def _convert(path: str, key: str, action: argparse.Action, value: object, negated: bool) -> object:
    """A key's value as the flag's own type, or one line naming the key and the type it needs."""
    option = action.option_strings[-1 if negated else 0]

    def refuse(expected: str) -> DiffmegError:
        return DiffmegError(
            f"--config {path}: key {key} ({option}) must be {expected}, got {value!r} ({_kind(value)})"
        )

    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        if not isinstance(value, bool):
            raise refuse("a boolean (true or false)")
        return value if isinstance(action, argparse._StoreTrueAction) else not value
    if isinstance(action, argparse.BooleanOptionalAction):
        if not isinstance(value, bool):
            raise refuse("a boolean (true or false)")
        return not value if negated else value
    if action.nargs in ("*", "+") or isinstance(action.nargs, int):
        items = value.split() if isinstance(value, str) else value
        if not isinstance(items, list):
            raise refuse("a list (or a string of words separated by spaces)")
        return [_scalar(path, key, action, v, refuse) for v in items]
    return _scalar(path, key, action, value, refuse)


def _scalar(path: str, key: str, action: argparse.Action, value: object, refuse) -> object:
    kind = action.type
    expected = {int: "an integer", float: "a number"}.get(kind, "a string")
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise refuse(expected)
    if kind is int and isinstance(value, float):
        raise refuse(expected)
    if kind in (int, float):
        try:
            converted = kind(value)  # a string as the command line would give it (YAML reads 1e-4 as one)
        except ValueError:
            raise refuse(expected) from None
    else:
        converted = value if isinstance(value, str) else str(value)
    if action.choices is not None and converted not in action.choices:
        choices = ", ".join(str(c) for c in action.choices)
        raise DiffmegError(f"--config {path}: key {key} must be one of {choices}, got {value!r}")
    return converted


def _kind(value: object) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list"}.get(
        type(value), "a table" if isinstance(value, dict) else type(value).__name__
    )
