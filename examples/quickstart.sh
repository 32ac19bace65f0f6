#!/usr/bin/env bash
# Quickstart on a CPU, end to end: about 7 minutes on 2 idle cores (409 s measured at 0e9520d, docs/notes.md);
# most of it is training, so a machine busy with other work takes proportionally longer:
#   1. write the embedded corpus (Python's own documentation) as a few JSONL text files
#   2. tokenize them with tools/preprocess_data.py (cl100k_base) into an indexed dataset
#   3. train diff-tiny on it for 200 iterations, with checkpoints, and check that the loss fell
#   4. convert the checkpoint to a Hugging Face DiffLlama folder (tools/convert_checkpoint.py)
#   5. generate text from the checkpoint (tools/generate.py: greedy and sampled) and from the export
#      (transformers alone), and say what a model this small can produce
#
#   bash examples/quickstart.sh
#   QUICKSTART_ITERS=50 QUICKSTART_DOCS=500 bash examples/quickstart.sh     # a smaller smoke run
#
# Offline machines: DIFFMEG_TOKENIZER_FILE=/path/to/cl100k_base.tiktoken (see README.md).
# Environment:
#   QUICKSTART_OUT=runs/quickstart   everything goes here; it is recreated on every run (only a directory
#                                    this script made before, marked by .quickstart, is ever emptied)
#   QUICKSTART_ITERS=200             training iterations (diff-tiny: ~1.5-2 s each on 2 idle cores)
#   QUICKSTART_DOCS=0                documents of the corpus to use (0: all ~3700, ~570K tokens)
#   QUICKSTART_PROMPT="The list type"  prompt for step 5
#   PYTHON=python3
set -euo pipefail
# shellcheck source=examples/common.sh
source "$(dirname "$0")/common.sh"  # in the checkout, running its code: root, py
out=${QUICKSTART_OUT:-runs/quickstart}
iters=${QUICKSTART_ITERS:-200}
docs=${QUICKSTART_DOCS:-0}
prompt=${QUICKSTART_PROMPT:-The list type}

step 0/5 "checking the environment"
if ! "$py" -c "import diffmeg, tiktoken, torch, importlib.util as u; assert u.find_spec('megatron.core')" \
    2>/dev/null; then
    echo "diffmeg's dependencies are missing: running scripts/setup.sh"
    bash scripts/setup.sh
fi
fresh_output_dir QUICKSTART_OUT
mkdir -p "$out/text" "$out/data"

step 1/5 "writing the embedded corpus as JSONL text files"
"$py" - "$out/text" "$docs" <<'EOF' || die "could not write the corpus (above)"
import json
import sys

from diffmeg.data.builtin import iter_documents
from diffmeg.data.tiktoken_cl100k import load_tokenizer
from diffmeg.errors import DiffmegError

try:  # fail here, not in the middle of preprocessing, when the tokenizer cannot be loaded
    load_tokenizer(None)
except DiffmegError as exc:
    sys.exit(
        f"{exc}\nthe cl100k_base tokenizer is needed: set DIFFMEG_TOKENIZER_FILE to a local "
        "cl100k_base.tiktoken (offline machines) or let tiktoken download it"
    )

directory, limit, shards = sys.argv[1], int(sys.argv[2]), 4
files = [open(f"{directory}/part-{i:02d}.jsonl", "w", encoding="utf-8") for i in range(shards)]
count = size = 0
for count, text in enumerate(iter_documents(), start=1):
    files[(count - 1) % shards].write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    size += len(text.encode("utf-8"))
    if count == limit:
        break
for f in files:
    f.close()
print(f"{count} documents, {size / 1e6:.1f} MB of text in {shards} files: {directory}/part-*.jsonl")
EOF

step 2/5 "tokenizing with tools/preprocess_data.py"
"$py" tools/preprocess_data.py --input "$out/text/part-*.jsonl" --output-prefix "$out/data/quickstart" \
    --append-eod --workers 2 --log-interval 0
data=$out/data/quickstart_text_document
# the corpus as tokenized (QUICKSTART_DOCS changes it), for the closing text
corpus_tokens=$("$py" -c "import sys; from diffmeg.data.indexed import check_dataset as c; n = c(sys.argv[1]); \
print(f'{n / 1e6:.2f}M' if n >= 1e6 else f'{n / 1e3:.0f}K')" "$data") || die "cannot read the dataset $data"

