"""Overlapped data-parallel communication and the interleaved pipeline schedule reproduce the single-rank
run of diff-tiny (losses, grad norms, logged lambdas, validation losses, weights), and checkpoints stay
layout-free with virtual pipeline stages.

Three launches train every run (tests/distributed/sequence.py: one launch, several runs):
- 1 rank: the references, DIFF V1 (evaluated every 3 iterations, saved at 5 and 10) and V2;
- 2 ranks: DP2 with the distributed optimizer and both overlaps in buckets of 100k parameters (14 per
  step), and DP2 overlapping its gradient all-reduce (no distributed optimizer); PP2 x VP2 for V1 and
  V2; PP2 x VP2 resumed from the reference's iteration 5 (PP1 -> VP) and PP2 without VP resumed from
  PP2 x VP2's (VP -> PP2); then the weights of PP2 x VP2 through a PP2 run and back into PP2 x VP2 with
  lr 0, which must leave them bit for bit;
- 4 ranks: PP2 x VP2 x DP2 and TP2 x DP2 (sequence parallel), both with the distributed optimizer and
  both overlaps; PP2 x VP2 x DP2 resumed from its iteration 5 (distributed-optimizer state per chunk).
Tied embedding and output weights (DIFF V2, what a tied Llama upcycles into) ride along: a 1-rank
reference; PP2 with the chunked loss (saved at 5) and TP2 resumed from its iteration 5 (2 ranks); PP2 x
VP2 x DP2 with the distributed optimizer and both overlaps (4 ranks).
Overlapped runs log every 2nd iteration: a logging step finishes the step's parameter all-gathers (for
the logged lambdas), the others leave them to the next forward, so both paths run; they evaluate at
iterations 3, 6, 9 and save at 5, steps after which the all-gathers are still pending.
"""

from __future__ import annotations

import re

import pytest

from tests.distributed.runner import (
    assert_same_run,
    assert_same_weights,
    load_weights,
    read_metric,
)
from tests.distributed.sequence import run_sequence

ITERS = ["--train-iters", "10"]
EVAL_SAVE = ["--eval-interval", "3", "--eval-iters", "1", "--save-interval", "5"]
OVERLAP = [
    "--use-distributed-optimizer",
    "--overlap-grad-reduce",
    "--overlap-param-gather",
    "--ddp-bucket-size",
    "100000",
    "--log-interval",
    "2",
]
OVERLAP_GRADS = ["--overlap-grad-reduce", "--ddp-bucket-size", "100000", "--log-interval", "2"]  # all-reduce
VP = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
V2 = ["--model", "diff2-tiny"]
TIED = [*V2, "--tie-embeddings-and-output-weights"]
LR0 = ["--train-iters", "1", "--lr", "0", "--min-lr", "0"]  # one step that leaves every weight as it is
EVERY_2ND = [2, 4, 6, 8, 10]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(folder of every run, each run's stdout)."""
    tmp = tmp_path_factory.mktemp("overlap_vp")
    out = run_sequence(
        tmp,
        {"single": [*ITERS, *EVAL_SAVE], "single_v2": [*V2, *ITERS], "single_tied": [*TIED, *ITERS]},
        nproc=1,
    )
    out |= run_sequence(
        tmp,
        {
            "dp2_overlap": [*ITERS, *EVAL_SAVE, *OVERLAP],
            "dp2_overlap_allreduce": [*ITERS, *EVAL_SAVE, *OVERLAP_GRADS],
            "pp2_vp2": [*ITERS, *EVAL_SAVE, *VP],
            "pp2_vp2_v2": [*V2, *ITERS, *VP],
            "vp_from_single": [*ITERS, *VP, "--load", str(tmp / "single"), "--ckpt-step", "5"],
            "pp2_from_vp": [*ITERS, *VP[:2], "--load", str(tmp / "pp2_vp2"), "--ckpt-step", "5"],
            "pp2_copy": [*LR0, *VP[:2], "--pretrained-checkpoint", str(tmp / "pp2_vp2")],
            "vp_copy": [*LR0, *VP, "--pretrained-checkpoint", str(tmp / "pp2_copy")],
            "pp2_tied": [*TIED, *ITERS, *VP[:2], "--save-interval", "5", "--cross-entropy-chunk-size", "24"],
            "tp2_tied_from_pp2": [
                *TIED,
                *ITERS,
                "--tensor-model-parallel-size",
                "2",
                "--load",
                str(tmp / "pp2_tied"),
                "--ckpt-step",
                "5",
            ],
        },
        nproc=2,
    )
    out |= run_sequence(
        tmp,
        {
            "pp2_vp2_dp2_overlap": [*ITERS, *EVAL_SAVE, *VP, *OVERLAP],
            "pp2_vp2_dp2_resumed": [
                *ITERS,
                *VP,
                *OVERLAP,
                "--load",
                str(tmp / "pp2_vp2_dp2_overlap"),
                "--ckpt-step",
                "5",
            ],
            "tp2_dp2_overlap": [
                *ITERS,
                *EVAL_SAVE,
                "--tensor-model-parallel-size",
                "2",
                "--sequence-parallel",
                *OVERLAP,
            ],
            "pp2_vp2_dp2_tied": [*TIED, *ITERS, *VP, *OVERLAP],
        },
        nproc=4,
    )
    return tmp, out


def _same_lambdas_and_validation(tmp, ref: str, got: str) -> None:
    """The lambdas `got` logged (its last rank's layers) and its validation losses equal the reference's."""
    lambdas, ref_lambdas = read_metric(tmp, got, "lambdas"), read_metric(tmp, ref, "lambdas")
    assert lambdas and all(lambdas.values())
    for it, values in lambdas.items():
        for layer, value in values.items():
            assert value == pytest.approx(ref_lambdas[it][layer], rel=1e-5, abs=1e-6), (
                f"{got} {layer} at {it}"
            )
    valid, ref_valid = (
        read_metric(tmp, got, "validation_lm_loss"),
        read_metric(tmp, ref, "validation_lm_loss"),
    )
    assert sorted(valid) == [3, 6, 9]
    for it in valid:
        assert valid[it] == pytest.approx(ref_valid[it], rel=1e-5), f"{got} validation loss at {it}"


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["dp2_overlap", "dp2_overlap_allreduce", "pp2_vp2_dp2_overlap", "tp2_dp2_overlap"]
)
def test_overlapped_data_parallel_matches_single_rank(runs, single_rank_parallel_state, name):
    tmp, out = runs
    assert_same_run(tmp, "single", name, iterations=10, logged=EVERY_2ND)
    _same_lambdas_and_validation(tmp, "single", name)
    # Several buckets per step, so the reduce-scatters and all-gathers really overlap one another.
    what = "all-reduce" if name.endswith("allreduce") else "reduce-scatter and parameter all-gather"
    line = re.search(rf"gradient {what} in (\d+) buckets per step", out[name])
    assert line is not None and int(line.group(1)) >= 3, out[name][:2000]
    # The checkpoint saved after iteration 5 (its all-gathers pending) holds iteration 5's weights.
    assert_same_weights(load_weights(tmp / "single", 5), load_weights(tmp / name, 5), name, 5)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,ref,expect", [("pp2_vp2", "single", None), ("pp2_vp2_v2", "single_v2", ("linear_lambda",))]
)
def test_interleaved_pipeline_matches_single_rank(runs, single_rank_parallel_state, name, ref, expect):
    tmp, _ = runs
    assert_same_run(tmp, ref, name, iterations=10, **({"expect": expect} if expect else {}))
    if ref == "single":
        _same_lambdas_and_validation(tmp, ref, name)


