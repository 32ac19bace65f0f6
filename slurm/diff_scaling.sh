#!/usr/bin/env bash
# The paper's scaling sweep (DESIGN.md "Paper recipes"): one model size per job, DIFF, DIFF V2, grouped
# differential attention (GDA, V2 style 4:1) or the FLOP-matched Transformer twin, 40K steps of 0.25M
# tokens at seq 2048.
#
#   sbatch slurm/diff_scaling.sh 830m                 # DIFF-830M on one node of 8 H100
#   sbatch slurm/diff_scaling.sh transformer-830m     # its Transformer twin (or ARCH=transformer)
#   sbatch slurm/diff_scaling.sh diff2-830m           # DIFF V2 of the same size (or ARCH=diff2)
#   sbatch slurm/diff_scaling.sh gda-830m             # GDA 4:1 of the same size (or ARCH=gda)
#   sbatch --nodes=4 slurm/diff_scaling.sh 6.8b       # more nodes: only DP grows
#   for s in 830m 1.4b 2.8b 6.8b 13.1b; do for a in diff diff2 transformer; do
#       sbatch slurm/diff_scaling.sh $a-$s; done; done   # the whole sweep, 15 jobs
#   DRY_RUN=1 bash slurm/diff_scaling.sh 2.8b         # print the srun line and resolved config
#
# SIZE is 830m, 1.4b, 2.8b, 6.8b or 13.1b (13b is the same), optionally prefixed with diff-, diff2-, gda- or
# transformer-; without a prefix ARCH=diff|diff2|gda|transformer picks (default diff). slurm/diff_13b.sh
# runs 13.1b on 8 nodes. The paper's values come from the diff-SIZE / transformer-SIZE presets; diff2-SIZE
# has the Transformer's heads as its DIFF V2 heads, gda-SIZE those heads over a quarter as many noise
# heads and KV heads (so gda-13.1b's 10 noise heads take TP 2, not 4) (checked by tests/slurm):
#   size   layers hidden heads DIFF/Transformer  FFN   lr      (all: seq 2048, 128 x 2048 = 0.25M-token
#   830m   24     1536   8 / 16 (head dim 96)     4096  1.5e-4   batches, 40000 steps, 375 warmup, linear
#   1.4b   24     2048   8 / 16                   5440  1.5e-4   decay to 0, AdamW (0.9, 0.98), wd 0.05)
#   2.8b   32     2560   10 / 20                  6784  1.5e-4
#   6.8b   32     4096   16 / 32                  10880 7.5e-5
#   13.1b  40     5120   20 / 40                  13632 7.5e-5
#
# Knobs (slurm/common.sh) this recipe sets: ARCH=diff, NODES=1, and TP / MICRO_BATCH per size (830m 1/4,
# 1.4b 1/4, 2.8b 1/2, 6.8b 2/2, 13.1b 4/2, gda-13.1b 2/1); DATA_PATH is required; run directory
# runs/<arch>-<size>.
#
#SBATCH --job-name=diff-scaling
#SBATCH --nodes=1
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

size=${1:-}
arch=${ARCH:-diff}
case $size in
    diff-* | diff2-* | gda-* | transformer-*)
        arch=${size%%-*}
        size=${size#*-}
        ;;
esac
[ "$size" = 13b ] && size=13.1b
case $arch in diff | diff2 | gda | transformer) ;; *) _dm_die "ARCH must be diff, diff2, gda or transformer, not '$arch'" ;; esac
# gda-13.1b: its 10 noise heads split over TP 2 (a rank holds whole groups of signal heads and noise head)
[ "$arch-$size" = gda-13.1b ] && : "${TP:=2}" "${MICRO_BATCH:=1}"
case $size in
    830m) : "${TP:=1}" "${MICRO_BATCH:=4}" ;;
    1.4b) : "${TP:=1}" "${MICRO_BATCH:=4}" ;;
    2.8b) : "${TP:=1}" "${MICRO_BATCH:=2}" ;;
    6.8b) : "${TP:=2}" "${MICRO_BATCH:=2}" ;;
    13.1b) : "${TP:=4}" "${MICRO_BATCH:=2}" ;;
    *) _dm_die "usage: diff_scaling.sh SIZE with SIZE one of 830m 1.4b 2.8b 6.8b 13.1b (optionally" \
        "diff2-SIZE, gda-SIZE or transformer-SIZE), got '${1:-}'" ;;
esac
RECIPE_NAME=$arch-$size
diffmeg_launch --model "$arch-$size"
