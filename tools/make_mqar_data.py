r"""Write multi-query associative recall (MQAR) data: token ids with a loss mask on the answers.

    python tools/make_mqar_data.py --output-prefix data/kv16 --pairs 16 --vocab-size 256 \
        --documents 32000 --heldout-documents 512
    python pretrain_diff.py --model diff-tiny --data-path data/kv16 --tokenizer-type null \
        --vocab-size 256 --seq-length 63 --split 1,0,0 ...
    python tools/eval_mqar.py --load CKPT --data-prefix data/kv16-test

Every document is --pairs key-value pairs (with --distractors key-like ids per pair between them), then
--queries of the keys, each followed by its value; see diffmeg/data/mqar.py. Writes PREFIX.bin/.idx, its
loss mask PREFIX.loss_mask.bin/.idx (the trainer then counts the loss on the queried values only, one
document per sample) and PREFIX.mqar.json (the setting and the --seq-length to train with). With
--heldout-documents N it also writes PREFIX-valid (seed + 1) and PREFIX-test (seed + 2), N documents
each: a validation set for choosing hyperparameters and a test set for reporting, drawn from other
seeds than the training data.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from diffmeg import cli  # noqa: E402

HELDOUT_SPLITS = (("valid", 1), ("test", 2))
"""Held-out datasets: name suffix and seed offset from --seed."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.tool_parser(__doc__)
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin/.idx (+ .loss_mask, .mqar.json)")
    p.add_argument("--vocab-size", type=int, default=256, help="the model's --vocab-size")
    p.add_argument("--pairs", type=int, required=True, help="key-value pairs per document")
    p.add_argument("--queries", type=int, default=None, help="queried keys per document (default: all)")
    p.add_argument("--distractors", type=int, default=0, help="distractor ids per pair, on average")
    p.add_argument("--documents", type=int, required=True, help="training documents")
    p.add_argument("--heldout-documents", type=int, default=0, help="also write PREFIX-valid and -test")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true")
    return p.parse_args(argv)


def write(args: argparse.Namespace) -> None:
    from diffmeg.data.indexed import check_can_write, loss_mask_prefix
    from diffmeg.data.mqar import MQARSetting, write_mqar_dataset

    setting = MQARSetting(args.pairs, args.queries, args.distractors, args.vocab_size)
    outputs = [(args.output_prefix, args.documents, args.seed)]
    if args.heldout_documents:
        outputs += [
            (f"{args.output_prefix}-{name}", args.heldout_documents, args.seed + offset)
            for name, offset in HELDOUT_SPLITS
        ]
    prefixes = [prefix for prefix, _, _ in outputs]
    check_can_write(prefixes + [loss_mask_prefix(p) for p in prefixes], args.overwrite)  # before any work
    for prefix, documents, seed in outputs:
        write_mqar_dataset(prefix, setting, documents, seed, overwrite=args.overwrite)
        print(
            f"wrote {prefix}.bin/.idx (+ loss mask): {setting.name}, {documents} documents of "
            f"{setting.doc_length} tokens, seed {seed}; train with --seq-length {setting.seq_length}"
        )


main = cli.dataset_main(parse_args, write)

if __name__ == "__main__":
    main()
