r"""Attention to the answer vs attention noise on needle prompts, per layer and head (the DIFF paper's
table), for one or several checkpoints side by side.

    python tools/attention_scores.py --load ckpt/diff --load ckpt/transformer \
        --text-files 'books/*.txt' --length 4096 --samples 8 --output-dir results/attention

The attention map is read from the explicit (reference) attention path: for DIFF the differential
map A1 - lambda A2 as is (rows sum to 1 - lambda), for the Transformer its softmax. The query is the
last prompt token; "answer" is the mass on the queried number's tokens, "noise" the mass on every other
context token. Mock-data checkpoints get random-id filler; cl100k ones need --text-files. Writes
attention_scores.csv (label, architecture, depth, layer, head, answer_mass, noise_mass),
attention_scores.json and attention_scores.png into --output-dir. See docs/analysis.md.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from diffmeg import cli  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.parser(__doc__, output_dir="attention_scores", tokenizer=True)
    p.add_argument(
        "--length", type=int, default=None, help="prompt tokens (default: shortest training length)"
    )
    p.add_argument("--num-needles", type=int, default=1, help="needles in the context (N)")
    p.add_argument("--num-queries", type=int, default=1, help="needles asked for (R)")
    cli.add_needle_arguments(p, samples=4, samples_help="prompts per depth")
    return cli.parse(p, argv)


def measure(args: argparse.Namespace) -> dict:
    from diffmeg.eval.attention_scores import AttentionScoresConfig, run_attention_scores

    return run_attention_scores(cli.config(AttentionScoresConfig, args))


def report(summary: dict, args: argparse.Namespace) -> None:
    cli.print_table(
        [
            {"checkpoint": c["label"], "answer": c["answer_mass"], "noise": c["noise_mass"]}
            for c in summary["checkpoints"]
        ]
    )


main = cli.measurement_main(parse_args, measure, report)


if __name__ == "__main__":
    main()
