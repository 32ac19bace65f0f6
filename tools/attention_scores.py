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
    p.add_argument(
        "--length", type=int, default=None, help="prompt tokens (default: shortest training length)"
    )
    p.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    p.add_argument("--num-needles", type=int, default=1, help="needles in the context (N)")
    p.add_argument("--num-queries", type=int, default=1, help="needles asked for (R)")
    p.add_argument("--samples", type=int, default=4, help="prompts per depth")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--text-files", nargs="+", default=None, help="filler text (cl100k checkpoints)")
    p.add_argument("--tokenizer-file", default=None)
    add_output_arguments(p, "attention_scores")
    return p.parse_args(argv)


@cli_errors
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from diffmeg.eval.attention_scores import AttentionScoresConfig, run_attention_scores
    from diffmeg.eval.common import common_config_fields

    summary = run_attention_scores(
        AttentionScoresConfig(
            **common_config_fields(args),
            length=args.length,
            depths=args.depths,
            num_needles=args.num_needles,
            num_queries=args.num_queries,
            samples=args.samples,
            text_files=args.text_files,
            tokenizer_file=args.tokenizer_file,
        )
    )
    print(f"{'checkpoint':40s} {'answer':>10s} {'noise':>10s}")
    for c in summary["checkpoints"]:
        print(f"{c['label']:40s} {c['answer_mass']:10.4f} {c['noise_mass']:10.4f}")
    print(f"wrote {args.output_dir}")


if __name__ == "__main__":
    main()
