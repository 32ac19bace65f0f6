"""pretrain_diff.py as users run it: dry run JSON, one-line errors, NaN stop, corrupt checkpoints."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT
from tests.distributed.runner import run_training


def _run(argv, tmp_path, env_extra=None):
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1")
    env.pop("WORLD_SIZE", None)
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, str(REPO_ROOT / "pretrain_diff.py"), *argv],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_dry_run_resolves_the_3b_recipe(tmp_path):
    proc = _run(
        ["--model", "diff-3b", "--tensor-model-parallel-size", "2", "--dry-run"],
        tmp_path,
        {"WORLD_SIZE": "256"},
    )
    assert proc.returncode == 0, proc.stderr
    cfg = json.loads(proc.stdout)
    assert cfg["model"]["num_attention_heads"] == 12 and cfg["model"]["head_dim"] == 128
    assert cfg["model"]["value_head_dim"] == 256
    assert cfg["parallel"]["data_parallel_size"] == 128
    assert cfg["batch"]["tokens_per_batch"] == 4 * 2**20
    assert cfg["schedule"]["total_tokens"] >= 1e12
    assert cfg["num_parameters"] == pytest.approx(3.79e9, rel=0.01)
    assert cfg["flops_per_step"] > 0


def test_impossible_layout_is_one_line(tmp_path):
    proc = _run(
        ["--model", "diff-tiny", "--tensor-model-parallel-size", "3", "--dry-run"],
        tmp_path,
        {"WORLD_SIZE": "3"},
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and proc.stderr.startswith("error: ")


def test_nan_loss_stops_with_iteration(tmp_path):
    proc = run_training(
        tmp_path,
        "nan",
        [
            "--train-iters",
            "30",
            "--lr",
            "1e6",
            "--min-lr",
            "1e6",
            "--clip-grad",
            "0",
            "--lr-warmup-iters",
            "0",
        ],
        check=False,
    )
    assert proc.returncode == 2
    assert "error: lm loss is" in proc.stderr and "at iteration" in proc.stderr


def test_corrupt_checkpoint_is_a_clear_error(tmp_path):
    ckpt = tmp_path / "ckpt"
    run_training(tmp_path, "a", ["--train-iters", "2", "--save", str(ckpt)])
    for f in (ckpt / "iter_0000002").glob("*.distcp"):
        f.write_bytes(b"garbage")
    proc = run_training(tmp_path, "b", ["--train-iters", "4", "--load", str(ckpt)], check=False)
    assert proc.returncode == 2
    assert "error: cannot load checkpoint" in proc.stderr, proc.stderr[-2000:]
    # nothing already written was touched
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2"


def test_unfinished_save_is_not_marked_latest(tmp_path):
    ckpt = tmp_path / "ckpt"
    run_training(tmp_path, "a", ["--train-iters", "2", "--save", str(ckpt)])
    (ckpt / "iter_0000004").mkdir()  # a save that died half way: never in the tracker
    proc = run_training(tmp_path, "b", ["--train-iters", "3", "--load", str(ckpt), "--save", str(ckpt)])
    assert "at iteration 2" in proc.stdout
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "3"


def test_recompute_and_bf16_match_the_plain_run(tmp_path):
    from tests.distributed.runner import read_losses

    base = ["--train-iters", "3"]
    run_training(tmp_path, "plain", [*base, "--tensorboard-dir", str(tmp_path / "tb")])
    run_training(tmp_path, "full", [*base, "--recompute-granularity", "full"])
    run_training(tmp_path, "selective", [*base, "--recompute-granularity", "selective"])
    run_training(tmp_path, "bf16", [*base, "--bf16"])
    plain = read_losses(tmp_path, "plain")
    assert read_losses(tmp_path, "full") == plain
    assert read_losses(tmp_path, "selective") == plain
    for it, loss in read_losses(tmp_path, "bf16").items():
        assert loss == pytest.approx(plain[it], rel=1e-3)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {"lm loss", "learning-rate", "grad-norm", "throughput/tflops-per-gpu"} <= set(tags)
    assert any(t.startswith("lambda/layer") for t in tags)
    assert [e.value for e in events.Scalars("lm loss")] == pytest.approx([plain[i] for i in (1, 2, 3)])
