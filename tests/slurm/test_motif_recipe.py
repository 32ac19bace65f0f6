"""slurm/motif_continue.sh: continued pretraining of a Motif checkpoint, its Hugging Face folder imported into
INIT_CKPT first (MOTIF_FOLDER), the model's shape and tokenizer then read from the import.

The dry runs always run (tiny Motif folders of tests/conversion/test_motif_import.py); the sbatch test needs
the local Slurm of tests/slurm/conftest.py, like test_sbatch.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conversion.helpers import cached, convert_ok
from tests.conversion.test_motif_import import motif_folder
from tests.slurm.helpers import REPO_ROOT, clean_env, submit

RECIPE = REPO_ROOT / "slurm" / "motif_continue.sh"


def dry_run(**env: str) -> subprocess.CompletedProcess:
    env = clean_env(
        DRY_RUN="1", RUNS_ROOT="/nonexistent/runs", PYTHON=sys.executable, DATA_PATH="builtin", **env
    )
    return subprocess.run(
        ["bash", str(RECIPE)], env=env, cwd="/", capture_output=True, text=True, timeout=300
    )


def _config(stdout: str) -> tuple[str, dict]:
    head, _, body = stdout.partition("\n{\n")
    return head, json.loads("{\n" + body)


def test_dry_run_before_the_import_plans_the_preset_and_imports_nothing(tmp_path_factory, tmp_path):
    """INIT_CKPT empty: the import command is printed, not run; the plan is the motif-12.7b preset's (the
    published shape on the recipe's TP2 x PP2) with the folder's tokenizer."""
    folder = motif_folder(tmp_path_factory, "12.7b")
    init = tmp_path / "import"
    proc = dry_run(MOTIF_FOLDER=str(folder), INIT_CKPT=str(init))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"import (not run by DRY_RUN): {sys.executable} " in proc.stderr
    assert f"hf-to-mcore --load {folder} --save {init}" in proc.stderr and not init.exists()
    head, config = _config(proc.stdout)
    srun = next(line for line in head.splitlines() if line.startswith("srun "))
    assert "--model motif-12.7b" in srun and "--use-checkpoint-args" not in srun
    model, parallel = config["model"], config["parallel"]
    assert (model["preset"], model["num_layers"], model["num_noise_heads"]) == ("motif-12.7b", 40, 8)
    assert (parallel["tensor_model_parallel_size"], parallel["pipeline_model_parallel_size"]) == (2, 2)
    assert config["data"]["tokenizer_model"] == str(folder)


@pytest.mark.parametrize("layout", ["12.7b", "2.6b"])
def test_dry_run_after_the_import_takes_the_model_and_tokenizer_from_it(tmp_path_factory, layout):
    folder = motif_folder(tmp_path_factory, layout)
    init = cached(
        tmp_path_factory,
        f"motif-{layout}-ckpt",
        lambda p: convert_ok("hf-to-mcore", "--load", folder, "--save", p),
    )
    proc = dry_run(SIZE=layout, INIT_CKPT=str(init), TP="2", PP="1", LR="1e-4", SEQ_LENGTH="64")
    assert proc.returncode == 0, proc.stderr[-3000:]
    head, config = _config(proc.stdout)
    srun = next(line for line in head.splitlines() if line.startswith("srun "))
    assert (
        f"--model motif-{layout} --use-checkpoint-args" in srun and f"--pretrained-checkpoint {init}" in srun
    )
    assert f"checkpoints: starts from the weights of {init} (iteration 0)" in head
    model, schedule = config["model"], config["schedule"]
    # the import's shape (tiny), not the preset's; the preset's recipe, LR overridden
    assert (model["num_layers"], model["vocab_size"], model["rotary_base"]) == (3, 320, 5000.0)
    assert (model["mlp_activation"], model["lambda_init"]) == ("poly_norm", "motif")
    assert model["num_noise_heads"] == (2 if layout == "12.7b" else 4)
    assert (schedule["lr"], schedule["min_lr"], schedule["lr_decay_style"]) == (1e-4, 3e-6, "cosine")
    assert config["data"]["tokenizer_model"] == str(init / "tokenizer")


def test_what_the_recipe_cannot_start_from_is_refused(tmp_path):
    proc = dry_run()
    assert proc.returncode == 2 and "set INIT_CKPT to the imported checkpoint" in proc.stderr
    proc = dry_run(INIT_CKPT=str(tmp_path / "empty"))
    assert proc.returncode == 2 and "holds no checkpoint: set MOTIF_FOLDER" in proc.stderr
    proc = dry_run(INIT_CKPT=str(tmp_path / "empty"), MOTIF_FOLDER=str(tmp_path))
    assert proc.returncode == 2 and "has no config.json" in proc.stderr
    proc = dry_run(SIZE="7b", INIT_CKPT=str(tmp_path))
    assert proc.returncode == 2 and "SIZE must be 12.7b (Motif-2-12.7B) or 2.6b" in proc.stderr


# The CPU override of test_sbatch.py: the tiny import at TP2 (one group of [signal x 4, noise] a rank).
TINY = (
    "--seq-length 64 --train-iters 3 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 "
    "--context-parallel-size 1 --micro-batch-size 1 --global-batch-size 2 --log-interval 1 --eval-iters 0"
)


@pytest.mark.slow
def test_the_job_imports_the_folder_then_continues_training(slurm_cluster, tmp_path_factory, tmp_path):
    """One job on two tasks: hf-to-mcore of the 12.7B-layout folder into INIT_CKPT on the batch host, then
    3 iterations at TP2 from its weights, saved in the run's own checkpoints."""
    folder, init = motif_folder(tmp_path_factory, "12.7b"), tmp_path / "import"
    env = clean_env(
        RUNS_ROOT=str(tmp_path / "runs"),
        PYTHON=sys.executable,
        MOTIF_FOLDER=str(folder),
        INIT_CKPT=str(init),
        DATA_PATH="builtin",
        EXTRA_ARGS=TINY,
    )
    allocation = ["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0", "--oversubscribe"]
    run_dir = tmp_path / "runs" / "motif-12.7b"
    job = submit(slurm_cluster, "motif", str(RECIPE), [], allocation, env, tmp_path, run_dir, tmp_path)
    rc, log = job.wait()
    assert rc == 0, f"job {job.job_id} exited {rc}\n{log[-4000:]}"
    assert f"importing {folder} into {init}" in log and (init / "tokenizer" / "tokenizer.json").exists()
    assert f"initialised weights from pretrained checkpoint {init} (iteration 0)" in log
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sorted(r["iteration"] for r in records if "lm_loss" in r) == [1, 2, 3]
    assert (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
