"""Exact resume: 20 iterations straight equal 10 + save + exit + load + 10."""

from __future__ import annotations

import json
import re

import pytest

from tests.distributed.runner import read_losses, run_training


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc,extra",
    [(1, []), (2, ["--use-distributed-optimizer"]), (1, ["--model", "gda-tiny"])],
    ids=["single", "dp2_distopt", "grouped_v2"],
)
def test_resume_is_exact(tmp_path, nproc, extra):
    run_training(tmp_path, "straight", ["--train-iters", "20", *extra], nproc=nproc)
    ckpt = str(tmp_path / "ckpt")
    run_training(
        tmp_path,
        "part",
        ["--train-iters", "20", "--exit-interval", "10", "--save", ckpt, *extra],
        nproc=nproc,
    )
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "10"
    assert sorted(read_losses(tmp_path, "part")) == list(range(1, 11))
    proc = run_training(
        tmp_path, "part", ["--train-iters", "20", "--load", ckpt, "--save", ckpt, *extra], nproc=nproc
    )
    assert "loaded checkpoint" in proc.stdout
    straight, resumed = read_losses(tmp_path, "straight"), read_losses(tmp_path, "part")
    assert sorted(resumed) == list(range(1, 21))
    for it in range(1, 21):
        assert resumed[it] == pytest.approx(straight[it], rel=1e-6, abs=0), f"iteration {it}"


def test_transformer_baseline_trains(tmp_path):
    proc = run_training(
        tmp_path, "baseline", ["--model", "transformer-tiny", "--train-iters", "3", "--verbose"]
    )
    losses = read_losses(tmp_path, "baseline")
    assert sorted(losses) == [1, 2, 3]
    assert re.search(r"^ transformer-tiny \(Transformer\): [\d.]+M parameters", proc.stdout, re.M)
    assert '"diff_attention": false' in proc.stdout  # --verbose: every argument, as Megatron-LM prints them
    # Without --save the full arguments go beside --metrics-file.
    assert json.loads((tmp_path / "arguments.json").read_text())["diff_attention"] is False
