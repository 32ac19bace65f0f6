#!/usr/bin/env bash
# The DIFF paper's retrieval story at toy scale, on a CPU: train diff-tiny and its FLOP-matched twin
# transformer-tiny on the same generated multi-needle corpus for the same budget, then run the needle
# evaluation, the attention-to-answer/noise measurement and the activation statistics on both, and
# print the side-by-side tables. About 35 minutes on 2 idle cores at the defaults; the results are in
# docs/results.md.
#
#   bash examples/toy_retrieval.sh
#   TOY_ITERS=20 TOY_SAMPLES=2 TOY_TOKENS=4096 bash examples/toy_retrieval.sh     # a smoke run
#
# The corpus is token ids (no tokenizer, --tokenizer-type null): every TOY_SEQ-token document is a needle
# prompt in the evaluation's own id format (random-id filler, 1-6 needles "city -> number", 1-2 queried)
# followed by its answer; see tools/make_needle_corpus.py. The evaluation prompts come from other
# seeds, so answers must be retrieved from the context, not remembered.
# Environment:
#   TOY_OUT=runs/toy_retrieval   everything goes here; recreated on every run (only a directory this
#                                script made before, marked by .toy_retrieval, is ever emptied)
#   TOY_ITERS=1000               training iterations per model (TOY_BATCH x TOY_SEQ tokens each)
#   TOY_SEQ=128, TOY_BATCH=32    document = window length, and documents per iteration
#   TOY_SAMPLES=20               needle prompts per (N, R, depth); attention-score prompts per depth
#   TOY_TOKENS=65536             activation-statistics token budget
#   TOY_SEED=1234                training and evaluation seed
#   PYTHON=python3
set -euo pipefail
# shellcheck source=examples/common.sh
source "$(dirname "$0")/common.sh"  # in the checkout, running its code: root, py
out=${TOY_OUT:-runs/toy_retrieval}
iters=${TOY_ITERS:-1000}
samples=${TOY_SAMPLES:-20}
tokens=${TOY_TOKENS:-65536}
seed=${TOY_SEED:-1234}
vocab=512
seq=${TOY_SEQ:-128}
batch=${TOY_BATCH:-32}

step 0/5 "checking the environment"
"$py" -c "import diffmeg, torch, matplotlib, importlib.util as u; assert u.find_spec('megatron.core')" \
    || die "diffmeg's dependencies are missing: run scripts/setup.sh"
fresh_output_dir TOY_OUT
mkdir -p "$out/data"

step 1/5 "generating the multi-needle corpus"
# Enough documents that no training window repeats, plus a 2% validation split.
docs=$((iters * batch * 102 / 100 + 64))
"$py" tools/make_needle_corpus.py --output-prefix "$out/data/needles" --vocab-size "$vocab" \
    --seq-length "$seq" --documents "$docs" --seed 0

train() {  # train PRESET NAME: the same data, budget and schedule for both models
    local preset=$1 name=$2
    echo "(full log: $out/$name.log)"
    if ! "$py" pretrain_diff.py --model "$preset" --data-path "$out/data/needles" --tokenizer-type null \
        --vocab-size "$vocab" --seq-length "$seq" --max-position-embeddings "$seq" \
        --global-batch-size "$batch" --micro-batch-size "$batch" --train-iters "$iters" \
        --lr-warmup-iters $((iters / 20 + 1)) --split 98,2,0 --eval-interval "$iters" --eval-iters 4 \
        --seed "$seed" --save "$out/ckpt/$name" --metrics-file "$out/$name.metrics.jsonl" \
        --log-interval $((iters / 10 + 1)) 2>&1 | tee "$out/$name.log" \
        | grep --line-buffered -E "iteration +[0-9]+/|validation loss|^error|Error"; then
        tail -n 30 "$out/$name.log" >&2
        die "training $preset failed (log: $out/$name.log)"
    fi
}

step 2/5 "training diff-tiny and transformer-tiny, $iters iterations of $batch x $seq tokens each"
train diff-tiny diff
train transformer-tiny transformer
models=(--load "$out/ckpt/diff" "$out/ckpt/transformer" --label DIFF Transformer)
# Evaluation prompts as long as the training documents' prompts, so prompt and answer sit at trained
# positions (a document is prompt, answer of up to 5 ids and the end-of-document id).
length=$((seq - 8))

step 3/5 "multi-needle retrieval (tools/eval_needle.py)"
"$py" tools/eval_needle.py "${models[@]}" --lengths "$length" --needles 1 2 4 6 --queries 1 2 \
    --heatmap-needles 6 --samples "$samples" --seed "$seed" --output-dir "$out/needle"

step 4/5 "attention to the answer vs noise (tools/attention_scores.py)"
"$py" tools/attention_scores.py "${models[@]}" --length "$length" --num-needles 4 --num-queries 1 \
    --samples "$samples" --seed "$seed" --output-dir "$out/attention"

step 5/5 "activation outliers (tools/activation_stats.py)"
"$py" tools/activation_stats.py "${models[@]}" --data-prefix "$out/data/needles" --tokens "$tokens" \
    --seed "$seed" --output-dir "$out/activations"

"$py" - "$out" <<'EOF'
import json
import sys

out = sys.argv[1]
for name in ("diff", "transformer"):
    records = [json.loads(line) for line in open(f"{out}/{name}.metrics.jsonl")]
    train = [r["lm_loss"] for r in records if "lm_loss" in r]
    valid = [r["validation_lm_loss"] for r in records if "validation_lm_loss" in r]
    last = f", validation {valid[-1]:.3f}" if valid else ""
    print(f"{name:12s} lm loss {train[0]:.3f} -> {train[-1]:.3f}{last}")
EOF
printf '\n== done in %ds: tables and plots under %s/{needle,attention,activations}\n' \
    $((SECONDS - started)) "$out"
