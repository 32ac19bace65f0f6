r"""Accuracy on held-out MQAR (or any loss-masked) data, per checkpoint, dataset, query and pair position.

    python tools/eval_mqar.py --load runs/diff --load runs/transformer --label DIFF Transformer \
        --data-prefix data/kv16-test data/kv32-d2-test
    python tools/eval_mqar.py --load runs/diff --all-iterations --data-prefix data/kv16-test   # over training

An answer (a token with loss-mask bit 1; for MQAR the value after each queried key) counts as correct
when it is the model's greedy prediction given the true document before it. Reads the first
--max-documents of each dataset. Writes mqar_summary.json (accuracy, by query index, by context pair
for MQAR data) and mqar_accuracy.csv under --output-dir. See diffmeg/eval/mqar.py.
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", action="extend", nargs="+", required=True, help="pretrain_diff.py --save dirs")
    p.add_argument("--label", action="extend", nargs="+", default=None, help="one label per --load")
    p.add_argument("--data-prefix", action="extend", nargs="+", required=True, help="loss-masked datasets")
    p.add_argument(
        "--all-iterations", action="store_true", help="every saved iteration of each --load (else the latest)"
    )
    p.add_argument("--max-documents", type=int, default=512, help="the first N documents of each dataset")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--output-dir", default="mqar_eval")
    return p.parse_args(argv)


@cli_errors
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from diffmeg.errors import DiffmegError
    from diffmeg.eval.mqar import MQAREvalConfig, run_mqar_eval

    if args.max_documents < 1 or args.batch_size < 1:
        raise DiffmegError("--max-documents and --batch-size must be >= 1")
    summary = run_mqar_eval(
        MQAREvalConfig(
            loads=args.load,
            data_prefixes=args.data_prefix,
            labels=args.label,
            all_iterations=args.all_iterations,
            max_documents=args.max_documents,
            batch_size=args.batch_size,
            dtype=args.dtype,
            seed=args.seed,
            output_dir=args.output_dir,
        )
    )
    print(f"{'checkpoint':32s} {'iteration':>9s} {'dataset':24s} {'accuracy':>8s}")
    for r in summary["results"]:
        name = os.path.basename(r["data_prefix"])
        print(f"{r['label']:32s} {r['iteration']!s:>9s} {name:24s} {r['accuracy']:8.4f}")
    print(f"wrote {args.output_dir}")


if __name__ == "__main__":
    main()
