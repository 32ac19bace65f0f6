r"""Low-bit attention logits (the DIFF paper's quantization experiment): validation loss and zero-shot
multiple-choice accuracy per bit width, for one or several checkpoints side by side.

    python tools/quantize_eval.py --load ckpt/diff --load ckpt/transformer --bits 16 8 6 4 \
        --choices hellaswag_val.jsonl --data-prefix data/val_text_document --output-dir results/quant

The scaled pre-softmax logits (both maps for DIFF) are quantized inside attention with dynamic absmax
scaling per sequence and head; 16 bits = no quantization. --choices is JSONL, one item per line:
{"context": "...", "choices": ["...", ...], "label": i} (text, cl100k checkpoints) or
{"context_ids": [...], "choices_ids": [[...], ...], "label": i} (token ids, e.g. mock-vocabulary
checkpoints). Without --data-prefix, mock checkpoints are scored on seeded random ids. Writes
quantize_eval.csv, quantize_eval.json and quantize_eval.png. See docs/analysis.md.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from diffmeg import cli  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.parser(__doc__, output_dir="quantize_eval", tokenizer=True)
    p.add_argument("--bits", type=int, nargs="+", default=[16, 8, 6, 4], help="16 = not quantized")
    p.add_argument("--choices", default=None, help="multiple-choice JSONL (see above)")
    p.add_argument("--data-prefix", default=None, help="validation indexed dataset")
    p.add_argument("--tokens", type=int, default=65_536, help="validation token budget")
    p.add_argument(
        "--seq-length", type=int, default=None, help="validation window (default: training length)"
    )
    return cli.parse(p, argv)


def measure(args: argparse.Namespace) -> dict:
    from diffmeg.eval.quantize import QuantizeEvalConfig, run_quantize_eval

    return run_quantize_eval(cli.config(QuantizeEvalConfig, args))


def report(summary: dict, args: argparse.Namespace) -> None:
    cli.print_table(
        [
            {"checkpoint": c["label"], "bits": int(bits)} | r
            for c in summary["checkpoints"]
            for bits, r in c["bits"].items()
        ]
    )


main = cli.measurement_main(parse_args, measure, report)


if __name__ == "__main__":
    main()
