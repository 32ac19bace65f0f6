#!/usr/bin/env bash
# A CPU-scale comparison that learns: DIFF V1, DIFF V2, GDA 4:1 (when this checkout has them) and the
# Transformer on multi-query associative recall (MQAR) at several difficulties, and on language modelling at
# equal tokens. Everything trains through pretrain_diff.py. Results: OUT/results.json, OUT/plots/*.png and
# OUT/tables.md (the tables of docs/results.md, from tools/toy_compare_results.py).
#
#   bash examples/toy_compare.sh                 # the full comparison (~80 minutes on 2 idle cores, est.)
#   TOY_SMOKE=1 bash examples/toy_compare.sh     # a ~5-minute version of every step (what CI runs)
#
# MQAR (diffmeg/data/mqar.py): per setting, training documents from seed 0, a validation set (seed 1)
# and a held-out test set (seed 2); the loss counts only the queried values (a loss-masked dataset).
# Models: the `<model>-tiny` presets' architecture at TOY_LAYERS x TOY_HIDDEN, head size kept and
# heads scaled with the width, so DIFF and the Transformer keep the presets' identical projections
# (DIFF: h heads of two sub-heads and a 2d value; Transformer: 2h heads of d). Protocol: every learning
# rate of TOY_LRS with the first seed; the one with the best final validation accuracy is the model's
# rate for that setting, and the other seeds run at it. Held-out accuracy is measured at every
# TOY_EVAL_EVERY steps from saved checkpoints (tools/eval_mqar.py), so steps to 90% are known to
# that resolution. Analyses of the final checkpoints at each model's chosen rate (every seed) on the
# held-out documents, in OUT/analysis/SETTING/: the attention at the answers on the queried key-value
# pair vs the rest of the context per layer, DIFF's maps divided by 1 - lambda so that all models are on
# one scale (tools/eval_mqar.py --attention), and activation outliers (tools/activation_stats.py).
# Language modelling: the tiny presets unchanged on the embedded corpus (cl100k_base tokenizer needed),
# TOY_LM_ITERS iterations each, validation loss every TOY_LM_EVAL_EVERY.
#
# Environment (defaults in brackets; TOY_SMOKE=1 shrinks the starred ones):
#   TOY_OUT [runs/toy_compare]     output directory, recreated (only one this script made is emptied)
#   TOY_MODELS [auto]              diff transformer (+ diff2 when pretrain_diff.py has --diff-version, + gda
#                                  when it has --num-noise-heads)
#   TOY_SETTINGS* [4:4:0 8:4:0 8:4:2]  MQAR settings, pairs:queries:distractors-per-pair
#   TOY_LRS* [1e-3 3e-3]           learning rates swept with the first seed
#   TOY_SEEDS* [1 2 3]             seeds (the first also sweeps the learning rate)
#   TOY_ITERS* [3000]              MQAR training steps per run, of TOY_BATCH [64] documents
#   TOY_EVAL_EVERY* [150]          steps between held-out evaluations (checkpoints)
#   TOY_LAYERS [2], TOY_HIDDEN [64], TOY_VOCAB [256]
#   TOY_INIT_STD [0.05]            MQAR --init-method-std: with the presets' 0.02, 1 of 21 pilot runs
#                                  left the loss plateau within 2000 steps; with 0.05 DIFF V1 and the
#                                  Transformer learned kv8-q4 by step 400-600
#   TOY_EVAL_DOCS [512]            held-out and validation documents evaluated per checkpoint
#   TOY_LM_ITERS* [100]            language-modelling iterations (the tiny presets' 4 x 256 tokens each)
#   TOY_LM_EVAL_EVERY* [20]        iterations between validation losses (4 batches each)
#   TOY_LM=1                       0 skips language modelling (no tokenizer needed then)
#   TOY_ANALYSIS=1                 0 skips the attention and activation-outlier analyses
#   TOY_JOBS [2]                   runs at once, TOY_THREADS [1] threads each
#   PYTHON=python3
set -euo pipefail
# shellcheck source=examples/common.sh
source "$(dirname "$0")/common.sh"  # in the checkout, running its code: root, py
out=${TOY_OUT:-runs/toy_compare}
smoke=${TOY_SMOKE:-0}
# full() FULL SMOKE: the full run's default, or the smoke run's (the starred variables above)
full() { if [ "$smoke" = 1 ]; then echo "$2"; else echo "$1"; fi; }
settings=${TOY_SETTINGS:-$(full "4:4:0 8:4:0 8:4:2" "4:2:0 4:2:1")}
lrs=${TOY_LRS:-1e-3 3e-3}
iters=${TOY_ITERS:-$(full 3000 30)}
eval_every=${TOY_EVAL_EVERY:-$(full 150 10)}
lm_iters=${TOY_LM_ITERS:-$(full 100 6)}
lm_eval_every=${TOY_LM_EVAL_EVERY:-$(full 20 3)}
eval_docs=${TOY_EVAL_DOCS:-$(full 512 64)}
read -r -a seeds <<<"${TOY_SEEDS:-$(full "1 2 3" "1 2")}"
read -r -a settings <<<"$settings"
read -r -a lrs <<<"$lrs"
batch=${TOY_BATCH:-64}
layers=${TOY_LAYERS:-2}
hidden=${TOY_HIDDEN:-64}
vocab=${TOY_VOCAB:-256}
init_std=${TOY_INIT_STD:-0.05}
run_lm=${TOY_LM:-1}
run_analysis=${TOY_ANALYSIS:-1}
jobs=${TOY_JOBS:-2}
export OMP_NUM_THREADS=${TOY_THREADS:-1}  # one thread per run was fastest on 2 cores (two runs at once)
export TORCHDYNAMO_DISABLE=1

