"""Grouped differential attention on every parallel layout reproduces its single-rank run: losses, grad
norms, then final weights (lambda vectors and head norm, or the lambda projection, included).

Two models. V1-style GDA shaped as Motif's checkpoints: diff-tiny with 2 noise heads for its 4 heads over
2 K1/K2 pairs (6 query sub-heads over 4 K/V sub-groups, the spread fused QKV, 3 over 2 on each
tensor-parallel rank), Motif's PolyNorm MLP (its means span the FFN dimension split over TP) and its
lambda_init schedule. V2-style GDA: gda-tiny (8 signal heads, 2 noise heads, 2 KV heads). Between them
every layout runs once: TP with sequence parallelism (V1) and without (V2), the interleaved pipeline, the
distributed optimizer over DP, and Ulysses context parallelism (both), which shards whole noise groups.
"""

from __future__ import annotations

import pytest

from tests.distributed.runner import assert_same_run, run_saved, single_rank_runs

ITERS = ["--train-iters", "8"]
V1 = ["--num-noise-heads", "2", "--mlp-activation", "poly_norm", "--lambda-init", "motif", *ITERS]
V2 = ["--model", "gda-tiny", *ITERS]
PP2 = ["--pipeline-model-parallel-size", "2"]
LAYOUTS = {
    "v1_tp2_sp": (V1, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "v1_pp2_vp2": (V1, [*PP2, "--num-layers-per-virtual-pipeline-stage", "1"]),
    "v1_dp2_distopt": (V1, ["--use-distributed-optimizer"]),
    "v1_cp2": (V1, ["--context-parallel-size", "2"]),
    "v2_tp2": (V2, ["--tensor-model-parallel-size", "2"]),
    "v2_cp2": (V2, ["--context-parallel-size", "2"]),
}

single_rank = single_rank_runs("parity_gda", v1=V1, v2=V2)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_grouped_layout_matches_single_rank(single_rank, single_rank_parallel_state, layout):
    model, flags = LAYOUTS[layout]
    run_saved(single_rank, layout, [*model, *flags], nproc=2)
    v1 = layout.startswith("v1")
    expect = ("lambda_q1", "head_norm", "poly_norm") if v1 else ("linear_lambda",)
    assert_same_run(single_rank, "v1" if v1 else "v2", layout, iterations=8, expect=expect)
