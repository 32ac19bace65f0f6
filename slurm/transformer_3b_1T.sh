#!/usr/bin/env bash
# Transformer-3B on 1T tokens: the FLOP-matched baseline of the paper's DIFF-3B run (DESIGN.md "Paper
# recipes"), identical to slurm/diff_3b_1T.sh except for the attention.
#
#   sbatch slurm/transformer_3b_1T.sh                              # 16 nodes x 8 H100 (128 GPUs)
#   DRY_RUN=1 bash slurm/transformer_3b_1T.sh                      # print the srun line and resolved config
#   NODES=128 DRY_RUN=1 bash slurm/transformer_3b_1T.sh            # check a 1024-GPU run
#
# The paper's values come from the transformer-3b preset (checked by tests/slurm): 28 layers, hidden
# 3072, FFN 8192, 24 heads of 128 (the projections of DIFF's 12 differential heads), seq 4096,
# 1024 x 4096 = 4M-token batches, 238419 iterations = 1T tokens, lr 3.2e-4 with 1000 warmup iterations
# then linear to 1.28e-5, AdamW (0.9, 0.95), weight decay 0.1, vocab 100288 (cl100k_base).
# Knobs: slurm/common.sh (all at their defaults here; DATA_PATH is required); run directory
# runs/transformer-3b-1T.
#
#SBATCH --job-name=transformer-3b-1T
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
# sbatch runs a copy of this file from Slurm's spool: the job's script path names the checkout (common.sh).
# shellcheck source=slurm/common.sh
source "${DIFFMEG_ROOT:-$(scontrol show job "${SLURM_JOB_ID:-0}" 2>/dev/null |
    sed -n 's|^ *Command=\(.*/slurm\)/[^/]*$|\1|p' | grep . || dirname "$0")/..}/slurm/common.sh"

RECIPE_NAME=transformer-3b-1T
diffmeg_launch --model transformer-3b
