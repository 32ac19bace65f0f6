"""A run travels: a checkpoint carries its Hugging Face tokenizer (`{save}/tokenizer`, named relative to the
checkpoint folder in args.json), so the run folder can be moved or renamed, and the upcycle folder it
started from deleted, between every step: `--use-checkpoint-args` resume, mcore-to-hf and generate.py all
still work; `--tokenizer-model` points generate.py elsewhere, and a tokenizer of another vocabulary is
refused in one line."""

from __future__ import annotations

import json
import shutil

import pytest

from diffmeg.data.preprocess import PreprocessConfig, preprocess
from tests.conversion.helpers import convert_ok
from tests.conversion.upcycle_helpers import llama_folder, save_tiny_tokenizer
from tests.data.helpers import write_jsonl
from tests.distributed.runner import run_pretrain
from tests.tools.helpers import run_tool

TRAIN = [
    "--use-checkpoint-args", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "2",
    "--lr", "1e-4", "--lr-warmup-iters", "0", "--eval-iters", "0", "--split", "1,0,0", "--log-interval", "1",
    "--lr-decay-iters", "2",  # the schedule of the resumed run of 2 iterations from the first run's 1
]  # fmt: skip


def _trained(proc) -> None:
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"


@pytest.mark.slow
def test_a_run_moves_and_outlives_its_upcycle_folder(tmp_path_factory, tmp_path):
    source = llama_folder(tmp_path_factory, "llama-gqa-tied", tied=True)
    up = tmp_path / "up"
    convert_ok("upcycle", "--load", source, "--save", up)
    assert json.loads((up / "iter_0000000" / "args.json").read_text())["tokenizer_model"] == "tokenizer"
    texts = [{"text": " ".join(f"the quick brown fox {k} {i}" for i in range(60))} for k in range(8)]
    corpus = write_jsonl(tmp_path / "corpus.jsonl", texts)
    data = preprocess(
        PreprocessConfig(
            inputs=[str(corpus)],
            output_prefix=str(tmp_path / "data"),
            append_eod=True,
            log_interval=0,
            tokenizer_type="HuggingFaceTokenizer",
            tokenizer_model=str(up / "tokenizer"),
        ),
        log=lambda line: None,
    ).outputs["text"]

    run = tmp_path / "run"
    data_flags = ["--data-path", data, "--pretrained-checkpoint", str(up)]
    _trained(run_pretrain([*TRAIN, *data_flags, "--train-iters", "1", "--save", str(run)], tmp_path))
    assert json.loads((run / "iter_0000001" / "args.json").read_text())["tokenizer_model"] == "tokenizer"
    assert (run / "tokenizer" / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()

    shutil.rmtree(up)  # the weights-only start is no longer needed ...
    moved = tmp_path / "moved"
    run.rename(moved)  # ... and the run goes to another place
    resume = ["--load", str(moved), "--save", str(moved), "--train-iters", "2"]
    _trained(run_pretrain([*TRAIN, *data_flags, *resume], tmp_path))
    assert (moved / "iter_0000002" / "args.json").is_file()

    again = tmp_path / "again"
    moved.rename(again)
    hf = tmp_path / "hf"
    convert_ok("mcore-to-hf", "--load", again, "--save", hf)
    assert (hf / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()

    last = tmp_path / "last"
    again.rename(last)
    prompt = ["--prompt", "the quick brown", "--max-new-tokens", "3", "--greedy", "--json"]
    proc = run_tool("generate", "--load", last, *prompt)
    assert proc.returncode == 0, proc.stderr[-3000:]
    own = json.loads(proc.stdout)
    shutil.rmtree(last / "tokenizer")  # a run folder without its copy: the export's tokenizer is the same
    proc = run_tool("generate", "--load", last, "--tokenizer-model", hf, *prompt)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout) == own

    proc = run_tool("generate", "--load", last, *prompt)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].endswith("or pass --tokenizer-model with a copy of it")
    other = tmp_path / "other-tokenizer"
    save_tiny_tokenizer(other)
    values = json.loads((other / "tokenizer.json").read_text())
    vocab = values["model"]["vocab"]
    a, b = (name for name, i in vocab.items() if i in (10, 11))
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: another vocabulary
    (other / "tokenizer.json").write_text(json.dumps(values))
    proc = run_tool("generate", "--load", last, "--tokenizer-model", other, *prompt)
    assert proc.returncode == 2
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: --tokenizer-model {other} is the Hugging Face tokenizer"), line
    assert "but the model reads the ids of the Hugging Face tokenizer" in line, line
    assert line.endswith("; pass that tokenizer's folder"), line
