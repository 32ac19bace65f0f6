# shellcheck shell=bash
# Launch logic shared by the slurm/ recipes. Sourced by them, never run or submitted on its own.
#
# A recipe is its #SBATCH header, then (after sourcing this file) its run name, layout defaults and
#     RECIPE_NAME=<run name>
#     : "${TP:=1}" ...
#     diffmeg_launch <pretrain_diff.py arguments carrying the paper's values: a --model preset>
# which either prints the command and the resolved configuration (DRY_RUN=1, outside Slurm) or, inside
# the job, records the run and starts one task per GPU with srun.
#
# Finding this file: sbatch runs a copy of the recipe from Slurm's spool directory, so a recipe cannot
# look beside itself inside a job. It sources "$DIFFMEG_ROOT/slurm/common.sh" when DIFFMEG_ROOT is set,
# else the checkout of the script the job was submitted as (`scontrol show job`: Command=<path>/slurm/
# <recipe>.sh), else (outside Slurm) its own checkout. This file then sets DIFFMEG_ROOT from its own path.
#
# Every recipe resumes: each start --load's the newest complete checkpoint of CKPT_DIR, and #SBATCH
# --signal=USR1@<seconds> makes training save and exit before the time limit, after which the job requeues
# itself (AUTO_REQUEUE). docs/recipes.md explains the run directory, resume and requeue.
#
# Environment knobs of every recipe, with their defaults (a recipe's header names the ones it changes):
#   DRY_RUN=1          print the srun command line and the resolved configuration JSON
#                      (`pretrain_diff.py --dry-run` with WORLD_SIZE = NODES x GPUS_PER_NODE), start nothing;
#                      then its checks: the datasets of DATA_PATH (missing ones are an error), flags the run
#                      ignores (note:), a per-GPU memory plan that does not fit GPU_MEMORY_GIB (warning:)
#   NODES, GPUS_PER_NODE   the cluster for DRY_RUN (default: the recipe's #SBATCH --nodes and
#                      --ntasks-per-node). Inside a job the allocation decides: sbatch --nodes=N ...
#   TP=1, PP=1, CP=1   tensor / pipeline / context parallel sizes
#   DP                 optional check: fail unless NODES x GPUS_PER_NODE / (TP x PP x CP) equals it
#   MICRO_BATCH=1      micro-batch size (the global batch is the paper's; see each recipe)
#   SEQUENCE_PARALLEL=1 (passed only at TP > 1: it splits activations over tensor-parallel ranks),
#   DIST_OPTIMIZER=1, PRECISION=bf16 (bf16|fp16|fp32), RECOMPUTE= (|selective|full)
#   CE_CHUNK_SIZE=     --cross-entropy-chunk-size: the output layer and loss over this many tokens at a
#                      time, the whole logits never held (long context); empty: the whole logits
#   OVERLAP=1          overlap data-parallel communication with compute where DP x CP > 1:
#                      --overlap-grad-reduce, and --overlap-param-gather with the distributed optimizer
#   GPU_MEMORY_GIB=80  the GPU memory the memory plan must fit (--gpu-memory-gib), e.g. 141 on H200
#   ASYNC_SAVE=1       --async-save: checkpoints are written in the background while training goes on
#                      (the tracker moves once every rank's files are written); 0: every save stalls the job
#   DATA_PATH          a dataset prefix or a blend "w1 prefix1 w2 prefix2 ..." (docs/data.md); required
#                      unless EXTRA_ARGS has --mock-data or --data-path ("builtin" = the embedded corpus).
#                      Relative paths here and below mean the directory sbatch was run from. Datasets on
#                      read-only storage get their index cache in ~/.cache/diffmeg/datasets/ (one line
#                      says so); nodes or containers without a shared home: EXTRA_ARGS="--data-cache-path
#                      DIR" with DIR on storage every node sees (docs/data.md, "The index cache").
#   RUNS_ROOT          parent of run directories (default <checkout>/runs)
#   RUN_NAME, RUN_DIR  the run's directory (default $RUNS_ROOT/<recipe run name>); shared by all jobs of
#                      the run: jobs/<job id>/ (train.log, config.json, git.txt, command.sh, env.txt),
#                      metrics.jsonl, and the two below
#   CKPT_DIR           checkpoints (default $RUN_DIR/checkpoints); always --load and --save, so every
#                      (re)start resumes from the latest complete checkpoint
#   INIT_CKPT          (recipes that continue another run) --pretrained-checkpoint: the weights to start
#                      from while CKPT_DIR holds no checkpoint of this run yet
#   TB_DIR             tensorboard (default $RUN_DIR/tensorboard)
#   SAVE_INTERVAL=1000, LOG_INTERVAL=10, EVAL_INTERVAL=1000, EVAL_ITERS=10
#   CONTAINER_IMAGE    run inside this image with pyxis (srun --container-image)
#   CONTAINER_MOUNTS   pyxis --container-mounts (default <checkout>:<checkout>; add your data and
#                      checkpoint file systems, e.g. "/lustre:/lustre,$PWD:$PWD")
#   PYTHON=python3     interpreter (inside the container when CONTAINER_IMAGE is set)
#   SRUN_ARGS          extra srun flags, e.g. "--cpu-bind=none --mpi=pmix"
#   AUTO_REQUEUE=1     when training stopped early (SIGUSR1 before the time limit, --exit-interval) with
#                      progress saved, requeue this job; it resumes from the checkpoint. MAX_RESTARTS=100
#   CONFIG             a TOML, YAML or JSON file of pretrain_diff.py flags (--config; a run's saved
#                      arguments.json is one): what the recipe does not set, e.g. data, W&B, the schedule.
#                      The recipe's flags and EXTRA_ARGS override it, as every command-line flag does;
#                      each job keeps a copy in jobs/<job id>/
#   EXTRA_ARGS         appended last to pretrain_diff.py's arguments, so they override the recipe's
#                      (flags only; split on whitespace)
#   DIFFMEG_ROOT       the checkout (found automatically, see above)