step 0/6 "checking the environment"
"$py" -c "import diffmeg, torch, matplotlib, importlib.util as u; assert u.find_spec('megatron.core')" \
    || die "diffmeg's dependencies are missing: run scripts/setup.sh"
if [ "${TOY_MODELS:-auto}" = auto ]; then
    models=(diff transformer)
    help=$("$py" pretrain_diff.py --help 2>/dev/null || true)
    if grep -q -- --num-noise-heads <<<"$help"; then
        models=(diff diff2 gda transformer)
    elif grep -q -- --diff-version <<<"$help"; then
        models=(diff diff2 transformer)
    fi
else
    read -r -a models <<<"$TOY_MODELS"
fi
if [ "$run_lm" = 1 ]; then
    "$py" -c "from diffmeg.data.tiktoken_cl100k import load_tokenizer; load_tokenizer(None)" 2>/dev/null \
        || die "language modelling needs the cl100k_base tokenizer: set DIFFMEG_TOKENIZER_FILE (or TOY_LM=0)"
fi
fresh_output_dir TOY_OUT
mkdir -p "$out/data" "$out/mqar" "$out/lm"
echo "models: ${models[*]}; MQAR settings (pairs:queries:distractors): ${settings[*]};" \
    "learning rates: ${lrs[*]}"

# Each model's architecture flags: the <model>-tiny preset at this depth and width, head size kept.
declare -A arch
for model in "${models[@]}"; do
    arch[$model]=$("$py" pretrain_diff.py --model "$model-tiny" --dry-run 2>/dev/null \
        | "$py" tools/toy_compare_results.py model-flags --layers "$layers" --hidden "$hidden") \
        || die "no usable $model-tiny preset in this checkout (TOY_MODELS, TOY_HIDDEN)"
    echo "  $model: ${arch[$model]}"
done

lm_tokens=$("$py" pretrain_diff.py --model diff-tiny --dry-run 2>/dev/null \
    | "$py" -c "import json, sys; print(json.load(sys.stdin)['batch']['tokens_per_batch'])")
meta_args=()
for model in "${models[@]}"; do meta_args+=("$model" "${arch[$model]}"); done
"$py" - "$out/meta.json" "${meta_args[@]}" <<EOF
import json, sys, time
pairs = sys.argv[2:]
json.dump({
    "date": time.strftime("%Y-%m-%d %H:%M"), "smoke": "$smoke" == "1", "models": pairs[0::2],
    "arch": dict(zip(pairs[0::2], pairs[1::2])), "settings": [],
    "lrs": [float(x) for x in "${lrs[*]}".split()], "seeds": [int(x) for x in "${seeds[*]}".split()],
    "mqar_iters": $iters, "mqar_batch": $batch, "eval_every": $eval_every, "eval_docs": $eval_docs,
    "layers": $layers, "hidden": $hidden, "vocab": $vocab, "init_method_std": $init_std,
    "lm_iters": $lm_iters, "lm_eval_every": $lm_eval_every, "lm_tokens_per_iter": $lm_tokens, "jobs": $jobs,
    "threads_per_run": $OMP_NUM_THREADS,
}, open(sys.argv[1], "w"), indent=1)
EOF

