"""Continued pretraining from an upcycled checkpoint (`--pretrained-checkpoint`, weights only, a new
schedule): in fp32 the first step's loss of the upcycled DIFF V2 is the source Transformer's on the same
batch, at TP=1 and loaded at TP=2 x PP=2 (checkpoints are layout-free); the second step's differs (the
query copies separate)."""

from __future__ import annotations

import pytest

from tests.conversion.helpers import cached, convert_ok
from tests.distributed.runner import read_losses, run_training

STEPS = ["--train-iters", "2", "--lr", "1e-3", "--lr-warmup-iters", "0", "--seed", "7"]


@pytest.mark.slow
def test_first_step_loss_of_the_upcycled_model_is_the_sources(tmp_path_factory, tmp_path):
    def train_source(path):  # transformer-tiny's architecture (mock data, vocab 512, seq 64), 2 steps
        run_training(
            path.parent, path.name, ["--model", "transformer-tiny", "--train-iters", "2", "--save", str(path)]
        )

    source = cached(tmp_path_factory, "transformer-tiny-trained", train_source)
    up = tmp_path / "diff2"
    proc = convert_ok("upcycle", "--load", source, "--save", up)
    assert "pretrain_diff.py Transformer checkpoint (iter_0000002)" in proc.stderr

    run_training(
        tmp_path,
        "transformer",
        ["--model", "transformer-tiny", "--pretrained-checkpoint", str(source), *STEPS],
    )
    proc = run_training(
        tmp_path, "diff2", ["--model", "diff2-tiny", "--pretrained-checkpoint", str(up), *STEPS]
    )
    assert f"initialised weights from pretrained checkpoint {up} (iteration 0)" in proc.stdout
    # The model's shape from the checkpoint itself, at another layout (TP=2 x PP=2: 4 ranks).
    layout = [
        "--tensor-model-parallel-size",
        "2",
        "--pipeline-model-parallel-size",
        "2",
        "--use-checkpoint-args",
    ]
    run_training(tmp_path, "diff2-tp2pp2", ["--pretrained-checkpoint", str(up), *layout, *STEPS], nproc=4)

    transformer, diff2 = read_losses(tmp_path, "transformer"), read_losses(tmp_path, "diff2")
    assert diff2[1] == transformer[1]  # the same function on the same batch, bit for bit in fp32
    assert diff2[2] != transformer[2]  # one step later the two query copies of each head differ
    assert read_losses(tmp_path, "diff2-tp2pp2")[1] == pytest.approx(diff2[1], rel=1e-5)
