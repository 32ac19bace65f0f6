r"""The paper's long-context evaluation: cumulative average NLL by token position, DIFF vs Transformer.

    python tools/eval_long_context.py --load ckpt/diff3b_64k --load ckpt/transformer3b_64k \
        --data-prefix data/books_text_document --num-docs 100 --csv-every 64 --dtype bfloat16 \
        --output-dir results/long_context

For each document of at least --min-doc-length tokens (default: the evaluated length + 1, so every
document fills every position), the first --max-length + 1 tokens (default: the checkpoints' training
length) give one prediction per position; position p is token p + 1 predicted from tokens 0..p. The
NLL is averaged over documents per position and reported as the cumulative average over positions
0..p. With --prefix-eod, an end-of-document token goes before each document, as lm-eval scores a
document (loglikelihood_rolling): position p is then document token p given the EOD and tokens 0..p-1,
and documents need --max-length tokens. Writes long_context_nll.csv (position, one column per
checkpoint), long_context_nll.png (log x axis) and summary.json into --output-dir. See
docs/evaluation.md.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from diffmeg import cli  # noqa: E402
from diffmeg.errors import cli_errors  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.parser(__doc__, output_dir="long_context_eval", tokenizer=True)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data-prefix", help="indexed dataset prefix ({prefix}.bin/.idx, one document each)")
    src.add_argument("--text-files", nargs="+", help="text files or globs, each file one document (cl100k)")
    p.add_argument(
        "--max-length",
        type=int,
        default=None,
        help="positions evaluated (default: the shortest training "
        "seq_length of the checkpoints; longer measures extrapolation)",
    )
    p.add_argument(
        "--min-doc-length",
        type=int,
        default=None,
        help="skip documents shorter than this (default: max-length + 1, so every document fills every "
        "position; smaller lets shorter documents count at the positions they reach)",
    )
    p.add_argument("--num-docs", type=int, default=100, help="documents evaluated (a seeded sample if more)")
    p.add_argument("--batch-size", type=int, default=1, help="documents per forward pass")
    p.add_argument(
        "--loss-chunk-size",
        type=int,
        default=4096,
        help="positions per output-projection chunk (bounds logits memory to chunk x batch x vocab floats)",
    )
    p.add_argument(
        "--csv-every", type=int, default=1, help="CSV keeps position 0, every N-th and the last (plot: all)"
    )
    p.add_argument(
        "--prefix-eod",
        action="store_true",
        help="score as lm-eval does: an end-of-document token before each document, so position p is "
        "document token p (the first one included) given the EOD and the tokens before it",
    )
    return cli.parse(p, argv)


@cli_errors(interrupted="nothing was written (outputs are written at the end)")
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from diffmeg.eval.long_context import (
        CSV_NAME,
        PLOT_NAME,
        SUMMARY_NAME,
        LongContextConfig,
        run_long_context_eval,
    )

    summary = run_long_context_eval(cli.config(LongContextConfig, args))
    for ckpt in summary["checkpoints"]:
        print(
            f"{ckpt['label']}: {ckpt['docs_used']} docs, {ckpt['tokens_evaluated']} tokens, "
            f"cumulative NLL at position {summary['positions'] - 1}: {ckpt['final_cumulative_nll']:.4f}"
        )
    written = [CSV_NAME, SUMMARY_NAME] + ([] if args.no_plot else [PLOT_NAME])
    print(f"wrote {', '.join(os.path.join(args.output_dir, n) for n in written)}")


if __name__ == "__main__":
    main()