step 1/6 "generating MQAR data (vocabulary $vocab)"
declare -A seq_of
names=()
for s in "${settings[@]}"; do
    IFS=: read -r pairs queries distractors <<<"$s"
    [ -n "$distractors" ] || die "TOY_SETTINGS entries are pairs:queries:distractors, got '$s'"
    # the name MQARSetting.name gives: kv16, kv16-q8, kv8-q4-d4
    name="kv$pairs"
    [ "$queries" = "$pairs" ] || name+="-q$queries"
    [ "$distractors" = 0 ] || name+="-d$distractors"
    names+=("$name")
    # one fresh document per training sample, plus the validation and test sets
    "$py" tools/make_mqar_data.py --output-prefix "$out/data/$name" --vocab-size "$vocab" --pairs "$pairs" \
        --queries "$queries" --distractors "$distractors" --documents $((iters * batch)) \
        --heldout-documents "$eval_docs" --seed 0 | tail -n 1
    seq_of[$name]=$("$py" -c "import json,sys; print(json.load(open(sys.argv[1]))['seq_length'])" \
        "$out/data/$name.mqar.json")
done
"$py" - "$out/meta.json" "${names[@]}" <<'EOF'
import json, sys
meta = json.load(open(sys.argv[1]))
meta["settings"] = sys.argv[2:]
json.dump(meta, open(sys.argv[1], "w"), indent=1)
EOF

# A small pool: at most $jobs runs at once; every run prints one progress line when it ends.
launched=0 total=0
pool() {
    while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
    [ ! -e "$out/.failed" ] || return 0  # stop launching after a failure; drain reports it
    launched=$((launched + 1))
    { "$@" "[$launched/$total]" || touch "$out/.failed"; } &
}
drain() {
    wait
    [ ! -e "$out/.failed" ] || die "a run failed (its log is named above)"
}

mqar_run() {  # mqar_run SETTING MODEL LR SEED TAG
    local name=$1 model=$2 lr=$3 seed=$4 tag=$5
    local dir t0=$SECONDS
    dir="$out/mqar/$name/$model/lr$(printf '%g' "$lr")-s$seed"  # 3e-3 and 0.003 name one directory
    mkdir -p "$dir"
    # shellcheck disable=SC2086  # arch flags are words
    if ! "$py" pretrain_diff.py ${arch[$model]} --vocab-size "$vocab" --tokenizer-type null \
        --data-path "$out/data/$name" --split 1,0,0 --seq-length "${seq_of[$name]}" \
        --max-position-embeddings "${seq_of[$name]}" --micro-batch-size "$batch" \
        --global-batch-size "$batch" --train-iters "$iters" --init-method-std "$init_std" \
        --lr "$lr" --min-lr "$lr" --lr-decay-style constant --lr-warmup-iters $((iters / 20 + 1)) \
        --adam-beta1 0.9 --adam-beta2 0.98 --weight-decay 0.1 \
        --seed "$seed" --eval-iters 0 --log-interval "$eval_every" --save "$dir/ckpt" \
        --save-interval "$eval_every" --metrics-file "$dir/metrics.jsonl" >"$dir/train.log" 2>&1; then
        echo "$tag FAILED: mqar $name $model lr $lr seed $seed (log: $dir/train.log)" >&2
        tail -n 20 "$dir/train.log" >&2
        return 1
    fi
    local trained=$((SECONDS - t0))
    "$py" tools/eval_mqar.py --load "$dir/ckpt" --all-iterations --max-documents "$eval_docs" \
        --data-prefix "$out/data/$name-test" "$out/data/$name-valid" --output-dir "$dir/eval" \
        >"$dir/eval.log" 2>&1 || { echo "$tag FAILED: evaluating $dir (log: $dir/eval.log)" >&2; return 1; }
    # keep the final checkpoint (for the attention analyses), drop the intermediate ones
    local last
    last=$(cat "$dir/ckpt/latest_checkpointed_iteration.txt")
    find "$dir/ckpt" -maxdepth 1 -name 'iter_*' ! -name "$(printf 'iter_%07d' "$last")" -exec rm -rf {} +
    "$py" - "$dir" "$name" "$model" "$lr" "$seed" "$iters" "$batch" "${seq_of[$name]}" "$trained" \
        $((SECONDS - t0)) "$tag" <<'EOF'
import json, os, sys
d, name, model, lr, seed, iters, batch, seq, trained, total, tag = sys.argv[1:]
ms = [r["elapsed_ms"] for r in map(json.loads, open(os.path.join(d, "metrics.jsonl"))) if "elapsed_ms" in r]
run = {"kind": "mqar", "setting": name, "model": model, "lr": float(lr), "seed": int(seed),
       "iters": int(iters), "global_batch_size": int(batch), "seq_length": int(seq),
       "train_seconds": int(trained), "seconds": int(total), "ms_per_iter": min(ms) if ms else None}
json.dump(run, open(os.path.join(d, "run.json"), "w"), indent=1)
results = json.load(open(os.path.join(d, "eval", "mqar_summary.json")))["results"]
test = [r for r in results if r["data_prefix"].endswith("-test")]
valid = [r for r in results if r["data_prefix"].endswith("-valid")][-1]["accuracy"]
hit = next((r["iteration"] for r in test if r["accuracy"] >= 0.9), None)
print(f"{tag} mqar {name:8s} {model:11s} lr {float(lr):<6g} seed {seed}: held-out {test[-1]['accuracy']:.3f} "
      f"(valid {valid:.3f}), steps to 90%: {hit or '-'}, {total}s ({run['ms_per_iter'] or 0:.0f} ms/step)",
      flush=True)
EOF
}

