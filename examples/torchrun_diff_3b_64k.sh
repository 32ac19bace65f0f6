#!/usr/bin/env bash
# The paper's 64K-context extension of DIFF-3B on one node of 8 GPUs with torchrun: continue a 3B
# checkpoint for 1.5B tokens at seq 65536, RoPE theta 640000, lr 8e-5, 4M-token batches (64 x 65536),
# on the length-upsampled corpus (the diff-3b-64k preset). slurm/diff_3b_64k.sh explains the choices
# (--pretrained-checkpoint, layout); this is the same run on one node: TP 2 + CP 2 per sequence, two
# replicas, full recompute, the loss in chunks of 2048 tokens.
#
#   python tools/length_upsample.py --input data/corpus_text_document --output-prefix data/up64k \
#       --target-length 65536 --long-factor 4 --train-tokens 1.5e9
#   INIT_CKPT=runs/diff-3b-1T-node/checkpoints DATA_PATH="$(cat data/up64k_weights.txt)" \
#       bash examples/torchrun_diff_3b_64k.sh
#   DRY_RUN=1 bash examples/torchrun_diff_3b_64k.sh               # print the command and resolved config
#
# Environment: TP=2 CP=2 MICRO_BATCH=1, run directory runs/diff-3b-64k-node, INIT_CKPT (the 3B checkpoints;
# default runs/diff-3b-1T-node/checkpoints, read while CKPT_DIR holds none); the others (NPROC, DATA_PATH,
# CKPT_DIR, EXTRA_ARGS, DRY_RUN, ...) are every torchrun example's: examples/common.sh.
set -euo pipefail
# shellcheck source=examples/common.sh
source "$(dirname "$0")/common.sh"
init_ckpt=${INIT_CKPT:-runs/diff-3b-1T-node/checkpoints}
torchrun_pretrain diff-3b-64k-node "${TP:-2}" --model diff-3b-64k --context-parallel-size "${CP:-2}" \
    --micro-batch-size "${MICRO_BATCH:-1}" --recompute-granularity full --cross-entropy-chunk-size 2048 \
    --save-interval 50 --log-interval 1
