#!/usr/bin/env bash
# Grouped differential attention (GDA, Motif-3's DIFF V2 style) 3B on 1T tokens: the paper's 3B run
# (DESIGN.md "Paper recipes") with 4:1 grouped DIFF V2 attention.
#
#   sbatch slurm/gda_3b_1T.sh                                     # 16 nodes x 8 H100 (128 GPUs)
#   DRY_RUN=1 bash slurm/gda_3b_1T.sh                             # print the srun line and resolved config
#
# Identical to slurm/diff2_3b_1T.sh except for the attention. The values come from the gda-3b preset
# (checked by tests/slurm): 28 layers, hidden 3072, FFN 8192, 24 signal heads of 128 sharing 6 noise heads
# (30 query heads over 6 KV heads, a KV head per group of 4 signal heads and their noise head, a per-token
# lambda per signal head), untied output layer, 3,459,001,344 parameters, seq 4096, 1024 x 4096 =
# 4M-token batches, 238419 iterations = 1T tokens, lr 3.2e-4 with 1000 warmup iterations then linear to
# 1.28e-5, AdamW (0.9, 0.95), weight decay 0.1, vocab 100288 (cl100k_base).
# Knobs: slurm/common.sh (all at their defaults here; DATA_PATH is required); run directory
# runs/gda-3b-1T.
#
#SBATCH --job-name=gda-3b-1T
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

RECIPE_NAME=gda-3b-1T
diffmeg_launch --model gda-3b