what="${#lrs[@]} rates x ${#models[@]} models x ${#names[@]} settings, seed ${seeds[0]}"
step 2/6 "MQAR learning-rate sweep: $what"
total=$((${#names[@]} * ${#models[@]} * ${#lrs[@]})) launched=0
for name in "${names[@]}"; do
    for model in "${models[@]}"; do
        for lr in "${lrs[@]}"; do pool mqar_run "$name" "$model" "$lr" "${seeds[0]}"; done
    done
done
drain

step 3/6 "MQAR: the other seeds at each model's chosen learning rate"
total=$((${#names[@]} * ${#models[@]} * (${#seeds[@]} - 1))) launched=0
declare -A chosen_lr
for name in "${names[@]}"; do
    for model in "${models[@]}"; do
        best=$("$py" tools/toy_compare_results.py best-lr "$out" --model "$model" --setting "$name")
        chosen_lr[$name/$model]=$best
        for seed in "${seeds[@]:1}"; do pool mqar_run "$name" "$model" "$best" "$seed"; done
    done
done
drain

analysis_run() {  # analysis_run SETTING KIND TAG: KIND attention or outliers, on every model's final
    # checkpoints at its chosen rate (all seeds, labelled MODEL-sSEED), over the held-out documents
    local name=$1 kind=$2 tag=$3
    local dir="$out/analysis/$name" t0=$SECONDS loads=() labels=() model seed
    mkdir -p "$dir"
    for model in "${models[@]}"; do
        for seed in "${seeds[@]}"; do
            loads+=("$out/mqar/$name/$model/lr$(printf '%g' "${chosen_lr[$name/$model]}")-s$seed/ckpt")
            labels+=("$model-s$seed")
        done
    done
    local cmd=(tools/eval_mqar.py --attention --max-documents "$eval_docs")
    if [ "$kind" = outliers ]; then
        cmd=(tools/activation_stats.py --per-document --tokens $((eval_docs * ${seq_of[$name]})))
    fi
    if ! "$py" "${cmd[@]}" --load "${loads[@]}" --label "${labels[@]}" --data-prefix "$out/data/$name-test" \
        --output-dir "$dir/$kind" >"$dir/$kind.log" 2>&1; then
        echo "$tag FAILED: $kind analysis of $name (log: $dir/$kind.log)" >&2
        tail -n 20 "$dir/$kind.log" >&2
        return 1
    fi
    "$py" - "$dir/$kind" "$name" "$kind" $((SECONDS - t0)) "$tag" <<'EOF'
import json, os, sys
from collections import defaultdict
d, name, kind, seconds, tag = sys.argv[1:]
by_model = defaultdict(list)  # label MODEL-sSEED -> (a, b) per seed (and layer)
if kind == "attention":
    for r in json.load(open(os.path.join(d, "mqar_attention.json")))["results"]:
        for layer in r["layers"]:
            m = layer["normalised"]
            by_model[r["label"].rpartition("-s")[0]].append((m["pair"], m["noise"]))
    what = "normalised pair / noise at the answers (mean over layers, seeds)"
else:
    for c in json.load(open(os.path.join(d, "activation_stats.json")))["checkpoints"]:
        s = c["stats"]["hidden_states"]
        by_model[c["label"].rpartition("-s")[0]].append((s["top1"], s["kurtosis"]))
    what = "hidden states' top-1 / kurtosis (mean over seeds)"
cells = [f"{m} {sum(a for a, _ in v) / len(v):.3g} / {sum(b for _, b in v) / len(v):.3g}"
         for m, v in by_model.items()]
print(f"{tag} {kind:9s} {name:8s}: {what}: {', '.join(cells)}; {seconds}s", flush=True)
EOF
}

if [ "$run_analysis" = 1 ]; then
    step 4/6 "analyses of the final checkpoints: attention at the answers, activation outliers"
    total=$((${#names[@]} * 2)) launched=0
    for name in "${names[@]}"; do
        for kind in attention outliers; do pool analysis_run "$name" "$kind"; done
    done
    drain
else
    step 4/6 "analyses skipped (TOY_ANALYSIS=0)"
fi

lm_run() {  # lm_run MODEL SEED TAG: the tiny preset on the embedded corpus, validation loss curve
    local model=$1 seed=$2 tag=$3
    local dir="$out/lm/$model/s$seed" t0=$SECONDS
    mkdir -p "$dir"
    if ! "$py" pretrain_diff.py --model "$model-tiny" --train-iters "$lm_iters" \
        --eval-interval "$lm_eval_every" --eval-iters 4 --log-interval "$lm_eval_every" --seed "$seed" \
        --data-cache-path "$dir/cache" \
        --metrics-file "$dir/metrics.jsonl" >"$dir/train.log" 2>&1; then
        echo "$tag FAILED: lm $model seed $seed (log: $dir/train.log)" >&2
        tail -n 20 "$dir/train.log" >&2
        return 1
    fi
    "$py" - "$dir" "$model" "$seed" "$lm_tokens" $((SECONDS - t0)) "$tag" <<'EOF'
import json, os, sys
d, model, seed, tokens, total, tag = sys.argv[1:]
records = [json.loads(line) for line in open(os.path.join(d, "metrics.jsonl"))]
valid = [r["validation_lm_loss"] for r in records if "validation_lm_loss" in r]
ms = [r["elapsed_ms"] for r in records if "elapsed_ms" in r]
run = {"kind": "lm", "model": model, "seed": int(seed), "tokens_per_iter": int(tokens),
       "seconds": int(total), "ms_per_iter": min(ms) if ms else None}
json.dump(run, open(os.path.join(d, "run.json"), "w"), indent=1)
print(f"{tag} lm {model:11s} seed {seed}: validation loss {valid[0]:.3f} -> {valid[-1]:.3f}, {total}s "
      f"({run['ms_per_iter'] or 0:.0f} ms/step)", flush=True)
EOF
}

if [ "$run_lm" = 1 ]; then
    step 5/6 "language modelling: ${models[*]} x ${#seeds[@]} seeds, $lm_iters iterations each"
    total=$((${#models[@]} * ${#seeds[@]})) launched=0
    for model in "${models[@]}"; do
        for seed in "${seeds[@]}"; do pool lm_run "$model" "$seed"; done
    done
    drain
else
    step 5/6 "language modelling skipped (TOY_LM=0)"
fi

step 6/6 "results.json, plots and tables"
"$py" tools/toy_compare_results.py collect "$out"
"$py" tools/toy_compare_results.py tables "$out/results.json" | tee "$out/tables.md"
printf '\n== done in %ds: %s/results.json, %s/plots, %s/tables.md\n' $((SECONDS - started)) \
    "$out" "$out" "$out"
