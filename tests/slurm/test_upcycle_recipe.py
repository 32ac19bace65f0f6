"""slurm/upcycle_diff2.sh: continued pretraining of an upcycled DIFF V2 (ARCH=diff2) or of its source
Transformer (ARCH=transformer) from INIT_CKPT, the model's shape and tokenizer read from the checkpoint.

The dry runs always run (a tiny Llama folder with its own tokenizer, upcycled and imported here); the
sbatch test needs the local Slurm of tests/slurm/conftest.py, like test_sbatch.py."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from tests.conversion.helpers import cached, convert_ok
from tests.conversion.upcycle_helpers import llama_folder, upcycled
from tests.slurm.helpers import REPO_ROOT, clean_env, submit

RECIPE = REPO_ROOT / "slurm" / "upcycle_diff2.sh"
TOKENS = "1e9"  # 1e9 / (1024 x 4096) -> 239 iterations


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, object]:
    """The tiny Llama folder, its upcycled DIFF V2 and its import as a Transformer, and a dataset
    tokenized with its tokenizer (recorded) beside one without a record (cl100k_base's ids)."""
    from diffmeg.data.indexed import IndexedWriter
    from diffmeg.data.preprocess import PreprocessConfig, preprocess

    folder = llama_folder(tmp_path_factory)
    diff2 = upcycled(tmp_path_factory, folder, "upcycled-llama-gqa")
    transformer = cached(
        tmp_path_factory,
        "imported-llama-gqa",
        lambda p: convert_ok("hf-to-mcore", "--load", folder, "--save", p),
    )
    data = tmp_path_factory.mktemp("upcycle-data")
    corpus = data / "corpus.jsonl"
    corpus.write_text(
        "".join(json.dumps({"text": f"the quick brown fox {i} " * 40}) + "\n" for i in range(1000))
    )
    config = PreprocessConfig(
        inputs=[str(corpus)],
        output_prefix=str(data / "llama"),
        append_eod=True,
        tokenizer_type="HuggingFaceTokenizer",
        tokenizer_model=str(folder),
        log_interval=0,
    )
    preprocess(config, log=lambda line: None)
    with IndexedWriter(str(data / "cl100k")) as writer:  # no record: diffmeg's cl100k_base ids
        for doc in range(1000):  # enough documents for every part of the recipe's split
            writer.add_document(np.arange(doc, doc + 10, dtype=np.int32))
        writer.commit()
    return {
        "diff2": diff2,
        "transformer": transformer,
        "data": data / "llama_text_document",
        "cl100k": data / "cl100k",
    }


def dry_run(**env: str) -> subprocess.CompletedProcess:
    env = clean_env(DRY_RUN="1", RUNS_ROOT="/nonexistent/runs", PYTHON=sys.executable, **env)
    return subprocess.run(
        ["bash", str(RECIPE)], env=env, cwd="/", capture_output=True, text=True, timeout=300
    )


def _config(stdout: str) -> tuple[list[str], dict]:
    lines = stdout.splitlines()
    start = lines.index("{")
    return lines[:start], json.loads("\n".join(lines[start:]))


@pytest.mark.parametrize("arch", ["diff2", "transformer"])
def test_dry_run_takes_the_model_and_tokenizer_from_init_ckpt(sources, arch):
    init = sources[arch]
    proc = dry_run(ARCH=arch, INIT_CKPT=str(init), DATA_PATH=str(sources["data"]), TOKENS=TOKENS, LR="1e-4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    head, config = _config(proc.stdout)
    srun = next(line for line in head if line.startswith("srun "))
    assert f"--pretrained-checkpoint {init}" in srun and "--use-checkpoint-args" in srun
    assert f"checkpoints: starts from the weights of {init} (iteration 0)" in "\n".join(head)
    model, schedule = config["model"], config["schedule"]
    assert model["architecture"] == arch and model["num_attention_heads"] == 4
    assert (model["num_query_groups"], model["vocab_size"], model["rotary_base"]) == (2, 320, 5000.0)
    assert schedule["train_iters"] == math.ceil(1e9 / (1024 * 4096)) == 239
    assert (schedule["lr"], schedule["lr_warmup_iters"], schedule["lr_decay_style"]) == (1e-4, 200, "cosine")
    assert config["data"]["tokenizer_type"] == "HuggingFaceTokenizer"
    assert config["data"]["tokenizer_model"] == str(init / "tokenizer")
    assert config["parallel"]["world_size"] == 32 and config["checkpointing"]["pretrained_checkpoint"] == str(
        init
    )


def test_dry_run_refuses_data_of_another_tokenizer_and_a_missing_init_ckpt(sources):
    proc = dry_run(INIT_CKPT=str(sources["diff2"]), DATA_PATH=str(sources["cl100k"]))
    assert proc.returncode == 2
    assert f"dataset {sources['cl100k']} was tokenized with cl100k_base" in proc.stderr
    assert "tools/preprocess_data.py --tokenizer-type HuggingFaceTokenizer --tokenizer-model" in proc.stderr
    proc = dry_run(DATA_PATH=str(sources["data"]))
    assert proc.returncode == 2 and "set INIT_CKPT to the checkpoint to continue" in proc.stderr
    proc = dry_run(ARCH="diff", INIT_CKPT=str(sources["diff2"]), DATA_PATH=str(sources["data"]))
    assert proc.returncode == 2 and "ARCH must be diff2 (the upcycled model) or transformer" in proc.stderr


# The CPU override of test_sbatch.py, with the tiny model's own data instead of mock data.
TINY = (
    "--seq-length 64 --train-iters 4 --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 "
    "--context-parallel-size 1 --micro-batch-size 1 --global-batch-size 2 --log-interval 1 --eval-iters 0 "
    "--split 969,30,0"
)


@pytest.mark.slow
def test_upcycled_and_source_continue_under_slurm(slurm_cluster, sources, tmp_path):
    """Both recipes train 4 iterations from INIT_CKPT on two tasks; the first step's loss is the same
    number for the Transformer and the DIFF V2 upcycled from it (same function, same batch)."""
    jobs = {}
    for arch in ("diff2", "transformer"):
        env = clean_env(
            RUNS_ROOT=str(tmp_path / "runs"),
            PYTHON=sys.executable,
            ARCH=arch,
            INIT_CKPT=str(sources[arch]),
            DATA_PATH=str(sources["data"]),
            EXTRA_ARGS=TINY,
        )
        allocation = ["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0", "--oversubscribe"]
        jobs[arch] = submit(
            slurm_cluster, f"upcycle-{arch}", str(RECIPE), [], allocation, env, tmp_path, tmp_path / "runs" /
            f"upcycle-{arch}", tmp_path,
        )  # fmt: skip
    first = {}
    for arch, job in jobs.items():
        rc, log = job.wait()
        assert rc == 0, f"{arch}: job {job.job_id} exited {rc}\n{log[-4000:]}"
        assert f"initialised weights from pretrained checkpoint {sources[arch]} (iteration 0)" in log
        records = [json.loads(line) for line in (job.run_dir / "metrics.jsonl").read_text().splitlines()]
        first[arch] = next(r["lm_loss"] for r in records if r.get("iteration") == 1)
        tracker = job.run_dir / "checkpoints" / "latest_checkpointed_iteration.txt"
        assert tracker.read_text().strip() == "4"
    assert first["diff2"] == pytest.approx(first["transformer"], rel=1e-2)  # bf16 on two ranks
