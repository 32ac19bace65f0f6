#!/usr/bin/env bash
# The paper's 3B run (1T tokens) on one node of 8 GPUs with torchrun: DIFF, or its Transformer baseline.
# The model, batch (1024 x 4096 = 4M tokens) and schedule are the preset's; one node only changes how
# long it takes (128 micro-batches per GPU per step). For clusters use slurm/diff_3b_1T.sh.
#
#   DATA_PATH=/data/corpus_text_document bash examples/torchrun_diff_3b.sh              # DIFF-3B
#   DATA_PATH=/data/corpus_text_document bash examples/torchrun_diff_3b.sh transformer  # Transformer-3B
#   DRY_RUN=1 bash examples/torchrun_diff_3b.sh                   # print the command and resolved config
#
# Environment: TP=1 MICRO_BATCH=1, run directory runs/<arch>-3b-1T-node; the others (NPROC, DATA_PATH,
# CKPT_DIR, EXTRA_ARGS, DRY_RUN, ...) are every torchrun example's: examples/common.sh.
set -euo pipefail
# shellcheck source=examples/common.sh
source "$(dirname "$0")/common.sh"
arch=${1:-diff}
case $arch in diff | transformer) ;; *) echo "usage: $0 [diff|transformer]" >&2; exit 2 ;; esac
torchrun_pretrain "$arch-3b-1T-node" "${TP:-1}" --model "$arch-3b" --micro-batch-size "${MICRO_BATCH:-1}" \
    --save-interval 1000
