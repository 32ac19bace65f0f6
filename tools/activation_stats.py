r"""Activation outliers (the DIFF paper's table): top-1/2/3/10/100 and median magnitudes of attention
logits and hidden states over a token budget, for one or several checkpoints side by side.

    python tools/activation_stats.py --load ckpt/diff --load ckpt/transformer \
        --data-prefix data/val_text_document --tokens 409600 --output-dir results/activations

Attention logits are the scaled pre-softmax q.k/sqrt(d) at causally visible entries (DIFF: both maps
together, and each map as attention_logits_1/_2); hidden states are every decoder layer's output.
Streams: a running exact top-100 and a log-binned histogram per kind (the median is an estimate
within 2.9% relative error, see docs/analysis.md). Mock-data checkpoints may omit --data-prefix
(seeded random ids). Writes activation_stats.csv, activation_stats.json and activation_stats.png.
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
        "--data-prefix", default=None, help="indexed dataset (default for mock checkpoints: random ids)"
    )
    p.add_argument("--tokens", type=int, default=409_600, help="token budget (the paper: 0.4M)")
    p.add_argument(
        "--seq-length", type=int, default=None, help="window length (default: shortest training length)"
    )
    p.add_argument("--seed", type=int, default=1234)
    add_output_arguments(p, "activation_stats")
    return p.parse_args(argv)


@cli_errors
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from diffmeg.eval.activation_stats import RANKS, ActivationStatsConfig, run_activation_stats
    from diffmeg.eval.common import common_config_fields

    summary = run_activation_stats(
        ActivationStatsConfig(
            **common_config_fields(args),
            tokens=args.tokens,
            seq_length=args.seq_length,
            data_prefix=args.data_prefix,
        )
    )
    cols = [f"top{r}" for r in RANKS] + ["median"]
    print(f"{'checkpoint':32s} {'kind':20s} " + " ".join(f"{c:>9s}" for c in cols))
    for c in summary["checkpoints"]:
        for kind, s in c["stats"].items():
            print(f"{c['label']:32s} {kind:20s} " + " ".join(f"{s[k]:9.3f}" for k in cols))
    print(f"wrote {args.output_dir}")


if __name__ == "__main__":
    main()
