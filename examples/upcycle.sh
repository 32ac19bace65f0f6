#!/usr/bin/env bash
# Upcycling on a CPU: pretrain a Transformer briefly, turn it into DIFF V2 with the same logits
# (tools/convert_checkpoint.py upcycle), then continue both the Transformer and the upcycled DIFF V2 for
# the same tokens and seeds, and compare their validation losses. Everything trains through
# pretrain_diff.py on the embedded corpus (cl100k_base tokenizer needed). Results: OUT/results.json,
# OUT/upcycle_val_loss.png and OUT/tables.md (the section of docs/results.md, from tools/upcycle_results.py).
#
#   bash examples/upcycle.sh                  # the full run (47 minutes here on 2 busy cores: docs/results.md)
#   UPCYCLE_SMOKE=1 bash examples/upcycle.sh  # every step at 2 iterations, one seed (about a minute; CI runs it)
#
# Steps: (1) transformer-tiny (4 layers, hidden 256, 8 heads of 32, the preset's schedule) for
# UPCYCLE_PRETRAIN_ITERS; (2) upcycle its checkpoint: DIFF V2 with 8 output heads (16 query heads over 8
# KV heads) = the diff2-tiny preset's shape, query heads copied in pairs, lambda_proj 0, o_proj doubled;
# (3) per seed, continue the Transformer (--model transformer-tiny) and the upcycled model (--model
# diff2-tiny) from their checkpoints (--pretrained-checkpoint: weights only, a new schedule) for
# UPCYCLE_ITERS steps with the same learning rate, warmup and batches; the validation loss every
# UPCYCLE_EVAL_EVERY steps. The first step's training loss of the two is the same number (the same
# function on the same batch); the seed changes the order of the data (and the validation batches).
#
# Environment (defaults in brackets; UPCYCLE_SMOKE=1 shrinks the starred ones):
#   UPCYCLE_OUT [runs/upcycle]         output directory, recreated (only one this script made is emptied)
#   UPCYCLE_PRETRAIN_ITERS* [150]      pretraining steps of the source Transformer
#   UPCYCLE_ITERS* [60]                continued-training steps per run
#   UPCYCLE_SEEDS* [1 2 3]             seeds of the continued runs
#   UPCYCLE_SEQ* [256], UPCYCLE_BATCH* [2]   sequence length and sequences per step (pretraining too)
#   UPCYCLE_LR [3e-4], UPCYCLE_WARMUP [6]    continued training: peak rate, warmup steps, then cosine to lr/10
#   UPCYCLE_EVAL_EVERY* [10], UPCYCLE_EVAL_ITERS* [4]   validation: every N steps, batches per evaluation
#   UPCYCLE_JOBS [2]                   runs at once, UPCYCLE_THREADS [1] threads each
#   PYTHON=python3
set -euo pipefail
# shellcheck source=examples/common.sh
source "$(dirname "$0")/common.sh"  # in the checkout, running its code: root, py
out=${UPCYCLE_OUT:-runs/upcycle}
smoke=${UPCYCLE_SMOKE:-0}
if [ "$smoke" = 1 ]; then
    pretrain_iters=${UPCYCLE_PRETRAIN_ITERS:-2} iters=${UPCYCLE_ITERS:-2} seeds=${UPCYCLE_SEEDS:-1}
    seq=${UPCYCLE_SEQ:-64} batch=${UPCYCLE_BATCH:-1} eval_every=${UPCYCLE_EVAL_EVERY:-2}
    eval_iters=${UPCYCLE_EVAL_ITERS:-1}
else
    pretrain_iters=${UPCYCLE_PRETRAIN_ITERS:-150} iters=${UPCYCLE_ITERS:-60} seeds=${UPCYCLE_SEEDS:-1 2 3}
    seq=${UPCYCLE_SEQ:-256} batch=${UPCYCLE_BATCH:-2} eval_every=${UPCYCLE_EVAL_EVERY:-10}
    eval_iters=${UPCYCLE_EVAL_ITERS:-4}
fi
read -r -a seeds <<<"$seeds"
lr=${UPCYCLE_LR:-3e-4}
warmup=${UPCYCLE_WARMUP:-6}
jobs=${UPCYCLE_JOBS:-2}
export OMP_NUM_THREADS=${UPCYCLE_THREADS:-1}
export TORCHDYNAMO_DISABLE=1
((warmup < iters)) || warmup=0  # a smoke run shorter than the warmup: none

step 0/4 "checking the environment"
"$py" -c "import diffmeg, torch, matplotlib, importlib.util as u; assert u.find_spec('megatron.core')" \
    || die "diffmeg's dependencies are missing: run scripts/setup.sh"
"$py" -c "from diffmeg.data.tiktoken_cl100k import load_tokenizer; load_tokenizer(None)" 2>/dev/null \
    || die "the embedded corpus needs the cl100k_base tokenizer: set DIFFMEG_TOKENIZER_FILE"
