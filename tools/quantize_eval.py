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
import warnings

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # megatron-core compiles fusions at import; not needed here
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", message="full scope is deprecated")

from diffmeg.errors import cli_errors  # noqa: E402
from diffmeg.eval.common import add_checkpoint_arguments, add_output_arguments  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_arguments(p)
    p.add_argument("--bits", type=int, nargs="+", default=[16, 8, 6, 4], help="16 = not quantized")
    p.add_argument("--choices", default=None, help="multiple-choice JSONL (see above)")
    p.add_argument("--data-prefix", default=None, help="validation indexed dataset")
    p.add_argument("--tokens", type=int, default=65_536, help="validation token budget")
    p.add_argument(
        "--seq-length", type=int, default=None, help="validation window (default: training length)"
    )
    p.add_argument("--tokenizer-file", default=None, help="cl100k_base BPE file for text --choices")
    p.add_argument("--seed", type=int, default=1234)
    add_output_arguments(p, "quantize_eval")
    return p.parse_args(argv)


@cli_errors
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from diffmeg.eval.common import common_config_fields
    from diffmeg.eval.quantize import QuantizeEvalConfig, run_quantize_eval

    summary = run_quantize_eval(
        QuantizeEvalConfig(
            **common_config_fields(args),
            bits=args.bits,
            choices=args.choices,
            data_prefix=args.data_prefix,
            tokens=args.tokens,
            seq_length=args.seq_length,
            tokenizer_file=args.tokenizer_file,
        )
    )
    print(f"{'checkpoint':32s} {'bits':>4s} {'val_loss':>9s} {'acc':>7s} {'acc_norm':>8s}")
    for c in summary["checkpoints"]:
        for bits, r in c["bits"].items():
            print(f"{c['label']:32s} {bits:>4s} {r['val_loss']:9.4f} {r['acc']:7.4f} {r['acc_norm']:8.4f}")
    print(f"wrote {args.output_dir}")


if __name__ == "__main__":
    main()
