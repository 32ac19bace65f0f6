#!/usr/bin/env bash
# Continued pretraining of Motif Technologies' Motif-2-12.7B (SIZE=12.7b, the default: grouped differential
# attention) or Motif-2.6B (SIZE=2.6b: DIFF V1) from their Hugging Face folders (docs/conversion.md "Motif
# checkpoints"): the folder is imported once into INIT_CKPT, then trained on any layout.
#
#   python tools/preprocess_data.py --input 'corpus/*.jsonl' --output-prefix data/motif --append-eod \
#       --tokenizer-type HuggingFaceTokenizer --tokenizer-model hf/Motif-2-12.7B   # Motif's tokenizer
#   MOTIF_FOLDER=hf/Motif-2-12.7B INIT_CKPT=ckpt/motif-12.7b DATA_PATH=data/motif_text_document \
#       sbatch slurm/motif_continue.sh
#   SIZE=2.6b MOTIF_FOLDER=hf/Motif-2.6B INIT_CKPT=ckpt/motif-2.6b DATA_PATH=... sbatch slurm/motif_continue.sh
#   DRY_RUN=1 MOTIF_FOLDER=... INIT_CKPT=... DATA_PATH=... bash slurm/motif_continue.sh   # srun line, config
#
# Import: while INIT_CKPT holds no checkpoint, the job first runs (one process, on the batch host)
#   tools/convert_checkpoint.py hf-to-mcore --load MOTIF_FOLDER --save INIT_CKPT
# which streams the folder layer by layer and keeps its tokenizer (INIT_CKPT/tokenizer). A DRY_RUN imports
# nothing: it prints that command and plans from the preset and the folder's tokenizer. Without
# MOTIF_FOLDER, INIT_CKPT must hold the import already.
# Model: --model motif-SIZE (diffmeg/presets.py: the published shape, PolyNorm, Motif's lambda_init and,
# for 12.7b, 8 noise heads; its recipe below); --use-checkpoint-args then takes the shape, RoPE base,
# epsilon and tokenizer from INIT_CKPT's args.json, so what the import recorded wins over the preset. The
# data must be tokenized with the folder's tokenizer: pretrain_diff.py (and DRY_RUN) refuse datasets whose
# .tokenizer.json names another. Starting point: --pretrained-checkpoint INIT_CKPT (weights only: fresh
# optimizer, schedule and counters, as --finetune) while CKPT_DIR holds no checkpoint of this run; every
# requeue then resumes from CKPT_DIR.
#
# Values: the motif-* presets' continued-pretraining recipe (ours, not Motif's: they pretrained with
# MuonClip; AdamW here): 20B tokens of 512 x 4096 (2M-token batches), lr 3e-5 (100 warmup iterations, then
# cosine to 3e-6), AdamW (0.9, 0.95), weight decay 0.1, gradient clipping 1.0. TOKENS, SEQ_LENGTH,
# GLOBAL_BATCH, LR, MIN_LR, WARMUP override them when set.
# Layout (H100 80 GB nodes of 8): 12.7b TP=2 (four of the 8 groups of [signal x 4, noise] a rank) x PP=2
# (20 layers a stage), sequence parallel, the distributed optimizer: 4 nodes give DP=8, 52.5 GiB a GPU by
# the dry run's plan (TP=4 x PP=2: 28.7 GiB, DP=4); 2.6b TP=1, PP=1 (DP=32): 42.2 GiB. Check another
# layout's plan with DRY_RUN=1 (GPU_MEMORY_GIB).
#
# Knobs (slurm/common.sh) this recipe sets: SIZE, MOTIF_FOLDER, INIT_CKPT (required), TP and PP (by SIZE),
# TOKENS, SEQ_LENGTH, GLOBAL_BATCH, LR, MIN_LR, WARMUP (above), NODES=4, SAVE_INTERVAL=500; DATA_PATH is
# required; run directory runs/motif-<size>.
#
#SBATCH --job-name=motif-continue
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

size=${SIZE:-12.7b}
case $size in
    12.7b) : "${TP:=2}" "${PP:=2}" ;;
    2.6b) : "${TP:=1}" "${PP:=1}" ;;
    *) _dm_die "SIZE must be 12.7b (Motif-2-12.7B) or 2.6b (Motif-2.6B), not '$size'" ;;
esac
[ -n "${INIT_CKPT:-}" ] || _dm_die "set INIT_CKPT to the imported checkpoint (with MOTIF_FOLDER, the" \
    "directory the Motif folder is imported into first)"
init=$(_dm_abs "$INIT_CKPT")
model=(--model "motif-$size")
if [ -n "$(_dm_tracker "$init")" ]; then
    model+=(--use-checkpoint-args)
elif [ -n "${MOTIF_FOLDER:-}" ]; then
    folder=$(_dm_abs "$MOTIF_FOLDER")
    [ -f "$folder/config.json" ] || _dm_die "MOTIF_FOLDER=$MOTIF_FOLDER has no config.json: give the" \
        "Motif model's Hugging Face folder (config.json, safetensors, tokenizer)"
    import=("${PYTHON:-python3}" "$DIFFMEG_ROOT/tools/convert_checkpoint.py" hf-to-mcore --load "$folder"
        --save "$init")
    if [ "${DRY_RUN:-0}" = 1 ]; then
        _dm_log "import (not run by DRY_RUN): ${import[*]}"
        model+=(--tokenizer-type HuggingFaceTokenizer --tokenizer-model "$folder")
    else
        _dm_log "importing $folder into $init"
        PYTHONPATH="$DIFFMEG_ROOT${PYTHONPATH:+:$PYTHONPATH}" "${import[@]}"
        model+=(--use-checkpoint-args)
    fi
else
    _dm_die "INIT_CKPT=$INIT_CKPT holds no checkpoint: set MOTIF_FOLDER to the Motif folder to import into" \
        "it, or import it first (tools/convert_checkpoint.py hf-to-mcore --load FOLDER --save $INIT_CKPT)"
fi
recipe=()
[ -n "${TOKENS:-}" ] && recipe+=(--train-tokens "$(printf '%.0f' "$TOKENS")")
recipe+=(--seq-length "${SEQ_LENGTH:-4096}")  # typed: the import records its own as a default
[ -n "${GLOBAL_BATCH:-}" ] && recipe+=(--global-batch-size "$GLOBAL_BATCH")
[ -n "${LR:-}" ] && recipe+=(--lr "$LR")
[ -n "${MIN_LR:-}" ] && recipe+=(--min-lr "$MIN_LR")
[ -n "${WARMUP:-}" ] && recipe+=(--lr-warmup-iters "$WARMUP")
INIT_CKPT=$init
RECIPE_NAME=motif-$size
: "${SAVE_INTERVAL:=500}"
diffmeg_launch "${model[@]}" "${recipe[@]}" --clip-grad 1.0
