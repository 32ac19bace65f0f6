"""examples/: the quickstart (a small smoke run always; the full run with DIFFMEG_TEST_QUICKSTART=1), the
single-node torchrun examples (dry runs at their defaults, and one real two-process CPU run), and the
README table's commands."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.slurm.helpers import REPO_ROOT, clean_env
from tests.slurm.test_dry_run import check_scaling, split_output

EXAMPLES = REPO_ROOT / "examples"
PROMPT = "The list type"  # the quickstart's default


def run_example(script: str, *args: str, timeout: int = 600, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(EXAMPLES / script), *args],
        env=clean_env(PYTHON=sys.executable, **env),
        cwd="/",
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _quickstart(tmp_path: Path, tokenizer_file: str, **env: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    proc = run_example(
        "quickstart.sh",
        timeout=1800,
        QUICKSTART_OUT=str(tmp_path / "qs"),
        DIFFMEG_TOKENIZER_FILE=tokenizer_file,
        DIFFMEG_CACHE_DIR=str(tmp_path / "cache"),
        **env,
    )
    return proc, time.perf_counter() - start


def _generated(section: str, marker: str) -> str:
    """The text printed after the line starting with ``--- {marker}``, up to the next ``---`` line."""
    after = section.split(f"\n--- {marker}", 1)[1].split("\n", 1)[1]
    return after.split("\n--- ", 1)[0]


def _check_quickstart_outputs(proc: subprocess.CompletedProcess, out: Path, iters: int) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for step in range(6):
        assert f"== [{step}/5]" in proc.stdout
    assert (out / "data" / "quickstart_text_document.bin").stat().st_size > 0
    ckpt = out / "checkpoints"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(iters)
    assert (out / "hf" / "config.json").is_file()

    # Step 5: a greedy and a sampled continuation of the prompt, and what to expect from them.
    section = proc.stdout.split("== [5/5]")[1].split("\n== ")[0]
    greedy, sampled = _generated(section, "greedy"), _generated(section, "sampled")
    assert greedy.startswith(PROMPT) and sampled.startswith(PROMPT), section
    assert sampled[len(PROMPT) :].strip(), section  # the sampled text is more than whitespace
    assert f"has seen {iters * 1024} tokens ({iters} iterations" in section
    from diffmeg.data.indexed import check_dataset

    corpus = check_dataset(str(out / "data" / "quickstart_text_document"))  # QUICKSTART_DOCS sets it
    assert f"the corpus\nit drew them from: {corpus / 1e3:.0f}K)" in section, section
    hf = _generated(section, "the Hugging Face export")
    assert hf.startswith(f"(DiffLlamaForCausalLM) {PROMPT}"), section
    # What was printed is the model's own output: the seeded sample comes out the same again.
    sampling = f"--load {ckpt} --max-new-tokens 40 --temperature 0.8 --top-p 0.95 --seed 0 --json".split()
    again = subprocess.run(
        [sys.executable, str(REPO_ROOT / "tools" / "generate.py"), *sampling, "--prompt", PROMPT],
        env=clean_env(TORCHDYNAMO_DISABLE="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    text = json.loads(again.stdout)["output_text"]
    text = text.replace("\r\n", "\n").replace("\r", "\n")  # as the captured stdout reads it (text mode)
    assert sampled.rstrip("\n") == PROMPT + text


@pytest.mark.slow
def test_quickstart_smoke(tmp_path, tokenizer_file):
    """Every step of the quickstart on 200 documents and 4 iterations."""
    proc, _ = _quickstart(tmp_path, tokenizer_file, QUICKSTART_ITERS="4", QUICKSTART_DOCS="200")
    _check_quickstart_outputs(proc, tmp_path / "qs", iters=4)
    assert "200 documents" in proc.stdout


@pytest.mark.skipif(
    os.environ.get("DIFFMEG_TEST_QUICKSTART") != "1",
    reason="the full quickstart trains 200 iterations (~4 s each on 2 AVX2 cores, docs/notes.md); "
    "set DIFFMEG_TEST_QUICKSTART=1 to run it",
)
@pytest.mark.slow
def test_quickstart_full(tmp_path, tokenizer_file):
    """From a fresh checkout every step works and the loss falls; the time is printed, not asserted (it
    depends on the machine and on what else runs there)."""
    proc, seconds = _quickstart(tmp_path, tokenizer_file)
    _check_quickstart_outputs(proc, tmp_path / "qs", iters=200)
    losses = [
        json.loads(line)["lm_loss"]
        for line in (tmp_path / "qs" / "metrics.jsonl").read_text().splitlines()
        if '"lm_loss"' in line
    ]
    assert len(losses) == 20 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 2.0, losses
    print(f"quickstart: {seconds:.0f} s; lm loss every 10 iterations: {[round(x, 2) for x in losses]}")


def test_quickstart_refuses_a_foreign_output_directory(tmp_path):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    proc = subprocess.run(
        ["bash", str(EXAMPLES / "quickstart.sh")],
        env=clean_env(
            PYTHON=sys.executable, QUICKSTART_OUT=str(foreign), DIFFMEG_TOKENIZER_FILE="/nonexistent"
        ),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert (foreign / "notes.txt").read_text() == "keep me"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """A dataset for the dry runs (they check that every --data-path dataset exists and that the split
    gives every part documents: 1000 of them for the recipes' 969,30,1)."""
    from diffmeg.data.indexed import IndexedWriter

    prefix = str(tmp_path_factory.mktemp("data") / "corpus_text_document")
    with IndexedWriter(prefix) as writer:
        for doc in range(1000):
            writer.add_document(np.arange(doc % 100, doc % 100 + 10, dtype=np.int32))
        writer.commit()
    return prefix


def _dry(script: str, corpus: str, *args: str, **env: str) -> tuple[str, dict]:
    proc = run_example(script, *args, DRY_RUN="1", DATA_PATH=corpus, **env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    head, config = split_output(proc.stdout)
    (command,) = [x for x in head if "-m diffmeg.launch" in x]
    return command, config


@pytest.mark.parametrize("arch", ["diff", "transformer"])
def test_torchrun_3b(arch, corpus):
    command, c = _dry("torchrun_diff_3b.sh", corpus, arch)
    assert "--standalone --nproc_per_node 8 pretrain_diff.py" in command
    m, s, p = c["model"], c["schedule"], c["parallel"]
    assert m["preset"] == f"{arch}-3b" and (m["num_layers"], m["hidden_size"], m["ffn_hidden_size"]) == (
        28,
        3072,
        8192,
    )
    assert m["num_attention_heads"] == (12 if arch == "diff" else 24)
    assert (s["train_iters"], s["lr"], s["min_lr"], s["lr_warmup_iters"]) == (238419, 3.2e-4, 1.28e-5, 1000)
    assert c["batch"]["tokens_per_batch"] == 4 * 1024 * 1024
    assert p["world_size"] == 8 and p["data_parallel_size"] == 8
    assert "--overlap-grad-reduce --overlap-param-gather" in command  # DP 8: both overlaps on
    assert all(c["features"][k].startswith("on:") for k in ("overlap_grad_reduce", "overlap_param_gather"))


@pytest.mark.parametrize("name", ["830m", "transformer-13.1b"])
def test_torchrun_scaling(name, corpus):
    _, c = _dry("torchrun_scaling.sh", corpus, name)
    arch, size = ("transformer", "13.1b") if name.startswith("transformer") else ("diff", name)
    check_scaling(c, size, arch)
    assert c["parallel"]["world_size"] == 8


def test_torchrun_64k(tmp_path, corpus):
    command, c = _dry("torchrun_diff_3b_64k.sh", corpus, INIT_CKPT="/ckpt/diff3b", RUN_DIR=str(tmp_path))
    assert f"--load {tmp_path}/checkpoints --pretrained-checkpoint /ckpt/diff3b" in command
    m, s, b, p = c["model"], c["schedule"], c["batch"], c["parallel"]
    assert m["preset"] == "diff-3b-64k"
    assert (m["seq_length"], m["rotary_base"], s["lr"], s["train_iters"]) == (65536, 640000.0, 8e-5, 358)
    assert b["tokens_per_batch"] == 4 * 1024 * 1024
    assert (p["tensor_model_parallel_size"], p["context_parallel_size"], p["data_parallel_size"]) == (2, 2, 2)
    assert c["memory_per_gpu_gib"]["total"] < 64
    assert "over chunks of 2048 tokens" in c["features"]["chunked_cross_entropy"]  # as slurm/diff_3b_64k.sh


def test_torchrun_dry_run_names_a_missing_dataset(tmp_path):
    """The dry run's checks reach the terminal: a missing dataset is one error line and exit 2."""
    proc = run_example("torchrun_scaling.sh", "830m", DRY_RUN="1", DATA_PATH=str(tmp_path / "nothing"))
    assert proc.returncode == 2
    assert f"error: --data-path: 1 of 1 dataset(s) not found: {tmp_path / 'nothing'}" in proc.stderr
    assert "note:" not in proc.stderr  # --sequence-parallel is passed only at TP > 1


@pytest.mark.slow
def test_torchrun_example_runs_on_cpu(tmp_path):
    """The 3B example launched for real with two CPU processes and the tiny override."""
    extra = (
        "--model diff-tiny --mock-data --vocab-size 1024 --seq-length 64 --max-position-embeddings 64 "
        "--train-iters 3 --micro-batch-size 1 --global-batch-size 2 --log-interval 1 --eval-iters 0"
    )
    ckpt = tmp_path / "ckpt"
    proc = run_example(
        "torchrun_diff_3b.sh",
        NPROC="2",
        RUN_DIR=str(tmp_path / "run"),
        CKPT_DIR=str(ckpt),
        EXTRA_ARGS=extra,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "lm loss" in proc.stdout + proc.stderr
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "3"


def test_readme_commands_point_at_real_files():
    text = (EXAMPLES / "README.md").read_text()
    scripts = set(re.findall(r"(?<![\w/])((?:slurm|examples|tools|scripts)/[\w.]+\.(?:sh|py))\b", text))
    assert {"slurm/diff_3b_1T.sh", "slurm/diff_3b_64k.sh", "examples/quickstart.sh"} <= scripts
    missing = [s for s in scripts if not (REPO_ROOT / s).exists()]
    assert not missing, missing


@pytest.mark.slow
def test_toy_retrieval_smoke(tmp_path):
    """examples/toy_retrieval.sh end to end at a few iterations: both models train on the generated corpus
    and the three tools write their tables for both (the full run's numbers are in docs/results.md)."""
    out = tmp_path / "toy"
    proc = run_example(
        "toy_retrieval.sh", timeout=900, TOY_OUT=str(out), TOY_ITERS="4", TOY_SAMPLES="1", TOY_TOKENS="2048"
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in ("diff", "transformer"):
        assert (out / "ckpt" / name / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
        args = json.loads(next((out / "ckpt" / name).glob("iter_*/args.json")).read_text())
        assert (args["tokenizer_type"], args["vocab_size"], args["seq_length"]) == ("null", 512, 128)
    summary = json.loads((out / "needle" / "needle_summary.json").read_text())
    assert [c["label"] for c in summary["checkpoints"]] == ["DIFF", "Transformer"]
    assert [c["architecture"] for c in summary["checkpoints"]] == ["DIFF", "Transformer"]
    assert set(summary["checkpoints"][0]["table"]) == {
        f"N={n},R={r}" for n in (1, 2, 4, 6) for r in (1, 2) if r <= n
    }
    for tool, png in (("needle", "needle_heatmap.png"), ("attention", "attention_scores.png")):
        assert (out / tool / png).stat().st_size > 0
    assert (out / "activations" / "activation_stats.csv").read_text().count("DIFF") > 0
    for table in ("N=6,R=2", "answer", "top1", "lm loss"):
        assert table in proc.stdout
