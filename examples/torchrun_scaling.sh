#!/usr/bin/env bash
# One model of the paper's scaling sweep (40K steps of 0.25M tokens at seq 2048) on one node of 8 GPUs
# with torchrun. For clusters use slurm/diff_scaling.sh.
#
#   DATA_PATH=/data/corpus_text_document bash examples/torchrun_scaling.sh 830m               # DIFF-830M
#   DATA_PATH=/data/corpus_text_document bash examples/torchrun_scaling.sh transformer-2.8b   # baseline
#   DRY_RUN=1 bash examples/torchrun_scaling.sh 6.8b              # print the command and resolved config
#
# SIZE: 830m 1.4b 2.8b 6.8b 13.1b, optionally prefixed with diff- or transformer-.
# Environment: NPROC=8 RUN_DIR=runs/<arch>-<size>-node, TP and MICRO_BATCH per size (830m 1/4,
# 1.4b 1/4, 2.8b 1/2, 6.8b 2/2, 13.1b 4/2), DATA_PATH (default: the builtin corpus)
# CKPT_DIR=$RUN_DIR/checkpoints (resumes from it) EXTRA_ARGS (appended last) PYTHON=python3 DRY_RUN=
set -euo pipefail
cd "$(dirname "$0")/.."
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
nproc=${NPROC:-8}
run=${RUN_DIR:-runs/$arch-$size-node}
ckpt=${CKPT_DIR:-$run/checkpoints}
read -r -a data <<<"${DATA_PATH:-builtin}"
read -r -a extra <<<"${EXTRA_ARGS:-}"
args=(pretrain_diff.py --model "$arch-$size" --tensor-model-parallel-size "${TP:-$tp}" --sequence-parallel
    --micro-batch-size "${MICRO_BATCH:-$mb}" --use-distributed-optimizer --bf16 --data-path "${data[@]}"
    --load "$ckpt" --save "$ckpt" --save-interval 1000 --tensorboard-dir "$run/tensorboard"
    --metrics-file "$run/metrics.jsonl" "${extra[@]}")
launcher=(torchrun)  # with PYTHON set: that interpreter's torch.distributed.run, which is torchrun
[ -z "${PYTHON:-}" ] || launcher=("$PYTHON" -m torch.distributed.run)
cmd=("${launcher[@]}" --standalone --nproc_per_node "$nproc" "${args[@]}")
if [ "${DRY_RUN:-0}" = 1 ]; then
    printf '%q ' "${cmd[@]}"
    printf '\n\n'
    WORLD_SIZE=$nproc exec "${PYTHON:-python3}" "${args[@]}" --dry-run 2>/dev/null
fi
mkdir -p "$ckpt"
exec "${cmd[@]}"
