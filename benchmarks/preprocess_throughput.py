"""Tokenization throughput: raw tiktoken in one process vs. preprocess_data with 1 and 2 workers, over
the same texts as JSONL and as Parquet.

    python benchmarks/preprocess_throughput.py [--repeat 4] [--workers 1 2] [--tokenizer-file F]

Input: the builtin corpus (Python's own documentation, diffmeg/data/builtin.py) as JSONL, repeated
``--repeat`` times, and the same texts as a Parquet file (``--row-group-rows`` rows per row group, pyarrow's
default compression). "raw tiktoken" is ``encode_ordinary`` over the already-parsed texts; the
preprocess rows are the whole pipeline (read and JSON parse, or a row group at a time; encode; write
.bin/.idx), timed from the start of ``preprocess()`` (worker start-up included, interpreter start-up
excluded).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from diffmeg.data.builtin import builtin_jsonl  # noqa: E402
from diffmeg.data.preprocess import PreprocessConfig, preprocess  # noqa: E402
from diffmeg.data.tiktoken_cl100k import load_tokenizer  # noqa: E402
from diffmeg.errors import cli_errors  # noqa: E402


@cli_errors
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=8, help="copies of the builtin corpus in the input")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--row-group-rows", type=int, default=1000, help="rows per Parquet row group (1000)")
    p.add_argument("--tokenizer-file", default=None)
    args = p.parse_args()
    tokenizer = load_tokenizer(args.tokenizer_file)
    source = builtin_jsonl()
    with tempfile.TemporaryDirectory() as tmp:
        corpus = os.path.join(tmp, "corpus.jsonl")
        with open(source, "rb") as f:
            data = f.read()
        with open(corpus, "wb") as f:
            for _ in range(args.repeat):
                f.write(data)
        texts = [json.loads(line)["text"] for line in data.splitlines()] * args.repeat
        parquet = os.path.join(tmp, "corpus.parquet")
        pq.write_table(pa.table({"text": texts}), parquet, row_group_size=args.row_group_rows)
        mb = len(data) * args.repeat / 1e6
        print(f"input: builtin corpus x{args.repeat} = {len(texts)} docs, {mb:.1f} MB; {os.cpu_count()} CPUs")

        start = time.perf_counter()
        tokens = sum(len(tokenizer.tokenize(t)) for t in texts)
        seconds = time.perf_counter() - start
        print(f"{'raw tiktoken (1 process)':<42} {tokens / seconds:>12,.0f} tokens/s  ({seconds:.2f} s)")

        size = os.path.getsize(parquet) / 1e6
        print(f"parquet: {pq.ParquetFile(parquet).metadata.num_row_groups} row groups, {size:.1f} MB")

        for workers in args.workers:
            for name, path in (("JSONL", corpus), ("Parquet", parquet)):
                cfg = PreprocessConfig(
                    inputs=[path],
                    output_prefix=os.path.join(tmp, f"out{workers}{name}"),
                    workers=workers,
                    log_interval=0,
                    tokenizer_file=args.tokenizer_file,
                )
                result = preprocess(cfg, log=lambda line: None)
                assert result.tokens == tokens, (result.tokens, tokens)
                label = f"preprocess_data --workers {workers} {name}"
                rate = result.tokens / result.seconds
                print(f"{label:<42} {rate:>12,.0f} tokens/s  ({result.seconds:.2f} s)")


if __name__ == "__main__":
    main()
