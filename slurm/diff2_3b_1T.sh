#!/usr/bin/env bash
# DIFF V2 3B on 1T tokens: the paper's 3B run (DESIGN.md "Paper recipes") with DIFF V2 attention.
#
#   sbatch slurm/diff2_3b_1T.sh                                   # 16 nodes x 8 H100 (128 GPUs)
#   sbatch --nodes=128 slurm/diff2_3b_1T.sh                       # 1024 GPUs (DP 1024, one micro-batch each)
#   DRY_RUN=1 bash slurm/diff2_3b_1T.sh                           # print the srun line and resolved config
#
# Identical to slurm/diff_3b_1T.sh and slurm/transformer_3b_1T.sh except for the attention. The values
# come from the diff2-3b preset (checked by tests/slurm): 28 layers, hidden 3072, FFN 8192, 24 DIFF V2
# heads of 128 (48 query heads over 24 KV heads, a per-token lambda per head), untied output layer,
# 4,053,543,936 parameters, seq 4096, 1024 x 4096 = 4M-token batches,
# 238419 iterations = 1T tokens, lr 3.2e-4 with 1000 warmup iterations then linear to 1.28e-5,
# AdamW (0.9, 0.95), weight decay 0.1, vocab 100288 (cl100k_base). Run it with resume: every start
# loads the newest checkpoint in CKPT_DIR; SIGUSR1 five minutes before the time limit saves and requeues.
#
# Environment (this recipe's defaults; slurm/common.sh describes every knob):
#   NODES=16 GPUS_PER_NODE=8 (for DRY_RUN; in a job the allocation decides)  TP=1 PP=1 CP=1
#   DP= (derived: NODES x GPUS_PER_NODE / (TP x PP x CP); set it to have it checked)  MICRO_BATCH=1
#   DATA_PATH= (required: prefix or "w1 p1 w2 p2 ..." blend)  RUN_DIR=runs/diff2-3b-1T
#   CKPT_DIR=$RUN_DIR/checkpoints  TB_DIR=$RUN_DIR/tensorboard  CONTAINER_IMAGE=  CONTAINER_MOUNTS=
#   EXTRA_ARGS= (pretrain_diff.py flags appended last: they override the recipe's)
#   PRECISION=bf16 DIST_OPTIMIZER=1 SEQUENCE_PARALLEL=1 RECOMPUTE= SAVE_INTERVAL=1000 LOG_INTERVAL=10
#   EVAL_INTERVAL=1000 EVAL_ITERS=10 AUTO_REQUEUE=1 MAX_RESTARTS=100 PYTHON=python3 SRUN_ARGS= DRY_RUN=
#
#SBATCH --job-name=diff2-3b-1T
#SBATCH --nodes=16
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --signal=USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail

# sbatch runs a copy of this file from Slurm's spool directory: find the checkout.
for DIFFMEG_ROOT in "${DIFFMEG_ROOT:-}" "$(dirname "${BASH_SOURCE[0]}")/.." \
    "$(scontrol show job "${SLURM_JOB_ID:-0}" 2>/dev/null | sed -n 's|^ *Command=\(.*\)/slurm/[^/]*$|\1|p')" \
    "${SLURM_SUBMIT_DIR:-.}"; do
    [ -f "$DIFFMEG_ROOT/slurm/common.sh" ] && break
done
[ -f "$DIFFMEG_ROOT/slurm/common.sh" ] || {
    echo "cannot find the diffmeg checkout (slurm/common.sh): set DIFFMEG_ROOT" >&2
    exit 2
}
# shellcheck source=slurm/common.sh
source "$DIFFMEG_ROOT/slurm/common.sh"

RECIPE_NAME=diff2-3b-1T
RECIPE_FILE=${BASH_SOURCE[0]}
: "${TP:=1}" "${PP:=1}" "${CP:=1}" "${MICRO_BATCH:=1}"
diffmeg_launch --model diff2-3b
