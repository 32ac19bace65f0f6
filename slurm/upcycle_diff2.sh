#!/usr/bin/env bash
# Continued pretraining of a Transformer upcycled into DIFF V2 (docs/conversion.md "Upcycling a
# Transformer into DIFF V2"), and with ARCH=transformer the same continuation of the source Transformer,
# so that the two are compared like with like: same tokens, data, schedule and layout.
#
#   python tools/convert_checkpoint.py upcycle --load hf/Llama-3.2-1B --save ckpt/llama-1b-diff2   # once
#   python tools/convert_checkpoint.py hf-to-mcore --load hf/Llama-3.2-1B --save ckpt/llama-1b     # once
#   python tools/preprocess_data.py --input 'corpus/*.jsonl' --output-prefix data/llama --append-eod \
#       --tokenizer-type HuggingFaceTokenizer --tokenizer-model hf/Llama-3.2-1B   # the source's tokenizer
#   INIT_CKPT=ckpt/llama-1b-diff2 DATA_PATH=data/llama_text_document sbatch slurm/upcycle_diff2.sh
#   ARCH=transformer INIT_CKPT=ckpt/llama-1b DATA_PATH=data/llama_text_document sbatch slurm/upcycle_diff2.sh
#   DRY_RUN=1 INIT_CKPT=ckpt/llama-1b-diff2 DATA_PATH=... bash slurm/upcycle_diff2.sh   # srun line, config
#
# The source may also be a transformer-* checkpoint of pretrain_diff.py (upcycle it, and give the
# checkpoint itself as INIT_CKPT with ARCH=transformer).
#
# Model: --use-checkpoint-args takes the shape and the tokenizer from INIT_CKPT's args.json (the upcycled
# DIFF V2 has the source's layers, widths, RoPE base, epsilon and vocabulary, 2h query heads over its g KV
# heads: one noise head per head, the only exact upcycle, so no grouped attention); --diff-attention --diff-version 2 (or --no-diff-attention) makes a mix-up of INIT_CKPT and ARCH
# fail at load instead of training the wrong model. The data must be tokenized with the source's
# tokenizer: pretrain_diff.py (and DRY_RUN) refuse datasets whose .tokenizer.json names another.
# Starting point: --pretrained-checkpoint INIT_CKPT (weights only: fresh optimizer, schedule, counters)
# while CKPT_DIR holds no checkpoint of this run; every requeue then resumes from CKPT_DIR.
#
# Values, this recipe's choices for continued pretraining (not a paper's; change them with the knobs):
#   TOKENS=20e9         training tokens (--train-tokens; iterations = TOKENS / (GLOBAL_BATCH x SEQ_LENGTH))
#   SEQ_LENGTH=4096, GLOBAL_BATCH=1024   4M-token batches, the paper's
#   LR=3e-5             peak learning rate: about a tenth of a pretraining peak, so the copied weights are
#                       not knocked away from the source (the new lambda_proj starts at 0 and learns from it)
#   MIN_LR=3e-6, WARMUP=200 iterations (linear), then cosine decay to MIN_LR; AdamW (0.9, 0.95), weight
#   decay 0.1, gradient clipping 1.0
#
# Knobs (slurm/common.sh) this recipe sets: ARCH=diff2 (or transformer), INIT_CKPT (required), TOKENS,
# SEQ_LENGTH, GLOBAL_BATCH, LR, MIN_LR, WARMUP (above), NODES=4, SAVE_INTERVAL=500; DATA_PATH is required;
# run directory runs/upcycle-<arch>.
#
#SBATCH --job-name=upcycle-diff2
#SBATCH --nodes=4
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

arch=${ARCH:-diff2}
case $arch in
    diff2) model=(--diff-attention --diff-version 2) ;;
    transformer) model=(--no-diff-attention) ;;
    *) _dm_die "ARCH must be diff2 (the upcycled model) or transformer (the source), not '$arch'" ;;
esac
[ -n "${INIT_CKPT:-}" ] || _dm_die "set INIT_CKPT to the checkpoint to continue: the upcycled DIFF V2" \
    "(tools/convert_checkpoint.py upcycle) or, with ARCH=transformer, the source Transformer's"
RECIPE_NAME=upcycle-$arch
: "${SAVE_INTERVAL:=500}"
diffmeg_launch --use-checkpoint-args "${model[@]}" --seq-length "${SEQ_LENGTH:-4096}" \
    --global-batch-size "${GLOBAL_BATCH:-1024}" --train-tokens "$(printf '%.0f' "${TOKENS:-20e9}")" \
    --lr "${LR:-3e-5}" --min-lr "${MIN_LR:-3e-6}" --lr-warmup-iters "${WARMUP:-200}" --lr-decay-style cosine \
    --adam-beta1 0.9 --adam-beta2 0.95 --weight-decay 0.1 --clip-grad 1.0
