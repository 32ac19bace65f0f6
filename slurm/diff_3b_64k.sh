#!/usr/bin/env bash
# The paper's 64K-context extension of DIFF-3B (DESIGN.md "Paper recipes"): continue the 3B run's final
# checkpoint for 1.5B tokens at seq 65536 with RoPE theta 640000, lr 8e-5, 4M-token batches
# (64 x 65536 = 358 iterations) on the length-upsampled corpus. ARCH=transformer runs the same
# extension of the Transformer-3B baseline (the paper compares the two at 64K; its context parallelism
# is megatron-core's ring attention, so it needs Transformer Engine: --transformer-impl transformer_engine).
#
#   python tools/length_upsample.py --input data/corpus_text_document --output-prefix data/up64k \
#       --target-length 65536 --long-factor 4 --train-tokens 1.5e9          # once: the blend (docs/data.md)
#   DATA_PATH="$(cat data/up64k_weights.txt)" sbatch slurm/diff_3b_64k.sh   # 8 nodes x 8 H100
#   DRY_RUN=1 bash slurm/diff_3b_64k.sh                                     # srun line and resolved config
#
# Values: the diff-3b-64k preset (checked by tests/slurm): the 3B model (28 layers, hidden 3072, FFN
# 8192, 12 differential heads of 128) at seq 65536, RoPE theta 640000, global batch 64, lr 8e-5,
# 358 iterations = 1.5B tokens, AdamW (0.9, 0.95), wd 0.1. The paper gives no warmup or decay for this
# stage; the preset's choice is 20 warmup iterations and cosine decay to 8e-6 (AdamW restarts from zero).
#
# Starting point: --pretrained-checkpoint INIT_CKPT (the 3B run's checkpoints) initialises the weights
# while CKPT_DIR holds no checkpoint of this run, with fresh optimizer state, LR schedule, iteration
# and sample counters (what --finetune does); once this run has saved, every requeue resumes from
# CKPT_DIR with its full state. Not --override-opt-param-scheduler --no-load-optim: that keeps the 3B
# run's iteration (238419, past this run's 358 iterations, so nothing would train) and its
# consumed-sample offset into a different corpus. Not a plain --finetune: a requeued job would start over
# from the 3B weights instead of resuming.
#
# Layout: differential heads are split whole over TP and over the Ulysses CP ranks, so 12 heads allow
# TP x CP in {1, 2, 4} within a node. TP 2 (+ sequence parallel) x CP 2 puts one 64K sequence on 4 GPUs:
# two model replicas per node, DP 16 on 8 nodes, 4 micro-batches per step. Full activation recompute, and
# the loss in chunks of 2048 tokens (CE_CHUNK_SIZE: the 32K tokens' logits over half the vocabulary would
# be the largest tensor of the step): ~18 GiB per GPU by the dry-run memory plan ("memory_per_gpu_gib";
# 30 GiB with the whole logits). The plan is an estimate; measure on the cluster before the full run
# (docs/recipes.md).
#
# Knobs (slurm/common.sh) this recipe sets: ARCH=diff (or transformer), NODES=8, TP=2 CP=2 RECOMPUTE=full,
# CE_CHUNK_SIZE=2048, SAVE_INTERVAL=50 LOG_INTERVAL=1 EVAL_INTERVAL=50,
# INIT_CKPT=$RUNS_ROOT/<arch>-3b-1T/checkpoints;
# DATA_PATH (the length-upsampled blend) is required; run directory runs/<arch>-3b-64k.
#
#SBATCH --job-name=diff-3b-64k
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=12:00:00
#SBATCH --signal=USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail
# sbatch runs a copy of this file from Slurm's spool: the job's script path names the checkout (common.sh).
# shellcheck source=slurm/common.sh
source "${DIFFMEG_ROOT:-$(scontrol show job "${SLURM_JOB_ID:-0}" 2>/dev/null |
    sed -n 's|^ *Command=\(.*/slurm\)/[^/]*$|\1|p' | grep . || dirname "$0")/..}/slurm/common.sh"

arch=${ARCH:-diff}
case $arch in diff | transformer) ;; *) _dm_die "ARCH must be diff or transformer, not '$arch'" ;; esac
RECIPE_NAME=$arch-3b-64k
: "${TP:=2}" "${CP:=2}" "${RECOMPUTE=full}" "${CE_CHUNK_SIZE=2048}"
: "${SAVE_INTERVAL:=50}" "${LOG_INTERVAL:=1}" "${EVAL_INTERVAL:=50}"
: "${INIT_CKPT:=${RUNS_ROOT:-$DIFFMEG_ROOT/runs}/$arch-3b-1T/checkpoints}"
impl=()  # the baseline's context parallelism is megatron-core's ring attention, in Transformer Engine only
[ "$arch" = diff ] || impl=(--transformer-impl transformer_engine)
diffmeg_launch --model "$arch-3b-64k" "${impl[@]}"
