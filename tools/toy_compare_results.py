r"""The toy comparison's results (examples/toy_compare.sh): collect them, choose learning rates, make tables.

    python tools/toy_compare_results.py collect runs/toy_compare          # -> results.json + plots
    python tools/toy_compare_results.py best-lr runs/toy_compare --model diff --setting kv16
    python tools/toy_compare_results.py tables docs/results/toy_compare.json > tables.md
    python tools/toy_compare_results.py merge A/results.json B/results.json --output results.json --plots DIR

results.json holds `mqar` rows {model, setting, seed, lr, step, accuracy, split} (split "test": the
held-out test set; "valid": the validation set, whose final step chooses the learning rate; both at
every saved step), `mqar_positions` rows {model, setting, seed, lr, step, by_query, by_pair} (the final
held-out accuracy by query index and by the queried pair's place in the context) and `lm` rows {model,
seed, tokens, val_loss}, plus `meta` (how it was run). From the analyses of the final checkpoints
(OUT/analysis/SETTING/, labels MODEL-sSEED): `attention` rows {model, setting, seed, step, layer,
normalised, pair_mass, noise_mass, query_mass, ratio, lambda} (tools/eval_mqar.py --attention: mass at
the answers on the queried pair vs the rest of the context, mean over heads; normalised: DIFF's rows
divided by 1 - lambda) and `outliers` rows {model, setting, seed, kind, top1, top2, top3, top10, top100,
median, kurtosis, count} (tools/activation_stats.py on the held-out documents).

A model's learning rate for a setting is the one with the highest final validation accuracy of the first
seed, which sweeps them all (ties: the smaller rate); its tables and curves use only runs at that rate.
Steps to 90% is the first saved step whose held-out accuracy is >= 0.9 ("-" if none). The markdown
tables are what docs/results.md shows, generated from the committed docs/results/toy_compare.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from diffmeg.errors import DiffmegError, cli_errors  # noqa: E402
from diffmeg.eval.toy_compare import (  # noqa: E402
    best_lrs,
    collect,
    format_lr,
    load,
    merge,
    model_flags,
    tables,
    write_results,
)

# ----------------------------------------------------------------------------------------------------
# The command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("collect", help="OUT/results.json and OUT/plots from a toy_compare.sh directory")
    c.add_argument("out")
    c.add_argument("--no-plot", action="store_true")
    b = sub.add_parser("best-lr", help="print the chosen learning rate of one model and setting")
    b.add_argument("results", help="a results.json, or a toy_compare.sh output directory (collected now)")
    b.add_argument("--model", required=True)
    b.add_argument("--setting", required=True)
    t = sub.add_parser("tables", help="print the markdown tables of docs/results.md")
    t.add_argument("results")
    m = sub.add_parser("merge", help="one results.json from runs of the same protocol over other models")
    m.add_argument("results", nargs="+", help="results.json files (the committed one, a TOY_MODELS=gda run)")
    m.add_argument("--output", required=True, help="the merged results.json")
    m.add_argument("--plots", help="draw the plots of the merged results into this directory")
    f = sub.add_parser("model-flags", help="flags for a preset at another size (dry-run JSON on stdin)")
    f.add_argument("--layers", type=int, required=True)
    f.add_argument("--hidden", type=int, required=True)
    return p.parse_args(argv)


@cli_errors(interrupted="results.json is written whole or not at all; run it again to redraw the plots")
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.command in ("collect", "merge"):
        if args.command == "collect":
            results, path = collect(args.out), os.path.join(args.out, "results.json")
            plots = None if args.no_plot else os.path.join(args.out, "plots")
        else:
            results = merge([load(p) for p in args.results], args.results)
            path, plots = args.output, args.plots
        write_results(path, results)
        written = [path]
        if plots:
            os.makedirs(plots, exist_ok=True)
            from diffmeg.eval.toy_compare_plots import plot  # matplotlib: only when plotting

            written += plot(results, plots)
        counts = ", ".join(f"{len(results[k])} {k} rows" for k in ("mqar", "lm", "attention", "outliers"))
        print(f"{counts}; wrote {', '.join(written)}")
    elif args.command == "model-flags":
        try:
            dry_run = json.load(sys.stdin)
        except json.JSONDecodeError:
            raise DiffmegError("model-flags reads `pretrain_diff.py --model X --dry-run` on stdin") from None
        print(model_flags(dry_run, args.layers, args.hidden))
    elif args.command == "best-lr":
        chosen = best_lrs(collect(args.results) if os.path.isdir(args.results) else load(args.results))
        if (args.model, args.setting) not in chosen:
            raise DiffmegError(f"{args.results} has no validation result for {args.model} on {args.setting}")
        print(format_lr(chosen[(args.model, args.setting)]))
    else:
        results = load(args.results)
        for key in ("mqar", "lm"):
            if not isinstance(results.get(key), list):
                raise DiffmegError(f"{args.results} has no '{key}' list; is it a toy_compare results.json?")
        if any(not math.isfinite(r["accuracy"]) for r in results["mqar"]):
            raise DiffmegError(f"{args.results} holds a non-finite accuracy")
        print(tables(results))


if __name__ == "__main__":
    main()
