"""Tokenization throughput: raw tiktoken in one process vs. preprocess_data with 1 and 2 workers.

    python benchmarks/preprocess_throughput.py [--repeat 4] [--workers 1 2] [--tokenizer-file F]

Input: the builtin corpus (Python's own documentation, diffmeg/data/builtin.py) as JSONL, repeated
``--repeat`` times. "raw tiktoken" is ``encode_ordinary`` over the already-parsed texts; the
preprocess rows are the whole pipeline (read, JSON parse, encode, write .bin/.idx), timed from
the start of ``preprocess()`` (worker start-up included, interpreter start-up excluded).
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

from diffmeg.data.builtin import builtin_jsonl  # noqa: E402
from diffmeg.data.preprocess import PreprocessConfig, preprocess  # noqa: E402
from diffmeg.data.tiktoken_cl100k import load_tokenizer  # noqa: E402
from diffmeg.errors import cli_errors  # noqa: E402


@cli_errors
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=8, help="copies of the builtin corpus in the input")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
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
        mb = len(data) * args.repeat / 1e6
        print(f"input: builtin corpus x{args.repeat} = {len(texts)} docs, {mb:.1f} MB; {os.cpu_count()} CPUs")

        start = time.perf_counter()
        tokens = sum(len(tokenizer.tokenize(t)) for t in texts)
        seconds = time.perf_counter() - start
        print(f"{'raw tiktoken (1 process)':<34} {tokens / seconds:>12,.0f} tokens/s  ({seconds:.2f} s)")

        for workers in args.workers:
            cfg = PreprocessConfig(
                inputs=[corpus],
                output_prefix=os.path.join(tmp, f"out{workers}"),
                workers=workers,
                log_interval=0,
                tokenizer_file=args.tokenizer_file,
            )
            result = preprocess(cfg, log=lambda line: None)
            assert result.tokens == tokens, (result.tokens, tokens)
            label = f"preprocess_data --workers {workers}"
            print(f"{label:<34} {result.tokens / result.seconds:>12,.0f} tokens/s  ({result.seconds:.2f} s)")


if __name__ == "__main__":
    main()