fresh_output_dir UPCYCLE_OUT
mkdir -p "$out/pretrain" "$out/continue"
tokens_per_iter=$((batch * seq))
"$py" - "$out/meta.json" <<EOF
import json, subprocess, sys, time
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
json.dump({
    "date": time.strftime("%Y-%m-%d %H:%M"), "commit": commit or None, "smoke": "$smoke" == "1",
    "pretrain_iters": $pretrain_iters, "iters": $iters, "seeds": [int(s) for s in "${seeds[*]}".split()],
    "seq_length": $seq, "global_batch_size": $batch, "tokens_per_iter": $tokens_per_iter, "lr": $lr,
    "min_lr": $lr / 10, "warmup": $warmup, "eval_every": $eval_every, "eval_iters": $eval_iters,
    "jobs": $jobs, "threads_per_run": $OMP_NUM_THREADS,
}, open(sys.argv[1], "w"), indent=1)
EOF
# The runs' shared flags: the data and batches (the tiny presets' 100288-entry cl100k vocabulary).
common=(--data-path builtin --seq-length "$seq" --micro-batch-size "$batch" --global-batch-size "$batch")

step 1/4 "pretraining transformer-tiny for $pretrain_iters steps of $tokens_per_iter tokens"
t0=$SECONDS
OMP_NUM_THREADS=$((jobs * OMP_NUM_THREADS)) "$py" pretrain_diff.py --model transformer-tiny "${common[@]}" \
    --train-iters "$pretrain_iters" --eval-interval "$pretrain_iters" --eval-iters "$eval_iters" \
    --log-interval 10 --save "$out/pretrain/ckpt" --metrics-file "$out/pretrain/metrics.jsonl" \
    >"$out/pretrain/train.log" 2>&1 || { tail -n 20 "$out/pretrain/train.log" >&2; die "pretraining failed"; }
grep "validation loss" "$out/pretrain/train.log" | tail -n 1
echo "pretrained in $((SECONDS - t0)) s"

step 2/4 "upcycling the Transformer into DIFF V2"
"$py" tools/convert_checkpoint.py upcycle --load "$out/pretrain/ckpt" --save "$out/upcycled" \
    >"$out/upcycle.log" 2>&1 || { cat "$out/upcycle.log" >&2; die "upcycling failed"; }
head -n 1 "$out/upcycle.log"

# A small pool: at most $jobs runs at once; every run prints one line when it ends.
pool() {
    while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
    [ ! -e "$out/.failed" ] || return 0  # stop launching after a failure; the end reports it
    { "$@" || touch "$out/.failed"; } &
}

continue_run() {  # continue_run MODEL SEED: MODEL transformer (from the source) or diff2 (the upcycled)
    local model=$1 seed=$2 t0=$SECONDS dir="$out/continue/$1-s$2" init="$out/pretrain/ckpt"
    [ "$model" = transformer ] || init="$out/upcycled"
    mkdir -p "$dir"
    if ! "$py" pretrain_diff.py --model "$model-tiny" "${common[@]}" --pretrained-checkpoint "$init" \
        --seed "$seed" --train-iters "$iters" --lr "$lr" --min-lr "$("$py" -c "print($lr / 10)")" \
        --lr-warmup-iters "$warmup" --lr-decay-style cosine --eval-interval "$eval_every" \
        --eval-iters "$eval_iters" --log-interval 1 --metrics-file "$dir/metrics.jsonl" >"$dir/train.log" 2>&1
    then
        echo "FAILED: $model seed $seed (log: $dir/train.log)" >&2
        tail -n 20 "$dir/train.log" >&2
        return 1
    fi
    "$py" - "$dir" "$model" "$seed" "$tokens_per_iter" $((SECONDS - t0)) <<'EOF'
import json, os, sys
d, model, seed, tokens, seconds = sys.argv[1:]
records = [json.loads(line) for line in open(os.path.join(d, "metrics.jsonl"))]
run = {"model": model, "seed": int(seed), "tokens_per_iter": int(tokens), "seconds": int(seconds)}
json.dump(run, open(os.path.join(d, "run.json"), "w"), indent=1)
first = next(r["lm_loss"] for r in records if r.get("iteration") == 1)
last = [r["validation_lm_loss"] for r in records if "validation_lm_loss" in r][-1]
print(f"  {model:11s} seed {seed}: first-step loss {first:.6f}, final validation loss {last:.4f} ({seconds} s)",
      flush=True)
EOF
}

step 3/4 "continuing both for $iters steps (seeds ${seeds[*]}), $jobs at a time"
for seed in "${seeds[@]}"; do
    for model in transformer diff2; do pool continue_run "$model" "$seed"; done
done
wait
[ ! -e "$out/.failed" ] || die "a run failed (its log is named above)"

step 4/4 "results"
"$py" - "$out/meta.json" $((SECONDS - started)) <<'EOF'
import json, sys
meta = json.load(open(sys.argv[1]))
meta["wall_seconds"] = int(sys.argv[2])
json.dump(meta, open(sys.argv[1], "w"), indent=1)
EOF
"$py" tools/upcycle_results.py collect "$out" >"$out/results.json"
"$py" tools/upcycle_results.py tables "$out/results.json" | tee "$out/tables.md"
"$py" tools/upcycle_results.py plot "$out/results.json" --output "$out/upcycle_val_loss.png"
echo "done in $((SECONDS - started)) s: $out/results.json, $out/tables.md, $out/upcycle_val_loss.png"
