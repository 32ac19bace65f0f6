r"""Write a generated multi-needle corpus (token ids, no tokenizer) as an indexed dataset.

    python tools/make_needle_corpus.py --output-prefix data/needles --vocab-size 512 \
        --seq-length 256 --documents 20000
    python pretrain_diff.py --model diff-tiny --data-path data/needles --tokenizer-type null \
        --vocab-size 512 --seq-length 256 ...

Each document is one needle prompt in the evaluation's id format (the same templates, city and number
ids `tools/eval_needle.py` builds for a model with this vocabulary), followed by its answer and the
end-of-document id (vocab size - 1), exactly --seq-length tokens long. Needle counts (--needles),
query counts (--queries) and the first queried needle's depth vary per document; deterministic by
--seed. See examples/toy_retrieval.sh and docs/results.md.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from diffmeg import cli  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.tool_parser(__doc__)
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    p.add_argument("--vocab-size", type=int, default=512, help="the model's --vocab-size")
    p.add_argument("--seq-length", type=int, default=256, help="the model's --seq-length")
    p.add_argument("--documents", type=int, default=20000)
    p.add_argument("--needles", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6], help="N values drawn from")
    p.add_argument("--queries", type=int, nargs="+", default=[1, 2], help="R values drawn from (R <= N)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true")
    return p.parse_args(argv)


def write(args: argparse.Namespace) -> None:
    from diffmeg.eval.needle_corpus import NeedleCorpusConfig, write_needle_corpus

    documents, tokens = write_needle_corpus(cli.config(NeedleCorpusConfig, args))
    print(f"wrote {args.output_prefix}.bin/.idx: {documents} documents, {tokens} tokens")


main = cli.dataset_main(parse_args, write)

if __name__ == "__main__":
    main()
