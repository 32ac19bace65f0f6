r"""Multi-needle retrieval (LWM / Gemini 1.5 protocol, as in the DIFF paper): accuracy per (context
length, needle depth) for N needles and R queried cities, one or several checkpoints side by side.

    # the paper's table (N = 1, 2, 4, 6; R = 1, 2 at 4K) and its N = 8 heatmap over lengths
    python tools/eval_needle.py --load ckpt/diff --load ckpt/transformer --text-files 'books/*.txt' \
        --lengths 4096 8192 16384 --needles 1 2 4 6 --queries 1 2 --heatmap-needles 8 --samples 10

N sentences "The special magic number for <city> is: <number>." sit in filler context; the first
queried needle at each --depths value (0 = start, 1 = end), the others at seeded random depths. A
number counts as retrieved when greedy decoding (by teacher forcing) reproduces all its tokens.
Mock-data checkpoints get the same structure in random ids; cl100k ones need --text-files for the
filler. Deterministic by --seed. Writes needle_accuracy.csv, needle_summary.json (the N x R table) and
needle_heatmap.png (accuracy over length x depth for --heatmap-needles, R = 1). See docs/analysis.md.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from diffmeg import cli  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.parser(__doc__, output_dir="needle_eval", tokenizer=True)
    p.add_argument(
        "--lengths", type=int, nargs="+", default=None, help="prompt lengths (default: training length)"
    )
    p.add_argument("--needles", type=int, nargs="+", default=[1, 2, 4, 6], help="N values")
    p.add_argument(
        "--queries", type=int, nargs="+", default=[1, 2], help="R values (pairs with R > N skipped)"
    )
    p.add_argument(
        "--heatmap-needles", type=int, default=None, help="N of the heatmap, R=1 (default: largest N)"
    )
    cli.add_needle_arguments(p, samples=10, samples_help="prompts per (N, R, length, depth)")
    return cli.parse(p, argv)


def measure(args: argparse.Namespace) -> dict:
    from diffmeg.eval.needle_eval import NeedleEvalConfig, run_needle_eval

    return run_needle_eval(cli.config(NeedleEvalConfig, args))


def report(summary: dict, args: argparse.Namespace) -> None:
    cli.print_table([{"checkpoint": c["label"]} | c["table"] for c in summary["checkpoints"]], digits=3)


main = cli.measurement_main(parse_args, measure, report)


if __name__ == "__main__":
    main()
