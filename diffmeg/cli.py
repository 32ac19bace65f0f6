"""The command-line side the tools share, so a tool in tools/ holds its measurement (or its writing) only.

    parser = cli.parser(__doc__, output_dir="attention_scores", tokenizer=True)
    parser.add_argument("--samples", type=int, default=4)          # the tool's own flags
    args = cli.parse(parser, argv)
    summary = run_attention_scores(cli.config(AttentionScoresConfig, args))
    cli.print_table([{"checkpoint": c["label"], "answer": c["answer_mass"]} for c in ...])

The shared flags: --load (checkpoint directories or Hugging Face folders, several side by side),
--label, --iteration, --seed, --dtype, --output-dir, --no-plot and, for tools that read text,
--tokenizer-file. `config` fills a tool's config dataclass (a `diffmeg.eval.common.EvalConfig`) from
the parsed flags by name, so a flag and its field cannot drift apart silently. `measurement_main`,
`dataset_main` and `tool_main` make a tool's `main(argv)`: flags first, then the work, with
`diffmeg.errors.cli_errors` around it. Importing this module is cheap (no torch, no megatron-core):
`--help` and bad flags answer at once, and a tool imports torch and megatron-core in its work function.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import warnings
from collections.abc import Callable, Sequence

from diffmeg.errors import cli_errors

DTYPE_CHOICES = ["float32", "bfloat16", "float16"]
INTERRUPTED_WHOLE_FILES = "no partial output was left (each file is written whole or none); run it again"
"""What Ctrl-C leaves of a tool whose outputs are written under temporary names and renamed whole."""


def parser(
    doc: str | None,
    *,
    output_dir: str,
    iteration: bool = True,
    plot: bool = True,
    tokenizer: bool = False,
) -> argparse.ArgumentParser:
    """An ArgumentParser holding the shared flags; the tool adds its own."""
    p = tool_parser(doc)
    p.add_argument(
        "--load",
        action="extend",
        nargs="+",
        required=True,
        help="checkpoint directories (pretrain_diff.py --save) or Hugging Face DiffLlama / Llama folders; "
        "several values or repeated, compared side by side",
    )
    p.add_argument(
        "--label",
        action="extend",
        nargs="+",
        help="one label per --load, in order (default: 'DIFF (dirname)' or 'Transformer (dirname)')",
    )
    if iteration:
        p.add_argument(
            "--iteration",
            type=int,
            nargs="+",
            help="checkpoint iteration (checkpoint directories only): one for all, or one per --load "
            "(default: each checkpoint's latest)",
        )
    if tokenizer:
        p.add_argument("--tokenizer-file", help="cl100k_base BPE file (default: tiktoken's cache)")
    p.add_argument("--seed", type=int, default=1234, help="seed of the sampled inputs and of the model RNG")
    p.add_argument("--dtype", default="float32", choices=DTYPE_CHOICES)
    p.add_argument("--output-dir", default=output_dir, help=f"where the outputs go (default: {output_dir})")
    if plot:
        p.add_argument("--no-plot", action="store_true", help="skip the PNG (no matplotlib needed)")
    return p


def tool_parser(doc: str | None) -> argparse.ArgumentParser:
    """An ArgumentParser whose --help shows the tool's docstring as written (examples keep line breaks)."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def dataset_parser(doc: str | None, input_help: str, output_help: str) -> argparse.ArgumentParser:
    """`tool_parser` with the flags of the tools that turn datasets into datasets: --input (several,
    required) and --output-prefix (required)."""
    p = tool_parser(doc)
    p.add_argument("--input", nargs="+", required=True, help=input_help)
    p.add_argument("--output-prefix", required=True, help=output_help)
    return p


def add_needle_arguments(p: argparse.ArgumentParser, *, samples: int, samples_help: str) -> None:
    """--depths, --samples, --text-files: the flags of the tools that read needle prompts
    (`diffmeg.eval.needle_eval.NeedlePromptsConfig`)."""
    p.add_argument(
        "--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0], help="queried needle's depth"
    )
    p.add_argument("--samples", type=int, default=samples, help=samples_help)
    p.add_argument("--text-files", nargs="+", help="filler text (cl100k checkpoints)")


