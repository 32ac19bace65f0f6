# shellcheck shell=bash
# Shared by the CPU examples (quickstart.sh, toy_retrieval.sh); sourced, never run on its own.
# The sourcing script sets `example` (its name) and `out` (its output directory) first.
# shellcheck disable=SC2154  # example and out are the sourcing script's

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