@pytest.mark.slow
def test_interleaved_checkpoints_are_layout_free(runs, single_rank_parallel_state):
    tmp, out = runs
    # PP1 -> PP2 x VP2 and PP2 x VP2 -> PP2, with optimizer state: the rest of the run is the reference's;
    # so is PP2 x VP2 x DP2's, resumed with its distributed-optimizer state.
    for name, logged in (
        ("vp_from_single", [6, 7, 8, 9, 10]),
        ("pp2_from_vp", [6, 7, 8, 9, 10]),
        ("pp2_vp2_dp2_resumed", [6, 8, 10]),
    ):
        assert "loaded checkpoint" in out[name]
        assert_same_run(tmp, "single", name, iterations=10, logged=logged)
    # Weights of PP2 x VP2 through PP2 and back into PP2 x VP2, exact (lr 0 steps); each read at PP1.
    final = load_weights(tmp / "pp2_vp2")
    for name in ("pp2_copy", "vp_copy"):
        copy = load_weights(tmp / name)
        assert copy.keys() == final.keys()
        assert all(copy[k].equal(final[k]) for k in final), name


@pytest.mark.slow
def test_tied_embeddings_match_single_rank(runs, single_rank_parallel_state):
    """Tied embedding and output weights: PP2 (the last stage's copy of the embedding drawn as the embedding,
    gradients summed over the embedding group, the chunked loss on that copy), TP2 resumed from PP2's
    iteration 5 (saved at PP2, loaded at TP2 with its optimizer state) and PP2 x VP2 x DP2 with the
    distributed optimizer (the copy in a bucket of its own) reproduce the single rank: losses, grad norms,
    weights, each checkpoint read at PP1 with no output layer of its own. Each run counts the embedding
    once: the untied model's parameters less V x H."""
    tmp, out = runs
    expect = ("linear_lambda", "word_embeddings")
    assert_same_run(tmp, "single_tied", "pp2_tied", iterations=10, expect=expect)
    assert "loaded checkpoint" in out["tp2_tied_from_pp2"]
    resumed = [6, 7, 8, 9, 10]
    assert_same_run(tmp, "single_tied", "tp2_tied_from_pp2", iterations=10, logged=resumed, expect=expect)
    assert_same_run(tmp, "single_tied", "pp2_vp2_dp2_tied", iterations=10, logged=EVERY_2ND, expect=expect)
    assert "output_layer.weight" not in load_weights(tmp / "pp2_tied")

    def parameters(name: str) -> float:
        line = re.search(r"([\d.]+)M parameters( \(output layer tied to the embedding\))?", out[name])
        assert line is not None and bool(line.group(2)) == ("tied" in name), out[name][:2000]
        return float(line.group(1))

    tied = {parameters(name) for name in ("single_tied", "pp2_tied", "tp2_tied_from_pp2", "pp2_vp2_dp2_tied")}
    output_layer = load_weights(tmp / "single_v2")["output_layer.weight"].numel() / 1e6  # V x H, untied
    assert len(tied) == 1 and tied.pop() == pytest.approx(parameters("single_v2") - output_layer, abs=0.011)