step 3/5 "training diff-tiny for $iters iterations"
ckpt=$out/checkpoints
mkdir -p "$ckpt"
echo "(full log: $out/train.log)"
if ! "$py" pretrain_diff.py --model diff-tiny --data-path "$data" --train-iters "$iters" \
    --split 98,2,0 --save "$ckpt" --load "$ckpt" --metrics-file "$out/metrics.jsonl" --log-interval 10 \
    2>&1 | tee "$out/train.log" \
    | grep --line-buffered -E "iteration +[0-9]+/|validation loss|saved checkpoint|^error|Error"; then
    tail -n 30 "$out/train.log" >&2
    die "training failed (log: $out/train.log)"
fi
"$py" - "$out/metrics.jsonl" <<'EOF' || die "the training loss did not fall"
import json
import sys

records = [json.loads(line) for line in open(sys.argv[1])]
train = [(r["iteration"], r["lm_loss"]) for r in records if "lm_loss" in r]
valid = [(r["iteration"], r["validation_lm_loss"]) for r in records if "validation_lm_loss" in r]
print("lm loss by iteration:", ", ".join(f"{i}: {loss:.2f}" for i, loss in train))
if valid:
    print("validation loss:", ", ".join(f"{i}: {loss:.2f}" for i, loss in valid))
if len(train) >= 2:
    k = 2 if len(train) >= 4 else 1  # mean of the first and last two logged losses
    head = sum(loss for _, loss in train[:k]) / k
    tail = sum(loss for _, loss in train[-k:]) / k
    verdict = "fell" if tail < head else "did not fall"
    print(f"loss {verdict}: {head:.2f} -> {tail:.2f} (mean of the first and last {k} logged)")
    sys.exit(0 if tail < head else 1)
EOF

step 4/5 "converting the checkpoint to Hugging Face (DiffLlama)"
"$py" tools/convert_checkpoint.py mcore-to-hf --load "$ckpt" --save "$out/hf"
echo "Hugging Face model: $out/hf (AutoModelForCausalLM.from_pretrained('$out/hf'))"

step 5/5 "generating from the checkpoint"
echo "--- greedy (the most likely token at every step):"
"$py" tools/generate.py --load "$ckpt" --prompt "$prompt" --max-new-tokens 40 --greedy
echo "--- sampled (temperature 0.8, top-p 0.95, seed 0):"
"$py" tools/generate.py --load "$ckpt" --prompt "$prompt" --max-new-tokens 40 --temperature 0.8 --top-p 0.95 \
    --seed 0
if "$py" -c "import transformers" 2>/dev/null; then
    echo "--- the Hugging Face export, greedy, with transformers alone:"
    "$py" - "$out/hf" "$prompt" 2>/dev/null <<'EOF'
import sys

from transformers import AutoModelForCausalLM, AutoTokenizer

folder, prompt = sys.argv[1], sys.argv[2]
tokenizer = AutoTokenizer.from_pretrained(folder)
model = AutoModelForCausalLM.from_pretrained(folder)
ids = tokenizer(prompt, return_tensors="pt").input_ids
out = model.generate(ids, max_new_tokens=40, do_sample=False)
print(f"({type(model).__name__}) {tokenizer.decode(out[0])}")
EOF
fi
cat <<EOF
--- what to expect: diff-tiny has 54M parameters, 51M of them the embedding and output layers of
the 100K-token vocabulary, and has seen $((iters * 1024)) tokens ($iters iterations of 4 x 256; the corpus
it drew them from: $corpus_tokens). That teaches it which tokens are frequent and a little local structure, not grammar or
meaning: greedy decoding repeats its single most likely continuation (often spaces or newlines),
sampling shows word pieces and punctuation in the style of Python's documentation. Coherent text takes
models and token counts orders of magnitude larger (the paper's 3B runs: 1T tokens).
EOF

printf '\n== done in %ds: data %s, checkpoints %s, metrics %s/metrics.jsonl\n' \
    $((SECONDS - started)) "$data" "$ckpt" "$out"
