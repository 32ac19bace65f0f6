#!/usr/bin/env bash
# The paper's 3B run (1T tokens) on one node of 8 GPUs with torchrun: DIFF, or its Transformer baseline.
# The model, batch (1024 x 4096 = 4M tokens) and schedule are the preset's; one node only changes how
# long it takes (128 micro-batches per GPU per step). For clusters use slurm/diff_3b_1T.sh.
#
#   DATA_PATH=/data/corpus_text_document bash examples/torchrun_diff_3b.sh              # DIFF-3B
#   DATA_PATH=/data/corpus_text_document bash examples/torchrun_diff_3b.sh transformer  # Transformer-3B
#   DRY_RUN=1 bash examples/torchrun_diff_3b.sh                   # print the command and resolved config
#
# Environment: NPROC=8 RUN_DIR=runs/<arch>-3b-1T-node TP=1 MICRO_BATCH=1 DATA_PATH (prefix or
# "w1 p1 w2 p2" blend; default: the builtin corpus) CKPT_DIR=$RUN_DIR/checkpoints (resumes from it)
# EXTRA_ARGS (appended last) PYTHON=python3 DRY_RUN=
set -euo pipefail
cd "$(dirname "$0")/.."
arch=${1:-diff}
case $arch in diff | transformer) ;; *) echo "usage: $0 [diff|transformer]" >&2; exit 2 ;; esac
nproc=${NPROC:-8}
run=${RUN_DIR:-runs/$arch-3b-1T-node}
ckpt=${CKPT_DIR:-$run/checkpoints}
read -r -a data <<<"${DATA_PATH:-builtin}"
read -r -a extra <<<"${EXTRA_ARGS:-}"
args=(pretrain_diff.py --model "$arch-3b" --tensor-model-parallel-size "${TP:-1}" --sequence-parallel
    --micro-batch-size "${MICRO_BATCH:-1}" --use-distributed-optimizer --bf16 --data-path "${data[@]}"
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
