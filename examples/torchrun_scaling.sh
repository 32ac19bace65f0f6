#!/usr/bin/env bash
# One model of the paper's scaling sweep (40K steps of 0.25M tokens at seq 2048) on one node of 8 GPUs
# with torchrun. For clusters use slurm/diff_scaling.sh.
#
#   DATA_PATH=/data/corpus_text_document bash examples/torchrun_scaling.sh 830m               # DIFF-830M
#   DATA_PATH=/data/corpus_text_document bash examples/torchrun_scaling.sh transformer-2.8b   # baseline
#   DRY_RUN=1 bash examples/torchrun_scaling.sh 6.8b              # print the command and resolved config
#
# SIZE: 830m 1.4b 2.8b 6.8b 13.1b, optionally prefixed with diff- or transformer-.
# Environment: TP and MICRO_BATCH per size (830m 1/4, 1.4b 1/4, 2.8b 1/2, 6.8b 2/2, 13.1b 4/2), run
# directory runs/<arch>-<size>-node; the others (NPROC, DATA_PATH, CKPT_DIR, EXTRA_ARGS, DRY_RUN, ...) are
# every torchrun example's: examples/common.sh.
set -euo pipefail
# shellcheck source=examples/common.sh
source "$(dirname "$0")/common.sh"
size=${1:-}
arch="diff"
case $size in diff-* | transformer-*) arch=${size%%-*} size=${size#*-} ;; esac
[ "$size" = 13b ] && size=13.1b
case $size in
    830m) tp=1 mb=4 ;;
    1.4b) tp=1 mb=4 ;;
    2.8b) tp=1 mb=2 ;;
    6.8b) tp=2 mb=2 ;;
    13.1b) tp=4 mb=2 ;;
    *) echo "usage: $0 [diff-|transformer-]{830m,1.4b,2.8b,6.8b,13.1b}" >&2; exit 2 ;;
esac
torchrun_pretrain "$arch-$size-node" "${TP:-$tp}" --model "$arch-$size" \
    --micro-batch-size "${MICRO_BATCH:-$mb}" --save-interval 1000
