r"""Accuracy on held-out MQAR (or any loss-masked) data, per checkpoint, dataset, query and pair position.

    python tools/eval_mqar.py --load runs/diff --load runs/transformer --label DIFF Transformer \
        --data-prefix data/kv16-test data/kv32-d2-test
    python tools/eval_mqar.py --load runs/diff --all-iterations --data-prefix data/kv16-test   # over training
    python tools/eval_mqar.py --load runs/diff runs/transformer --attention --data-prefix data/kv16-test

An answer (a token with loss-mask bit 1; for MQAR the value after each queried key) counts as correct
when it is the model's greedy prediction given the true document before it. Reads the first
--max-documents of each dataset. Writes mqar_summary.json (accuracy, by query index, by context pair
for MQAR data) and mqar_accuracy.csv under --output-dir. See diffmeg/eval/mqar.py.

--attention (MQAR data): at the same answers, per layer, the attention mass on the queried key-value pair
and on the rest of the context (noise), raw and with DIFF's A1 - lambda A2 divided by 1 - lambda so
that every architecture's rows sum to 1; mqar_attention.json/.csv/.png, and a table of the normalised
masses. See diffmeg/eval/mqar_attention.py and docs/analysis.md.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from diffmeg import cli  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.parser(__doc__, output_dir="mqar_eval")
    p.add_argument(
        "--data-prefix", dest="data_prefixes", action="extend", nargs="+", required=True,
        help="loss-masked datasets (e.g. tools/make_mqar_data.py's PREFIX-test)",
    )  # fmt: skip
    p.add_argument(
        "--all-iterations", action="store_true", help="every saved iteration of each --load (else the latest)"
    )
    p.add_argument("--max-documents", type=int, default=512, help="the first N documents of each dataset")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument(
        "--attention", action="store_true", help="also the attention on the queried pair vs noise, per layer"
    )
    return cli.parse(p, argv)


def measure(args: argparse.Namespace) -> dict:
    from diffmeg.eval.mqar import MQAREvalConfig, run_mqar_eval

    return run_mqar_eval(cli.config(MQAREvalConfig, args))


def report(summary: dict, args: argparse.Namespace) -> None:
    def where(r: dict) -> dict:
        return {
            "checkpoint": r["label"],
            "iteration": r["iteration"],
            "dataset": os.path.basename(r["data_prefix"]),
        }

    cli.print_table([where(r) | {"accuracy": r["accuracy"]} for r in summary["results"]])
    if args.attention:
        print("\nattention at the answers, per layer (mean over heads; normalised: rows sum to 1)")
        cli.print_table(
            [
                where(r)
                | {
                    "layer": layer["layer"],
                    "pair": layer["normalised"]["pair"],
                    "noise": layer["normalised"]["noise"],
                    "ratio": "-"
                    if layer["normalised"]["ratio"] is None
                    else f"{layer['normalised']['ratio']:.3f}",
                    "raw pair": layer["raw"]["pair"],
                    "raw noise": layer["raw"]["noise"],
                    "lambda": "-" if layer["lambda"] is None else f"{layer['lambda']:.4f}",
                }
                for r in summary["attention"]
                for layer in r["layers"]
            ]
        )


main = cli.measurement_main(parse_args, measure, report)


if __name__ == "__main__":
    main()
