#!/usr/bin/env bash
# Install diffmeg with its CPU test dependencies into the current Python. Idempotent; safe to re-run.
#
#   bash scripts/setup.sh            # core + dev, MPI, HF, eval, harness and wandb extras
#
# torch is installed first and only if missing, so an existing (CUDA) torch is kept and pip never
# resolves a multi-GB CUDA build on a CPU machine. Everything else comes at the versions the suite passed
# with (scripts/constraints.txt; pyproject.toml keeps ranges for library users).
# If a local cl100k_base BPE file is available
# ($DIFFMEG_TOKENIZER_FILE, or ../shared/data/cl100k_base.tiktoken beside the checkout), it is placed
# in tiktoken's cache so offline machines tokenize without a download.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

# A re-run on an installed environment skips pip (~30 s of resolving) when nothing it installs from has
# changed: the stamp holds this Python, pyproject.toml and the constraints, and every package must still be
# found, diffmeg in this checkout. Delete .setup-stamp (or set DIFFMEG_SETUP_FORCE=1) to install anyway.
stamp_key() {
    (cd / && "$PY" -c 'import sys; print(sys.executable, sys.prefix)') 2>/dev/null
    cat pyproject.toml scripts/constraints.txt
}
installed_here() {
    local checkout=$PWD
    (cd / && "$PY" - "$checkout" <<'PY'
import importlib.util, os, sys
need = ("torch", "megatron.core", "transformers", "lm_eval", "deepspeed", "mpi4py", "pytest", "ruff", "wandb")
here = os.path.join(os.path.realpath(sys.argv[1]), "diffmeg", "__init__.py")
spec = importlib.util.find_spec("diffmeg")
ok = spec is not None and os.path.realpath(spec.origin) == here
sys.exit(0 if ok and all(importlib.util.find_spec(m) for m in need) else 1)
PY
    ) 2>/dev/null
}
key=$(stamp_key | sha256sum | cut -d' ' -f1)
if [ -z "${DIFFMEG_SETUP_FORCE:-}" ] && [ "$(cat .setup-stamp 2>/dev/null)" = "$key" ] && installed_here; then
    echo "setup: already installed from this checkout (pip skipped; DIFFMEG_SETUP_FORCE=1 to re-install)"
else
    rm -f .setup-stamp
    if ! "$PY" -c "import torch" 2>/dev/null; then
        "$PY" -m pip install -q "torch==2.13.0"
    fi
    # harness: lm-eval for tools/eval_harness.py and its tests (~2.5 min the first time; keeps the torch).
    "$PY" -m pip install -q -c scripts/constraints.txt -e ".[dev,mpi,hf,eval,harness,wandb,yaml]"
    # deepspeed (FLOPs-profiler cross-check; Ulysses reference design) without compiling its CUDA ops.
    "$PY" -c "import deepspeed" 2>/dev/null \
        || DS_BUILD_OPS=0 "$PY" -m pip install -q -c scripts/constraints.txt "deepspeed>=0.15"
    echo "$key" > .setup-stamp
    installed=1
fi

# Seed tiktoken's cache (file name = sha1 of the BPE URL, contents checked against tiktoken's sha256).
bpe=${DIFFMEG_TOKENIZER_FILE:-../shared/data/cl100k_base.tiktoken}
cache=${TIKTOKEN_CACHE_DIR:-${DATA_GYM_CACHE_DIR:-/tmp/data-gym-cache}}
if [ -f "$bpe" ] && [ ! -f "$cache/9b5ad71b2ce5302211f9c61530b329a4922fc6a4" ]; then
    if echo "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7  $bpe" | sha256sum -c --status; then
        mkdir -p "$cache" && cp "$bpe" "$cache/9b5ad71b2ce5302211f9c61530b329a4922fc6a4"
        echo "setup: cl100k_base placed in tiktoken's cache ($cache)"
    else
        echo "setup: $bpe is not the cl100k_base file tiktoken expects (sha256 mismatch); ignoring it" >&2
    fi
fi
if [ -f .setup-stamp ] && [ "${installed:-}" != 1 ]; then  # skipped: versions from metadata, no imports
    versions=$("$PY" -c 'from importlib.metadata import version as v
print("torch", v("torch"), "megatron-core", v("megatron-core"))')
else
    versions=$("$PY" -c 'import diffmeg, torch, megatron.core as m
print("torch", torch.__version__, "megatron-core", m.__version__)')
fi
echo "setup: done ($versions)"
