"""The command-line side every evaluation tool shares, so a tool in tools/ holds its measurement only.

    parser = cli.parser(__doc__, output_dir="attention_scores", tokenizer=True)
    parser.add_argument("--samples", type=int, default=4)          # the tool's own flags
    args = cli.parse(parser, argv)
    summary = run_attention_scores(cli.config(AttentionScoresConfig, args))
    cli.print_table([{"checkpoint": c["label"], "answer": c["answer_mass"]} for c in ...])

The shared flags: --load (checkpoint directories or Hugging Face folders, several side by side),
--label, --iteration, --seed, --dtype, --output-dir, --no-plot and, for tools that read text,
--tokenizer-file. `config` fills a tool's config dataclass (a `diffmeg.eval.common.EvalConfig`) from
the parsed flags by name, so a flag and its field cannot drift apart silently. Importing this module
is cheap (no torch, no megatron-core): `--help` and bad flags answer at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import warnings
from collections.abc import Sequence

DTYPE_CHOICES = ["float32", "bfloat16", "float16"]


def parser(
    doc: str | None,
    *,
    output_dir: str,
    iteration: bool = True,
    plot: bool = True,
    tokenizer: bool = False,
) -> argparse.ArgumentParser:
    """An ArgumentParser holding the shared flags; the tool adds its own."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
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
        default=None,
        help="one label per --load, in order (default: 'DIFF (dirname)' or 'Transformer (dirname)')",
    )
    if iteration:
        p.add_argument(
            "--iteration",
            type=int,
            nargs="+",
            default=None,
            help="checkpoint iteration (checkpoint directories only): one for all, or one per --load "
            "(default: each checkpoint's latest)",
        )
    if tokenizer:
        p.add_argument(
            "--tokenizer-file", default=None, help="cl100k_base BPE file (default: tiktoken's cache)"
        )
    p.add_argument("--seed", type=int, default=1234, help="seed of the sampled inputs and of the model RNG")
    p.add_argument("--dtype", default="float32", choices=DTYPE_CHOICES)
    p.add_argument("--output-dir", default=output_dir, help=f"where the outputs go (default: {output_dir})")
    if plot:
        p.add_argument("--no-plot", action="store_true", help="skip the PNG (no matplotlib needed)")
    return p


def add_needle_arguments(p: argparse.ArgumentParser, *, samples: int, samples_help: str) -> None:
    """--depths, --samples, --text-files: the flags of the tools that read needle prompts
    (`diffmeg.eval.needle_eval.NeedlePromptsConfig`)."""
    p.add_argument(
        "--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0], help="queried needle's depth"
    )
    p.add_argument("--samples", type=int, default=samples, help=samples_help)
    p.add_argument("--text-files", nargs="+", default=None, help="filler text (cl100k checkpoints)")


def parse(p: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the flags, then prepare the process for megatron-core (before the tool imports it)."""
    args = p.parse_args(argv)
    # megatron-core compiles its fusions with TorchDynamo at import; an evaluation never needs them.
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's ShardedTensor deprecations on load
    warnings.filterwarnings("ignore", message="full scope is deprecated")  # megatron-core config default
    return args


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