DIFFMEG_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
RECIPE_FILE=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")  # its #SBATCH lines are the DRY_RUN defaults

_dm_log() { echo "diffmeg-slurm: $*" >&2; }
_dm_die() {
    _dm_log "error: $*"
    exit 2
}

# A #SBATCH default of the recipe file (for DRY_RUN outside Slurm).
_dm_sbatch_default() {
    sed -n "s/^#SBATCH --$1=\([0-9]*\).*/\1/p" "$RECIPE_FILE" | head -n 1
}

# The iteration recorded in a checkpoint directory's tracker file, or nothing.
_dm_tracker() {
    local f=$1/latest_checkpointed_iteration.txt
    [ -f "$f" ] && tr -d '[:space:]' <"$f"
    return 0
}

# A scalar of the dry-run JSON (`"key": value` on one line; pretrain_diff.py prints it indented).
_dm_json_field() {
    sed -n -e "s/^ *\"$1\": \"\(.*\)\",\{0,1\}$/\1/p" -e "s/^ *\"$1\": \([^\",]*\),\{0,1\}$/\1/p" "$2" \
        | head -n 1
}

_dm_flag_value() {  # the value EXTRA_ARGS gives a flag (the last one wins), else the default ($2)
    local i value=$2
    for ((i = 0; i < ${#_DM_EXTRA[@]}; i++)); do
        case ${_DM_EXTRA[i]} in
            "$1") value=${_DM_EXTRA[i + 1]:-$value} ;;
            "$1"=*) value=${_DM_EXTRA[i]#*=} ;;
        esac
    done
    echo "$value"
}

_dm_abs() {  # a path made absolute against the directory the recipe was started from
    case $1 in
        /*) echo "$1" ;;
        *) echo "$_DM_START_DIR/$1" ;;
    esac
}

_dm_python_messages() {  # a Python stderr file without library warnings (UserWarning lines, warnings.warn)
    grep -v -E '^[^ ]+:[0-9]+: [A-Za-z]*Warning: |^ +warnings\.warn\(' "$1" || true
}

_dm_has_flag() {  # is one of the flags among the words of EXTRA_ARGS?
    local word flag
    for word in "${_DM_EXTRA[@]}"; do
        for flag in "$@"; do [ "$word" = "$flag" ] && return 0; done
    done
    return 1
}

diffmeg_launch() {
    local recipe_args=("$@") root=$DIFFMEG_ROOT
    _DM_START_DIR=$PWD  # relative paths in the knobs mean this directory (the submit directory in a job)
    cd "$root"
    export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"  # run this checkout's code (its SHA is recorded)
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
    export PYTHONUNBUFFERED=1  # log lines reach train.log and the Slurm output as they are printed
    local python=${PYTHON:-python3}
    read -r -a _DM_EXTRA <<<"${EXTRA_ARGS:-}"

    local dry=${DRY_RUN:-0} nodes gpn world
    if [ "$dry" = 1 ]; then
        nodes=${NODES:-$(_dm_sbatch_default nodes)}
        gpn=${GPUS_PER_NODE:-$(_dm_sbatch_default ntasks-per-node)}
    else
        [ -n "${SLURM_JOB_ID:-}" ] || _dm_die "not inside a Slurm job: submit it with sbatch $RECIPE_FILE," \
            "or check it first with DRY_RUN=1 bash $RECIPE_FILE"
        nodes=${SLURM_JOB_NUM_NODES:?}
        world=${SLURM_NTASKS:-$((nodes * ${SLURM_NTASKS_PER_NODE:-1}))}
        gpn=$((world / nodes))
        if [ -n "${NODES:-}" ] && [ "$NODES" != "$nodes" ]; then
            _dm_log "note: NODES=$NODES is ignored inside a job; the allocation has $nodes (sbatch --nodes=N)"
        fi
    fi
    world=$((nodes * gpn))
    local tp=${TP:-1} pp=${PP:-1} cp=${CP:-1} mb=${MICRO_BATCH:-1}
    # The layout that will run: EXTRA_ARGS come last on the command line, so their sizes win.
    local run_tp run_pp run_cp
    run_tp=$(_dm_flag_value --tensor-model-parallel-size "$tp")
    run_pp=$(_dm_flag_value --pipeline-model-parallel-size "$pp")
    run_cp=$(_dm_flag_value --context-parallel-size "$cp")
    ((world % (run_tp * run_pp * run_cp) == 0)) || _dm_die "$nodes nodes x $gpn GPUs = $world ranks is not" \
        "divisible by TP $run_tp x PP $run_pp x CP $run_cp"
    local dp=$((world / (run_tp * run_pp * run_cp)))
    if [ -n "${DP:-}" ] && [ "$DP" != "$dp" ]; then
        _dm_die "DP=$DP but $world ranks / (TP $run_tp x PP $run_pp x CP $run_cp) = $dp;" \
            "change NODES or the layout"
    fi

    local runs_root run_dir ckpt tb
    runs_root=$(_dm_abs "${RUNS_ROOT:-$root/runs}")
    run_dir=$(_dm_abs "${RUN_DIR:-$runs_root/${RUN_NAME:-$RECIPE_NAME}}")
    ckpt=$(_dm_abs "${CKPT_DIR:-$run_dir/checkpoints}")
    tb=$(_dm_abs "${TB_DIR:-$run_dir/tensorboard}")
    [ -z "${INIT_CKPT:-}" ] || INIT_CKPT=$(_dm_abs "$INIT_CKPT")
    local config_args=() config=
    if [ -n "${CONFIG:-}" ]; then
        config=$(_dm_abs "$CONFIG")
        [ -f "$config" ] || _dm_die "CONFIG=$CONFIG: no such file (a TOML, YAML or JSON file of flags)"
        config_args=(--config "$config")
    fi

    local data_args=() words=() word
    if [ -n "${DATA_PATH:-}" ]; then
        read -r -a words <<<"$DATA_PATH"
        data_args=(--data-path)
        for word in "${words[@]}"; do  # blend weights and "builtin" stay, dataset prefixes become absolute
            if [[ $word =~ ^[0-9.eE+-]+$ ]] || [ "$word" = builtin ]; then
                data_args+=("$word")
            else
                data_args+=("$(_dm_abs "$word")")
            fi
        done
    elif ! _dm_has_flag --mock-data --data-path; then
        if [ "$dry" = 1 ]; then
            _dm_log "warning: DATA_PATH is not set; the configuration below falls back to the builtin corpus"
        else
            _dm_die "set DATA_PATH to your tokenized corpus (a prefix or a 'w1 p1 w2 p2' blend, see" \
                "docs/data.md), or DATA_PATH=builtin for the embedded demo corpus"
        fi
    fi

    # Resume: always --load the run's own checkpoints. A recipe that continues another run (INIT_CKPT)
    # adds --pretrained-checkpoint: its weights initialise the model only while --load holds nothing.
    local load_args=(--load "$ckpt") resume start_iter
    start_iter=$(_dm_tracker "$ckpt")
    if [ -n "$start_iter" ]; then
        resume="resumes from iteration $start_iter in $ckpt"
    else
        start_iter=0
        resume="fresh start (no checkpoint in $ckpt yet)"
    fi
    if [ -n "${INIT_CKPT:-}" ]; then
        load_args+=(--pretrained-checkpoint "$INIT_CKPT")
        if [ "$start_iter" != 0 ]; then
            :  # resuming this run: the initial weights are not read again
        elif [ -n "$(_dm_tracker "$INIT_CKPT")" ]; then
            resume="starts from the weights of $INIT_CKPT (iteration $(_dm_tracker "$INIT_CKPT")), fresh"
            resume+=" optimizer, schedule and counters"
        elif [ "$dry" = 1 ]; then
            resume="would start from INIT_CKPT=$INIT_CKPT, which holds no checkpoint yet"
            _dm_log "warning: INIT_CKPT=$INIT_CKPT holds no checkpoint (latest_checkpointed_iteration.txt)"
        else
            _dm_die "INIT_CKPT=$INIT_CKPT holds no checkpoint (latest_checkpointed_iteration.txt);" \
                "train the run it continues first, or point INIT_CKPT at its checkpoint directory"
        fi
    fi

    local args=(pretrain_diff.py "${config_args[@]}" "${recipe_args[@]}"
        --tensor-model-parallel-size "$tp" --pipeline-model-parallel-size "$pp"
        --context-parallel-size "$cp" --micro-batch-size "$mb")
    if [ "${SEQUENCE_PARALLEL:-1}" = 1 ] && ((run_tp > 1)); then
        args+=(--sequence-parallel)
    elif [ "${SEQUENCE_PARALLEL:-}" = 1 ]; then  # set by the user, not the default: say why it is left out
        _dm_log "note: SEQUENCE_PARALLEL=1 is not passed: sequence parallelism splits activations over" \
            "tensor-parallel ranks and TP is $run_tp"
    fi
    [ -n "${GPU_MEMORY_GIB:-}" ] && args+=(--gpu-memory-gib "$GPU_MEMORY_GIB")
    [ "${DIST_OPTIMIZER:-1}" = 1 ] && args+=(--use-distributed-optimizer)
    if [ "${OVERLAP:-1}" = 1 ] && ((dp * run_cp > 1)); then
        args+=(--overlap-grad-reduce)
        [ "${DIST_OPTIMIZER:-1}" = 1 ] && args+=(--overlap-param-gather)
    fi
    [ "${ASYNC_SAVE:-1}" = 1 ] && args+=(--async-save)
    case ${PRECISION:-bf16} in
        bf16) args+=(--bf16) ;;
        fp16) args+=(--fp16) ;;
        fp32) ;;
        *) _dm_die "PRECISION must be bf16, fp16 or fp32, not '$PRECISION'" ;;
    esac
    [ -n "${RECOMPUTE:-}" ] && args+=(--recompute-granularity "$RECOMPUTE")
    [ -n "${CE_CHUNK_SIZE:-}" ] && args+=(--cross-entropy-chunk-size "$CE_CHUNK_SIZE")
    args+=("${data_args[@]}" "${load_args[@]}" --save "$ckpt"
        --save-interval "${SAVE_INTERVAL:-1000}" --log-interval "${LOG_INTERVAL:-10}"
        --eval-interval "${EVAL_INTERVAL:-1000}" --eval-iters "${EVAL_ITERS:-10}"
        --tensorboard-dir "$tb" --metrics-file "$run_dir/metrics.jsonl"
        "${_DM_EXTRA[@]}")

    local container=() srun_extra=()
    if [ -n "${CONTAINER_IMAGE:-}" ]; then
        container=(--container-image="$CONTAINER_IMAGE" --container-mounts="${CONTAINER_MOUNTS:-$root:$root}"
            --container-workdir="$root")
    fi
    read -r -a srun_extra <<<"${SRUN_ARGS:-}"
    local cmd=(srun --kill-on-bad-exit=1 --nodes="$nodes" --ntasks="$world" --ntasks-per-node="$gpn"
        "${container[@]}" "${srun_extra[@]}" "$python" "${args[@]}")

    if [ "$dry" = 1 ]; then
        echo "# $RECIPE_NAME: $nodes nodes x $gpn GPUs = $world ranks; TP $run_tp x PP $run_pp x CP $run_cp" \
            "-> DP $dp, micro batch $(_dm_flag_value --micro-batch-size "$mb")"
        echo "# run directory $run_dir; checkpoints: $resume"
        printf '%q ' "${cmd[@]}"
        printf '\n\n'
        local err
        err=$(mktemp)
        if ! WORLD_SIZE=$world "$python" "${args[@]}" --dry-run 2>"$err"; then
            _dm_python_messages "$err" >&2
            rm -f "$err"
            _dm_die "pretrain_diff.py rejected this configuration (above)"
        fi
        _dm_python_messages "$err" >&2  # the checks: data found, flags ignored (note:), memory (warning:)
        rm -f "$err"
        return 0
    fi

    # Inside the job: record the run, resolve the configuration once, train, requeue if stopped early.
    local restart=${SLURM_RESTART_COUNT:-0} job_dir=$run_dir/jobs/$SLURM_JOB_ID
    mkdir -p "$job_dir" "$ckpt" "$tb"
    ln -sfn "jobs/$SLURM_JOB_ID" "$run_dir/latest"
    local sha dirty
    sha=$(git -C "$root" rev-parse HEAD 2>/dev/null || echo unknown)
    dirty=$(git -C "$root" status --porcelain --untracked-files=no 2>/dev/null | wc -l || echo "?")
    {
        echo "sha: $sha"
        echo "modified tracked files: $dirty"
        echo "recipe: $RECIPE_FILE ($RECIPE_NAME)"
    } >"$job_dir/git.txt"
    [ "$dirty" = 0 ] || git -C "$root" diff HEAD >"$job_dir/git.diff" 2>/dev/null || true
    [ -z "$config" ] || cp "$config" "$job_dir/"  # a record of the file this job read
    printf '%q ' "${cmd[@]}" >"$job_dir/command.sh"
    echo >>"$job_dir/command.sh"
    local knobs='NODES|GPUS_PER_NODE|TP|PP|CP|DP|MICRO_BATCH|SEQUENCE_PARALLEL|DIST_OPTIMIZER|PRECISION'
    knobs+='|GPU_MEMORY_GIB|CE_CHUNK_SIZE'
    knobs+='|OVERLAP|ASYNC_SAVE'
    knobs+='|RECOMPUTE|DATA_PATH|RUNS_ROOT|RUN_NAME|RUN_DIR|CKPT_DIR|TB_DIR|INIT_CKPT|CONTAINER_[A-Z_]*|PYTHON'
    knobs+='|SRUN_ARGS|CONFIG|EXTRA_ARGS|AUTO_REQUEUE|MAX_RESTARTS|[A-Z]*_INTERVAL|EVAL_ITERS|ARCH|DIFFMEG_[A-Z_]*'
    knobs+='|SLURM_[A-Z_]*'
    env | grep -E "^($knobs)=" | sort >"$job_dir/env.txt" || true

    local resolve=(env WORLD_SIZE="$world" "$python" "${args[@]}" --dry-run)
    if [ -n "${CONTAINER_IMAGE:-}" ]; then  # the batch host may lack the Python environment
        resolve=(srun --nodes=1 --ntasks=1 "${container[@]}" "${resolve[@]}")
    fi
    if ! "${resolve[@]}" >"$job_dir/config.json" 2>"$job_dir/config.err"; then
        _dm_python_messages "$job_dir/config.err" >&2
        _dm_die "pretrain_diff.py rejected the configuration (above); nothing was started"
    fi
    local train_iters save_dir
    train_iters=$(_dm_json_field train_iters "$job_dir/config.json")
    save_dir=$(_dm_json_field save "$job_dir/config.json")
    [ "$save_dir" != null ] || save_dir=""

    {
        echo "=== $RECIPE_NAME: job $SLURM_JOB_ID (restart $restart) on $nodes node(s)" \
            "${SLURM_JOB_NODELIST:-}, $world ranks, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
        echo "=== git $sha ($dirty modified tracked files); run directory $run_dir; $resume"
        echo "=== $(cat "$job_dir/command.sh")"
        _dm_python_messages "$job_dir/config.err" | sed 's/^/=== /'  # data found, notes, memory warnings
    } | tee -a "$job_dir/train.log"

    local rc
    set +e
    "${cmd[@]}" 2>&1 | tee -a "$job_dir/train.log"
    rc=${PIPESTATUS[0]}
    set -e
    if [ "$rc" != 0 ]; then
        echo "=== training exited with status $rc" | tee -a "$job_dir/train.log"
        exit "$rc"
    fi

    local reached
    reached=$(_dm_tracker "${save_dir:-$ckpt}")
    if [ -z "$train_iters" ] || [ -z "$save_dir" ] || [ -z "$reached" ] || ((reached >= train_iters)); then
        echo "=== finished (iteration ${reached:-?} of ${train_iters:-?})" | tee -a "$job_dir/train.log"
        return 0
    fi
    if ((reached <= start_iter)); then
        echo "=== stopped at iteration $reached without progress since $start_iter; not requeueing" \
            | tee -a "$job_dir/train.log"
        exit 1
    fi
    if [ "${AUTO_REQUEUE:-1}" != 1 ] || ((restart >= ${MAX_RESTARTS:-100})); then
        echo "=== stopped at iteration $reached of $train_iters (AUTO_REQUEUE=${AUTO_REQUEUE:-1}," \
            "restart $restart of ${MAX_RESTARTS:-100}); submit again to resume" | tee -a "$job_dir/train.log"
        return 0
    fi
    echo "=== stopped at iteration $reached of $train_iters; requeueing job $SLURM_JOB_ID to resume" \
        | tee -a "$job_dir/train.log"
    if ! scontrol requeue "$SLURM_JOB_ID"; then
        _dm_die "scontrol requeue was refused; submit the recipe again to resume from iteration $reached"
    fi
    sleep 600 &  # Slurm ends this instance of the job now; do not report completion before it does
    wait $!
}
