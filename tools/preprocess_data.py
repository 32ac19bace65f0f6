r"""Tokenize JSONL / text / Parquet / Arrow corpora (also `datasets` save_to_disk folders and
hf:NAME[:SPLIT] from the local Hugging Face cache) with cl100k_base (or a Hugging Face tokenizer) into
megatron-core indexed datasets.

    python tools/preprocess_data.py --input 'corpus/*.jsonl.zst' --output-prefix data/corpus \
        --append-eod --workers 16 --tokenizer-file cl100k_base.tiktoken
    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/llama --append-eod \
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model hf/llama   # an upcycled Llama's own tokenizer
    python tools/preprocess_data.py --input 'fineweb/*.parquet' --json-keys text \
        --output-prefix data/fineweb --append-eod --workers 16    # Parquet: a row group at a time

writes data/corpus_text_document.bin/.idx (one per --json-keys key) and .tokenizer.json (which tokenizer:
pretrain_diff.py refuses data of another vocabulary); pass
``--data-path data/corpus_text_document`` to pretrain_diff.py. Under ``mpirun``/``srun`` every
rank tokenizes its slice of the input into ``{prefix}-rankRRRRR-of-NNNNN_{key}_document``; merge
those with tools/merge_datasets.py. --overwrite replaces only the files of those datasets. See
diffmeg/data/preprocess.py for formats and ordering.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # megatron-core compiles fusions at import; not needed here
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# --help names the input formats and the tokenizer's variable, so these come before the flags
from diffmeg import cli  # noqa: E402
from diffmeg.data.preprocess import SUPPORTED, PreprocessConfig, detect_rank, preprocess  # noqa: E402
from diffmeg.data.tiktoken_cl100k import TOKENIZER_FILE_ENV  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.dataset_parser(
        __doc__, f"files or globs ({SUPPORTED})", "writes {prefix}_{key}_document.bin/.idx"
    )
    p.add_argument(
        "--json-keys",
        nargs="+",
        default=["text"],
        help="JSON fields, or a table's columns (Parquet, Arrow, datasets), to tokenize (default: text)",
    )
    p.add_argument(
        "--append-eod",
        action="store_true",
        help="append the end-of-document token to every document (cl100k_base: <|endoftext|> = 100257; a "
        "Hugging Face tokenizer: its eos token)",
    )
    p.add_argument("--workers", type=int, default=1, help="encoding processes in total (default 1)")
    p.add_argument("--partitions", type=int, default=1, help="parallel reader/writer processes (default 1)")
    p.add_argument(
        "--log-interval", type=int, default=None, help="progress every N documents instead (0: none)"
    )
    p.add_argument("--log-seconds", type=float, default=10.0, help="progress every N seconds (10)")
    p.add_argument(
        "--tokenizer-file", default=None, help=f"cl100k_base.tiktoken (else ${TOKENIZER_FILE_ENV})"
    )
    p.add_argument(
        "--tokenizer-type",
        choices=["cl100k_base", "HuggingFaceTokenizer"],
        default="cl100k_base",
        help="HuggingFaceTokenizer: the folder --tokenizer-model (documents get its special tokens: <s> ...)",
    )
    p.add_argument("--tokenizer-model", default=None, help="Hugging Face tokenizer or model folder")
    p.add_argument("--skip-bad-lines", action="store_true", help="skip and count malformed lines")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace this prefix's datasets ({prefix}_{key}_document.*); other files stay",
    )
    return cli.parse(p, argv)


def write(args: argparse.Namespace) -> None:
    rank, world_size, source = detect_rank()
    flags = dict(vars(args))  # a field per flag (one without a field is a TypeError); --input: inputs
    cfg = PreprocessConfig(inputs=flags.pop("input"), **flags)
    if world_size > 1:
        print(f"[rank {rank}/{world_size}] ranks from {source}", file=sys.stderr, flush=True)
    preprocess(cfg, rank=rank, world_size=world_size)
    if world_size > 1 and rank == 0:
        for key in cfg.json_keys:
            shards = f"{args.output_prefix}-rank*-of-{world_size:05d}_{key}_document"
            print(
                f"when all {world_size} ranks are done, merge with: python tools/merge_datasets.py "
                f"--input '{shards}' --output-prefix {args.output_prefix}_{key}_document",
                file=sys.stderr,
                flush=True,
            )


main = cli.dataset_main(parse_args, write)

if __name__ == "__main__":
    main()
