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
        "--lengths", type=int, nargs="+", default=None, help="prompt lengths (default: training length)"
    )
    p.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    p.add_argument("--needles", type=int, nargs="+", default=[1, 2, 4, 6], help="N values")
    p.add_argument(
        "--queries", type=int, nargs="+", default=[1, 2], help="R values (pairs with R > N skipped)"
    )
    p.add_argument(
        "--heatmap-needles", type=int, default=None, help="N of the heatmap, R=1 (default: largest N)"
    )
    p.add_argument("--samples", type=int, default=10, help="prompts per (N, R, length, depth)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--text-files", nargs="+", default=None, help="filler text (cl100k checkpoints)")
    p.add_argument("--tokenizer-file", default=None)
    add_output_arguments(p, "needle_eval")
    return p.parse_args(argv)


@cli_errors
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from diffmeg.eval.common import common_config_fields
    from diffmeg.eval.needle_eval import NeedleEvalConfig, run_needle_eval

    summary = run_needle_eval(
        NeedleEvalConfig(
            **common_config_fields(args),
            lengths=args.lengths,
            depths=args.depths,
            needles=args.needles,
            queries=args.queries,
            heatmap_needles=args.heatmap_needles,
            samples=args.samples,
            text_files=args.text_files,
            tokenizer_file=args.tokenizer_file,
        )
    )
    keys = list(summary["checkpoints"][0]["table"])
    print(f"{'checkpoint':32s} " + " ".join(f"{k:>9s}" for k in keys))
    for c in summary["checkpoints"]:
        print(f"{c['label']:32s} " + " ".join(f"{c['table'][k]:9.3f}" for k in keys))
    print(f"wrote {args.output_dir}")


if __name__ == "__main__":
    main()
