# shellcheck shell=bash
# Shared by the examples; sourced, never run on its own. Sourcing it moves to the checkout (`root`) and
# makes Python run this checkout's code, installed or not (`py` is the interpreter, PYTHON=python3).
# `example` is the sourcing script's name (quickstart for quickstart.sh: error lines and the marker of its
# output directory); the CPU examples set `out` (their output directory) before calling fresh_output_dir.
# shellcheck disable=SC2154  # out is the sourcing script's

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit
root=$PWD
example=$(basename "$0" .sh)
py=${PYTHON:-python3}
case ":${PYTHONPATH:-}:" in
    *":$root:"*) ;;
    *) export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" ;;
esac
export PYTHONUNBUFFERED=1  # progress lines as they come

started=$SECONDS
step() { printf '\n== [%s] %s (%ds elapsed)\n' "$1" "$2" $((SECONDS - started)); }
die() {
    echo "$example: error: $*" >&2
    exit 1
}

# Recreate $out, refusing a non-empty directory this example did not make (marked by .$example), so
# nothing a user put there is ever deleted. $1 is the variable that sets it, for the error message.
fresh_output_dir() {
    if [ -e "$out" ] && [ ! -e "$out/.$example" ] && [ -n "$(ls -A "$out")" ]; then
        die "$out exists and was not made by this script; set $1 to a new directory"
    fi
    rm -rf "$out"
    mkdir -p "$out"
    touch "$out/.$example"
    echo "output directory: $out"
}

# torchrun_pretrain RUN_NAME TP ARGS...: pretrain_diff.py ARGS (the paper's run) on one node with torchrun,
# at tensor-parallel size TP (--sequence-parallel with it when TP > 1), in bf16 with the distributed
# optimizer and, when NPROC > TP, overlapped gradient reduce-scatters and weight all-gathers, resuming
# from and saving to its checkpoints. `init_ckpt`, when the script sets it, is the
# --pretrained-checkpoint read while CKPT_DIR holds none. The launcher is torchrun through `python3 -m
# diffmeg.launch` (the same flags): bad input is one line, without torchrun's traceback after it.
# Environment of every torchrun example:
#   NPROC=8             processes (GPUs)
#   RUN_DIR             the run's directory (default runs/RUN_NAME): tensorboard/, metrics.jsonl
#   CKPT_DIR            checkpoints (default $RUN_DIR/checkpoints); --load and --save, so restarts resume
#   DATA_PATH           a dataset prefix or a "w1 p1 w2 p2" blend (default: builtin, the embedded corpus)
#   EXTRA_ARGS          pretrain_diff.py flags appended last: they override the example's
#   PYTHON=python3      interpreter (its torch.distributed.run, which is torchrun, under diffmeg.launch)
#   DRY_RUN=1           print the torchrun line, then `pretrain_diff.py --dry-run`'s resolved configuration
#                       and its checks (missing datasets are an error; ignored flags, memory), start nothing
torchrun_pretrain() {
    local run=${RUN_DIR:-runs/$1} tp=$2
    shift 2
    local ckpt=${CKPT_DIR:-$run/checkpoints} nproc=${NPROC:-8} data_words extra_words
    read -r -a data_words <<<"${DATA_PATH:-builtin}"
    read -r -a extra_words <<<"${EXTRA_ARGS:-}"
    local args=(pretrain_diff.py "$@" --tensor-model-parallel-size "$tp")
    if ((tp > 1)); then args+=(--sequence-parallel); fi  # at TP 1 pretrain_diff.py would drop it
    args+=(--use-distributed-optimizer --bf16 --data-path "${data_words[@]}" --load "$ckpt")
    [ -z "${init_ckpt:-}" ] || args+=(--pretrained-checkpoint "$init_ckpt")
    if ((nproc / tp > 1)); then args+=(--overlap-grad-reduce --overlap-param-gather); fi  # DP x CP > 1
    args+=(--save "$ckpt" --tensorboard-dir "$run/tensorboard" --metrics-file "$run/metrics.jsonl"
        "${extra_words[@]}")
    local launcher=("$py" -m diffmeg.launch)
    local cmd=("${launcher[@]}" --standalone --nproc_per_node "$nproc" "${args[@]}")
    if [ "${DRY_RUN:-0}" = 1 ]; then
        printf '%q ' "${cmd[@]}"
        printf '\n\n'
        WORLD_SIZE=$nproc exec "$py" "${args[@]}" --dry-run
    fi
    mkdir -p "$ckpt"
    exec "${cmd[@]}"
}