def parse(p: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the flags, then prepare the process for megatron-core (before the tool imports it)."""
    args = p.parse_args(argv)
    # megatron-core compiles its fusions with TorchDynamo at import; an evaluation never needs them.
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    quiet_third_party_warnings()
    return args


def quiet_third_party_warnings() -> None:
    """Drop the deprecation noise megatron-core and torch print on every start and checkpoint load, at
    each entry point (pretrain_diff.py, the tools), not only in the test suite: none of it is the
    user's to act on."""
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's ShardedTensor deprecations on load
    warnings.filterwarnings("ignore", message="full scope is deprecated")  # megatron-core config default
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")


def tool_main(
    parse_args: Callable[[Sequence[str] | None], argparse.Namespace],
    work: Callable[[argparse.Namespace], object],
    *,
    interrupted: str | None = None,
) -> Callable[[Sequence[str] | None], None]:
    """A tool's `main(argv)`: `work(parse_args(argv))` under `cli_errors` (a DiffmegError is one line on
    stderr and exit 2; with `interrupted`, Ctrl-C is `error: interrupted; <interrupted>` and exit 130)."""

    @cli_errors(interrupted=interrupted)
    def main(argv: Sequence[str] | None = None) -> None:
        work(parse_args(argv))

    return main


def measurement_main(
    parse_args: Callable[[Sequence[str] | None], argparse.Namespace],
    measure: Callable[[argparse.Namespace], dict],
    report: Callable[[dict, argparse.Namespace], None],
) -> Callable[[Sequence[str] | None], None]:
    """The `main(argv)` of an evaluation tool: `measure(args)` (it writes the outputs and returns their
    summary), `report(summary, args)` on stdout, then `wrote <--output-dir>`. Each output is written
    under a temporary name and renamed whole (`diffmeg.eval.common.write_json`, ...), so Ctrl-C leaves
    no partial file: one line and exit 130."""

    def work(args: argparse.Namespace) -> None:
        report(measure(args), args)
        print(f"wrote {args.output_dir}")

    return tool_main(parse_args, work, interrupted=INTERRUPTED_WHOLE_FILES)


def dataset_main(
    parse_args: Callable[[Sequence[str] | None], argparse.Namespace],
    write: Callable[[argparse.Namespace], None],
) -> Callable[[Sequence[str] | None], None]:
    """The `main(argv)` of a tool that writes datasets under temporary names: SIGTERM (Slurm's time
    limit, kill) and Ctrl-C end it through the writers' cleanup, so nothing incomplete is left."""

    def work(args: argparse.Namespace) -> None:
        from diffmeg.data.preprocess import exit_cleanly_on_sigterm

        exit_cleanly_on_sigterm()
        write(args)

    return tool_main(parse_args, work, interrupted="incomplete outputs were removed")


def config(cls: type, args: argparse.Namespace, **fields):
    """`cls` (a dataclass) from the parsed flags: each field from the flag of the same name; `checkpoints`
    from --load/--label/--iteration and `plot` from --no-plot; `fields` override. A flag no field takes is
    a programming error (TypeError), so a renamed field cannot leave its flag silently unused."""
    flags = dict(vars(args))
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    shared = {}
    if "load" in flags:
        from diffmeg.eval.common import CheckpointSet

        shared["checkpoints"] = CheckpointSet(
            flags.pop("load"), flags.pop("label"), flags.pop("iteration", None)
        )
    if "no_plot" in flags:
        shared["plot"] = not flags.pop("no_plot")
    unused = set(flags) - names - set(fields)
    if unused:
        raise TypeError(f"{cls.__name__} has no field for the flag(s) {sorted(unused)}")
    values = {k: v for k, v in (shared | flags).items() if k in names}
    return cls(**(values | fields))


def print_table(rows: Sequence[dict], digits: int = 4) -> None:
    """Rows of equal keys as an aligned table on stdout: text left-aligned, numbers right-aligned,
    floats with `digits` decimals."""
    if not rows:
        return

    def text(v) -> str:
        return f"{v:.{digits}f}" if isinstance(v, float) else str(v)

    columns = list(rows[0])
    cells = [[text(r[c]) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    numeric = [all(isinstance(r[c], int | float) for r in rows) for c in columns]

    def line(values: Sequence[str]) -> str:
        return " ".join(
            v.rjust(w) if right else v.ljust(w) for v, w, right in zip(values, widths, numeric, strict=True)
        ).rstrip()

    print(line(columns))
    for row in cells:
        print(line(row))
