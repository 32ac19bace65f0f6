r"""Concatenate indexed datasets (e.g. the per-rank shards of preprocess_data.py) into one.

    python tools/merge_datasets.py --input 'data/corpus-rank*-of-00004_text_document' \
        --output-prefix data/corpus_text_document

Inputs are dataset prefixes, .bin/.idx paths, globs or directories; globs and directories merge in
sorted order, explicit prefixes in the order given. A complete set of per-rank shards
(``-rankR-of-N``) merges in rank order, and a missing rank is an error. The output is written
under temporary names and renamed when complete.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # megatron-core compiles fusions at import; not needed here
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")

from diffmeg.data.indexed import merge_datasets, order_shards, resolve_prefixes  # noqa: E402
from diffmeg.data.preprocess import exit_cleanly_on_sigterm  # noqa: E402
from diffmeg.errors import cli_errors  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="dataset prefixes, globs or directories")
    p.add_argument("--output-prefix", required=True, help="writes {prefix}.bin and {prefix}.idx")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    return p.parse_args(argv)


@cli_errors
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    exit_cleanly_on_sigterm()
    prefixes = order_shards(resolve_prefixes(args.input))
    writer = merge_datasets(prefixes, args.output_prefix, overwrite=args.overwrite)
    print(
        f"merged {len(prefixes)} datasets: {writer.documents} documents, {writer.tokens} tokens "
        f"-> {args.output_prefix}.bin/.idx",
        file=sys.stderr,
    )


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("error: interrupted; incomplete outputs were removed", file=sys.stderr)
        sys.exit(130)
