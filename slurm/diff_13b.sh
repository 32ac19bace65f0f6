#!/usr/bin/env bash
# DIFF-13.1B, the largest point of the paper's scaling sweep, on 8 nodes of 8 H100: slurm/diff_scaling.sh
# 13.1b with a larger default allocation (same run directory, so either script resumes the other's run).
#
#   sbatch slurm/diff_13b.sh                          # 8 nodes x 8 H100, TP 4 (+SP), DP 16
#   ARCH=transformer sbatch slurm/diff_13b.sh         # its Transformer twin (transformer-13.1b)
#   DRY_RUN=1 bash slurm/diff_13b.sh                  # print the srun line and resolved config
#
# The paper's values come from the diff-13.1b preset (checked by tests/slurm): 40 layers, hidden 5120,
# FFN 13632, 20 differential heads of 128 (40 for the Transformer), seq 2048, 128 x 2048 = 0.25M-token
# batches, 40000 steps, lr 7.5e-5 with 375 warmup steps then linear to 0, AdamW (0.9, 0.98), wd 0.05.
#
# Environment (this recipe's defaults; slurm/common.sh describes every knob):
#   ARCH=diff  NODES=8 GPUS_PER_NODE=8 (for DRY_RUN; in a job the allocation decides)  TP=4 PP=1 CP=1
#   MICRO_BATCH=2  DP= (derived; set it to have it checked)  DATA_PATH= (required)
#   RUN_DIR=runs/diff-13.1b  CKPT_DIR=$RUN_DIR/checkpoints  TB_DIR=$RUN_DIR/tensorboard
#   CONTAINER_IMAGE=  CONTAINER_MOUNTS=  EXTRA_ARGS= (pretrain_diff.py flags appended last: they override)
#   PRECISION=bf16 DIST_OPTIMIZER=1 SEQUENCE_PARALLEL=1 RECOMPUTE= SAVE_INTERVAL=1000 LOG_INTERVAL=10
#   EVAL_INTERVAL=1000 EVAL_ITERS=10 AUTO_REQUEUE=1 MAX_RESTARTS=100 PYTHON=python3 SRUN_ARGS= DRY_RUN=
#
#SBATCH --job-name=diff-13b
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --signal=USR1@600
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail

# sbatch runs a copy of this file from Slurm's spool directory: find the checkout.
for DIFFMEG_ROOT in "${DIFFMEG_ROOT:-}" "$(dirname "${BASH_SOURCE[0]}")/.." \
    "$(scontrol show job "${SLURM_JOB_ID:-0}" 2>/dev/null | sed -n 's|^ *Command=\(.*\)/slurm/[^/]*$|\1|p')" \
    "${SLURM_SUBMIT_DIR:-.}"; do
    [ -f "$DIFFMEG_ROOT/slurm/diff_scaling.sh" ] && break
done
RECIPE_FILE=${BASH_SOURCE[0]}  # its #SBATCH lines are the DRY_RUN defaults
[ -f "$DIFFMEG_ROOT/slurm/diff_scaling.sh" ] || {
    echo "cannot find the diffmeg checkout (slurm/diff_scaling.sh): set DIFFMEG_ROOT" >&2
    exit 2
}
# shellcheck source=slurm/diff_scaling.sh
source "$DIFFMEG_ROOT/slurm/diff_scaling.sh" 13.1b
