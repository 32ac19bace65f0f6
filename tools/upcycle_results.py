"""The results of examples/upcycle.sh (a Transformer continued as itself and upcycled into DIFF V2):

    python tools/upcycle_results.py collect runs/upcycle > runs/upcycle/results.json
    python tools/upcycle_results.py tables docs/results/upcycle.json      # docs/results.md's section
    python tools/upcycle_results.py plot docs/results/upcycle.json --output docs/results/upcycle_val_loss.png

See diffmeg/eval/upcycle_results.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from diffmeg import cli  # noqa: E402


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = cli.tool_parser(__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("collect", help="an output directory -> results JSON on stdout").add_argument("out")
    sub.add_parser("tables", help="results JSON -> markdown tables").add_argument("results")
    plot = sub.add_parser("plot", help="results JSON -> validation-loss plot (PNG)")
    plot.add_argument("results")
    plot.add_argument("--output", required=True)
    return p.parse_args(argv)


def work(args: argparse.Namespace) -> None:
    from diffmeg.eval import upcycle_results

    if args.command == "collect":
        print(json.dumps(upcycle_results.collect(args.out), indent=1))
        return
    with open(args.results) as f:
        results = json.load(f)
    if args.command == "tables":
        print(upcycle_results.tables(results), end="")
    else:
        print(f"wrote {upcycle_results.plot(results, args.output)}")


main = cli.tool_main(parse_args, work, interrupted="run it again (it redraws the plot)")

if __name__ == "__main__":
    main()
