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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from diffmeg.errors import cli_errors  # noqa: E402
from diffmeg.eval import cli  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.parser(__doc__, output_dir="mqar_eval", plot=False)
    p.add_argument(
        "--data-prefix", dest="data_prefixes", action="extend", nargs="+", required=True,
        help="loss-masked datasets (e.g. tools/make_mqar_data.py's PREFIX-test)",
    )  # fmt: skip
    p.add_argument(
        "--all-iterations", action="store_true", help="every saved iteration of each --load (else the latest)"
    )
    p.add_argument("--max-documents", type=int, default=512, help="the first N documents of each dataset")
    p.add_argument("--batch-size", type=int, default=64)
    return cli.parse(p, argv)


@cli_errors
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from diffmeg.eval.mqar import MQAREvalConfig, run_mqar_eval

    summary = run_mqar_eval(cli.config(MQAREvalConfig, args))
    cli.print_table(
        [
            {
                "checkpoint": r["label"],
                "iteration": r["iteration"],
                "dataset": os.path.basename(r["data_prefix"]),
            }
            | {"accuracy": r["accuracy"]}
            for r in summary["results"]
        ]
    )
    print(f"wrote {args.output_dir}")


if __name__ == "__main__":
    main()
