"""The commands in README.md and docs/*.md run as written on a fresh clone (issue 31): every script they
name exists, every flag they pass is one its `--help` lists (a subcommand's own help for subcommands,
pretrain_diff.py's for what follows a bare `--`), and the output folders they name are created by the
tools, never expected to exist. Cheap: one `--help` per script, nothing trained."""

from __future__ import annotations

import functools
import re
import shlex
import subprocess
import sys

import pytest

from diffmeg.data.indexed import check_can_write
from diffmeg.storage import check_output
from tests.data.helpers import REPO_ROOT
from tests.tools.helpers import tool_env

DOCS = ["README.md", *sorted(str(p.relative_to(REPO_ROOT)) for p in (REPO_ROOT / "docs").glob("*.md"))]
SCRIPT = re.compile(r"^(pretrain_diff\.py|tools/\w+\.py)$")
LAUNCHERS = {"python", "python3", "...", "torchrun"}
"""What may stand before the script: an interpreter, torchrun (with its own flags), or the docs' `...`."""


def _commands() -> list[tuple[str, int, list[str]]]:
    """(doc, line, tokens from the script on) for each command of a shell code block."""
    found = []
    for doc in DOCS:
        lang, start, pending = None, 0, ""
        for number, line in enumerate((REPO_ROOT / doc).read_text().splitlines(), start=1):
            if line.startswith("```"):
                lang = None if lang is not None else line[3:].strip()
                continue
            if lang not in ("bash", "sh", "shell", ""):
                continue
            if not pending:
                start = number
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            text, pending = pending + line, ""
            for part in re.split(r"&&|\|\||;|\|", text):
                if not re.search(r"pretrain_diff\.py|tools/\w+\.py", part):
                    continue
                plain = part.replace("$(", "(").replace("<", "").replace(">", "")
                try:
                    tokens = [t.strip("[]") for t in shlex.split(plain, comments=True)]  # `[--flag v]`
                except ValueError:  # unbalanced quotes: prose in a listing (a command's quotes balance)
                    continue
                tokens = [t for t in tokens if "=" not in t or t.startswith("-")]  # VAR=value prefixes
                at = next((i for i, t in enumerate(tokens) if SCRIPT.match(t)), None)
                if at is not None and (at == 0 or tokens[0] in LAUNCHERS):
                    found.append((doc, start, tokens[at:]))
    return found


COMMANDS = _commands()


@functools.cache
def _help(script: str, subcommand: str | None) -> str:
    cmd = [sys.executable, script, *([subcommand] if subcommand else []), "--help"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=tool_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)}: {proc.stderr[-2000:]}"
    return proc.stdout


def _flags(help_text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", help_text))


def _subcommands(help_text: str) -> set[str]:
    usage = re.sub(r"\s+", " ", help_text.split("\n\n")[0])
    choices = re.search(r"\{([a-z][\w-]*(?:,[a-z][\w-]*)+)\} \.\.\.", usage)  # argparse's subparsers
    return set(choices.group(1).split(",")) if choices else set()


def _passed(tokens: list[str]) -> list[str]:
    """The flags of `tokens`, `--flag=value` as `--flag`."""
    return [t.split("=")[0] for t in tokens if t.startswith("--") and t != "--"]


def test_the_docs_name_commands():
    assert len(COMMANDS) >= 30 and {doc for doc, _, _ in COMMANDS} >= {"README.md", "docs/data.md"}


@pytest.mark.parametrize("doc, line, tokens", COMMANDS, ids=[f"{d}:{n}" for d, n, _ in COMMANDS])
def test_a_documented_command_names_a_script_and_flags_that_exist(doc, line, tokens):
    script, rest = tokens[0], tokens[1:]
    where = f"{doc}:{line}: {' '.join(tokens)}"
    assert (REPO_ROOT / script).is_file(), f"{where}: no {script}"
    subcommands = _subcommands(_help(script, None))
    subcommand = None
    if subcommands and rest and not rest[0].startswith("-"):
        subcommand, rest = rest[0], rest[1:]
        assert subcommand in subcommands, f"{where}: {script} has no subcommand {subcommand}"
    own, passed_on = (rest[: rest.index("--")], rest[rest.index("--") + 1 :]) if "--" in rest else (rest, [])
    unknown = set(_passed(own)) - _flags(_help(script, subcommand))
    unknown |= set(_passed(passed_on)) - _flags(_help("pretrain_diff.py", None))
    assert not unknown, f"{where}: flags its --help does not list: {sorted(unknown)}"


OUTPUTS = {"--output-prefix": "dataset", "--save": "folder", "--output-dir": "folder"}
OUTPUTS |= {"--metrics-file": "file", "--tensorboard-dir": "folder"}


def _outputs() -> list[tuple[str, str]]:
    """(flag, relative path) of every output a documented command names inside the clone."""
    found = set()
    for _, _, tokens in COMMANDS:
        for flag, value in zip(tokens, tokens[1:], strict=False):
            if flag in OUTPUTS and not value.startswith(("/", "-", "(", "$")) and value != "...":
                found.add((flag, value))
    return sorted(found)


def test_the_output_folders_the_docs_name_are_made_by_the_tools(tmp_path):
    """On a fresh clone `data/`, `hf/`, `ckpt/` ... do not exist: each output's check passes on a tree
    without them, and the dataset writers' check makes the folder (as pretrain and convert do)."""
    outputs = _outputs()
    assert ("--output-prefix", "data/llama") in outputs and any(f == "--save" for f, _ in outputs)
    for flag, value in outputs:
        path = tmp_path / value
        if OUTPUTS[flag] == "dataset":
            check_can_write([str(path)], overwrite=False)
            assert path.parent.is_dir(), f"{flag} {value}: its folder was not made"
        else:
            check_output(str(path), flag, folder=OUTPUTS[flag] == "folder")
