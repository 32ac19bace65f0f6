#!/usr/bin/env bash
# The paper's 64K-context extension of DIFF-3B on one node of 8 GPUs with torchrun: continue a 3B
# checkpoint for 1.5B tokens at seq 65536, RoPE theta 640000, lr 8e-5, 4M-token batches (64 x 65536),
# on the length-upsampled corpus (the diff-3b-64k preset). slurm/diff_3b_64k.sh explains the choices
# (--pretrained-checkpoint, layout); this is the same run on one node: TP 2 + CP 2 per sequence, two
# replicas, full recompute.
#
#   python tools/length_upsample.py --input data/corpus_text_document --output-prefix data/up64k \
#       --target-length 65536 --long-factor 4 --train-tokens 1.5e9
#   INIT_CKPT=runs/diff-3b-1T-node/checkpoints DATA_PATH="$(cat data/up64k_weights.txt)" \
#       bash examples/torchrun_diff_3b_64k.sh
#   DRY_RUN=1 bash examples/torchrun_diff_3b_64k.sh               # print the command and resolved config
#
# Environment: NPROC=8 RUN_DIR=runs/diff-3b-64k-node TP=2 CP=2 MICRO_BATCH=1 INIT_CKPT (the 3B
# checkpoints; default runs/diff-3b-1T-node/checkpoints, read while CKPT_DIR holds none) DATA_PATH
# (default: the builtin corpus) CKPT_DIR=$RUN_DIR/checkpoints (restarts resume from it) EXTRA_ARGS
# (appended last) PYTHON=python3 DRY_RUN=
set -euo pipefail
cd "$(dirname "$0")/.."
nproc=${NPROC:-8}
run=${RUN_DIR:-runs/diff-3b-64k-node}
ckpt=${CKPT_DIR:-$run/checkpoints}
read -r -a data <<<"${DATA_PATH:-builtin}"
read -r -a extra <<<"${EXTRA_ARGS:-}"
args=(pretrain_diff.py --model diff-3b-64k --tensor-model-parallel-size "${TP:-2}"
    --context-parallel-size "${CP:-2}" --sequence-parallel --micro-batch-size "${MICRO_BATCH:-1}"
    --recompute-granularity full --use-distributed-optimizer --bf16 --data-path "${data[@]}"
    --load "$ckpt" --pretrained-checkpoint "${INIT_CKPT:-runs/diff-3b-1T-node/checkpoints}" --save "$ckpt"
    --save-interval 50 --log-interval 1 --tensorboard-dir "$run/tensorboard"
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
