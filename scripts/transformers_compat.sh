#!/usr/bin/env bash
# The Hugging Face export tests (pytest -m hf_export: transformers loads each exported family, computes our
# logits and generates the same tokens with and without its KV cache) against another transformers release,
# in a throwaway virtual environment over this Python's packages.
#
#   bash scripts/transformers_compat.sh oldest   # the lowest version pyproject.toml's range admits
#   bash scripts/transformers_compat.sh newest   # the registry's newest (skipped when it is the pinned one)
#   bash scripts/transformers_compat.sh 5.17.0   # any version
#
# CI runs `newest`, so a transformers release that breaks an export fails CI the day it ships, naming the
# version, while setup.sh keeps installing the tested one (scripts/constraints.txt); `oldest` is run by hand
# when pyproject.toml's range or the exports change.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
which=${1:?usage: transformers_compat.sh oldest|newest|VERSION}
pinned=$(sed -n 's/^transformers==//p' scripts/constraints.txt)
case "$which" in
    oldest) version=$(sed -n 's/.*"transformers>=\([0-9.]*\)".*/\1/p' pyproject.toml) ;;
    newest) version=$("$PY" -m pip index versions transformers 2>/dev/null | sed -n 's/^transformers (\(.*\))$/\1/p') ;;
    *) version=$which ;;
esac
if [ -z "$version" ]; then
    echo "transformers_compat: cannot tell which version '$which' is (pyproject.toml or the registry)" >&2
    exit 1
fi
if [ "$version" = "$pinned" ]; then
    echo "transformers_compat: $which is $version, the pinned version the suite just ran with; nothing more to check"
    exit 0
fi
venv=$(mktemp -d "${TMPDIR:-/tmp}/transformers-$version.XXXXXX")
trap 'rm -rf "$venv"' EXIT
"$PY" -m venv --system-site-packages "$venv"
# transformers and only what it needs changed (tokenizers, huggingface-hub); the rest is this Python's
log="$venv/pip.log"
if ! "$venv/bin/python" -m pip install -q "transformers==$version" >"$log" 2>&1; then
    # A release whose own requirements the registry does not hold yet (seen: 5.25.0 asking kernels>=0.19.1)
    # cannot be installed by any user of this registry: nothing to test, and not a break of our exports.
    missing=$(sed -n 's/^ERROR: No matching distribution found for \(.*\)$/\1/p' "$log" | head -n 1)
    if [ -n "$missing" ]; then
        echo "transformers_compat: transformers $version ($which) cannot be installed from this registry" \
            "(it requires $missing, which the registry does not have); nothing to check until it can"
        exit 0
    fi
    grep -v -e '^WARNING: Location' "$log" >&2
fi
grep -v -e '^WARNING: Location' -e 'dependency' -e 'requires' "$log" >&2 || true
got=$("$venv/bin/python" -c 'import transformers; print(transformers.__version__)')
[ "$got" = "$version" ] || { echo "transformers_compat: asked for $version, got $got" >&2; exit 1; }
echo "transformers_compat: the export tests against transformers $version ($which)"
if ! "$venv/bin/python" -m pytest -q -m hf_export tests/conversion tests/tools; then
    echo "transformers_compat: the Hugging Face exports fail with transformers $version ($which); fix" \
        "diffmeg/conversion (or narrow transformers' range in pyproject.toml)" >&2
    exit 1
fi
