r"""Build the length-upsampled blend for long-context training (the 64K extension).

    python tools/length_upsample.py --input data/corpus_text_document --output-prefix data/up64k \
        --target-length 65536 --long-factor 4

writes data/up64k_short and data/up64k_long (datasets), data/up64k_weights.txt and
data/up64k_upsample.json, and prints the ``--data-path`` value on stdout, e.g.
``pretrain_diff.py --data-path $(cat data/up64k_weights.txt)``. Bucket blend weights are
``factor * tokens`` normalised, so factor 1 everywhere reproduces the corpus's own token mix;
see diffmeg/data/upsample.py.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from diffmeg import cli  # noqa: E402
from diffmeg.errors import DiffmegError  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.dataset_parser(
        __doc__, "indexed dataset prefixes (or globs)", "writes {prefix}_short, {prefix}_long, ..."
    )
    p.add_argument(
        "--target-length", type=int, default=65536, help="target context in tokens (default 65536)"
    )
    p.add_argument("--long-factor", type=float, default=4.0, help="upsampling of documents >= the target")
    p.add_argument(
        "--edges", type=int, nargs="+", default=None, help="bucket edges in tokens (default: target)"
    )
    p.add_argument("--factors", type=float, nargs="+", default=None, help="one factor per bucket")
    p.add_argument(
        "--train-tokens", type=float, default=None, help="report epochs per bucket for this budget"
    )
    p.add_argument("--overwrite", action="store_true", help="replace existing outputs")
    return cli.parse(p, argv)


def write(args: argparse.Namespace) -> None:
    from diffmeg.data.indexed import resolve_prefixes
    from diffmeg.data.upsample import length_upsample

    if args.train_tokens is not None and args.train_tokens <= 0:
        raise DiffmegError("--train-tokens must be > 0")
    result = length_upsample(
        resolve_prefixes(args.input),
        args.output_prefix,
        target_length=args.target_length,
        long_factor=args.long_factor,
        edges=args.edges,
        factors=args.factors,
        overwrite=args.overwrite,
    )
    for b in result.buckets:
        upper = "inf" if b.max_length is None else b.max_length
        line = (
            f"{b.name:>6} [{b.min_length}, {upper}): {b.documents} docs, {b.tokens} tokens, "
            f"factor {b.factor:g}, natural share {b.natural_share:.4f} -> share {b.token_share:.4f}"
        )
        if args.train_tokens and b.tokens:
            line += f", {b.token_share * args.train_tokens / b.tokens:.2f} epochs"
        print(line, file=sys.stderr)
        if not b.tokens:
            print(f"warning: bucket {b.name} is empty and left out of the blend", file=sys.stderr)
    print(f"wrote {result.weights_file} and {result.summary_file}", file=sys.stderr)
    print(result.data_path_string)


main = cli.dataset_main(parse_args, write)

if __name__ == "__main__":
    main()
