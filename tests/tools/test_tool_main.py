"""The `main(argv)` every tool gets from diffmeg.cli: flags first, then the work; a DiffmegError is
one line and exit 2, Ctrl-C one line and exit 130 where the tool says what an interruption leaves."""

from __future__ import annotations

import argparse

import pytest

from diffmeg import cli
from diffmeg.errors import DiffmegError, cli_errors


def _parse(argv):
    p = cli.dataset_parser("doc", "inputs", "outputs")
    p.add_argument("--raise", dest="exc", choices=["error", "interrupt"], default=None)
    return cli.parse(p, argv)


def _work(args: argparse.Namespace) -> None:
    if args.exc == "error":
        raise DiffmegError("bad input; pass --good")
    if args.exc == "interrupt":
        raise KeyboardInterrupt


def test_main_parses_then_works():
    seen = []
    main = cli.tool_main(_parse, seen.append)
    main(["--input", "a", "b", "--output-prefix", "o"])
    assert [(a.input, a.output_prefix) for a in seen] == [(["a", "b"], "o")]


@pytest.mark.parametrize("interrupted", [None, "incomplete outputs were removed"])
def test_errors_are_one_line_and_ctrl_c_only_where_the_tool_says_what_it_leaves(interrupted, capsys):
    main = cli.tool_main(_parse, _work, interrupted=interrupted)
    with pytest.raises(SystemExit) as exit_info:
        main(["--input", "a", "--output-prefix", "o", "--raise", "error"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "error: bad input; pass --good\n"
    if interrupted is None:
        with pytest.raises(KeyboardInterrupt):
            main(["--input", "a", "--output-prefix", "o", "--raise", "interrupt"])
        return
    with pytest.raises(SystemExit) as exit_info:
        main(["--input", "a", "--output-prefix", "o", "--raise", "interrupt"])
    assert exit_info.value.code == 130
    assert capsys.readouterr().err == f"error: interrupted; {interrupted}\n"


def test_cli_errors_keeps_the_wrapped_function():
    @cli_errors(interrupted="nothing was written")
    def main(argv=None):
        """Doc."""
        return argv

    assert main(["x"]) == ["x"] and main.__name__ == "main" and main.__doc__ == "Doc."


def test_measurement_main_reports_then_names_the_output_dir(capsys):
    p = cli.parser(None, output_dir="out_dir")
    main = cli.measurement_main(
        lambda argv: cli.parse(p, argv),
        lambda args: {"loads": args.load},
        lambda summary, args: cli.print_table([{"checkpoint": c} for c in summary["loads"]]),
    )
    main(["--load", "a", "b"])
    assert capsys.readouterr().out.splitlines() == ["checkpoint", "a", "b", "wrote out_dir"]


def test_ctrl_c_in_a_measurement_leaves_no_partial_file(tmp_path, capsys):
    """An evaluation tool stopped while it writes an output: one line, exit 130, the file's earlier
    version kept and no temporary left (each output is written whole or not at all)."""
    from diffmeg.eval.common import write_rows

    out = tmp_path / "rows.csv"
    out.write_text("earlier\n")

    class Row(dict):
        def keys(self):  # csv reads each row's keys: Ctrl-C arrives mid-write
            raise KeyboardInterrupt

    def measure(args: argparse.Namespace) -> dict:
        write_rows(str(out), [{"a": 1}, Row(a=2)])
        return {}

    p = cli.parser(None, output_dir=str(tmp_path))
    main = cli.measurement_main(lambda argv: cli.parse(p, argv), measure, lambda summary, args: None)
    with pytest.raises(SystemExit) as exit_info:
        main(["--load", "a"])
    assert exit_info.value.code == 130
    assert capsys.readouterr().err == f"error: interrupted; {cli.INTERRUPTED_WHOLE_FILES}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.csv"] and out.read_text() == "earlier\n"


def test_dataset_parser_help_keeps_the_docstring_and_requires_input_and_output():
    p = cli.dataset_parser("usage:\n    line one \\\n        line two", "the inputs", "the outputs")
    assert "    line one \\\n        line two" in p.format_help()
    assert "the inputs" in p.format_help() and "the outputs" in p.format_help()
    with pytest.raises(SystemExit):
        p.parse_args(["--input", "a"])
