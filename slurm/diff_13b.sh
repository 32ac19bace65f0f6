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
# Knobs (slurm/common.sh and slurm/diff_scaling.sh) this recipe sets: ARCH=diff, NODES=8, TP=4,
# MICRO_BATCH=2; DATA_PATH is required; run directory runs/<arch>-13.1b.
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
# sbatch runs a copy of this file from Slurm's spool: the job's script path names the checkout (common.sh).
# shellcheck source=slurm/diff_scaling.sh
source "${DIFFMEG_ROOT:-$(scontrol show job "${SLURM_JOB_ID:-0}" 2>/dev/null |
    sed -n 's|^ *Command=\(.*/slurm\)/[^/]*$|\1|p' | grep . || dirname "$0")/..}/slurm/diff_scaling.sh" 13.1b
