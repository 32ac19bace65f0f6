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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from diffmeg import cli  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.dataset_parser(
        __doc__, "dataset prefixes, globs or directories", "writes {prefix}.bin and {prefix}.idx"
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    return cli.parse(p, argv)


def write(args: argparse.Namespace) -> None:
    from diffmeg.data.indexed import merge_datasets, order_shards, resolve_prefixes

    prefixes = order_shards(resolve_prefixes(args.input))
    writer = merge_datasets(prefixes, args.output_prefix, overwrite=args.overwrite)
    print(
        f"merged {len(prefixes)} datasets: {writer.documents} documents, {writer.tokens} tokens "
        f"-> {args.output_prefix}.bin/.idx",
        file=sys.stderr,
    )


main = cli.dataset_main(parse_args, write)

if __name__ == "__main__":
    main()
