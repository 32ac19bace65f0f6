"""Every parallel layout reproduces the single-rank run of diff2-tiny (DIFF V2): losses, grad norms,
then final weights including the lambda projection. Context parallelism runs megatron-core's core
attention inside diffmeg's Ulysses all-to-all (TE's own CP modes need a GPU)."""

from __future__ import annotations

import pytest

from tests.distributed.runner import assert_same_run, load_weights, run_saved, single_rank_runs

V2 = ["--model", "diff2-tiny", "--train-iters", "10"]
LAYOUTS = {
    "tp2": ["--tensor-model-parallel-size", "2"],
    "tp2_sp_gqa": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "dp2_distopt": ["--use-distributed-optimizer"],
    "cp2": ["--context-parallel-size", "2"],
}
GQA = ["--num-query-groups", "2"]  # 8 heads over 2 KV heads: query heads 0-7 share KV head 0


single_rank = single_rank_runs("parity_v2", single=V2, single_gqa=[*V2, *GQA])


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_v2_layout_matches_single_rank(single_rank, single_rank_parallel_state, layout):
    tmp = single_rank
    gqa = layout.endswith("gqa")
    run_saved(tmp, layout, [*V2, *(GQA if gqa else []), *LAYOUTS[layout]], nproc=2)
    assert_same_run(tmp, "single_gqa" if gqa else "single", layout, iterations=10, expect=("linear_lambda",))
    weights = load_weights(tmp / layout)
    assert not any("head_norm" in k or "lambda_q" in k for k in weights)  # no V1 parameters
    # lambda_proj moved away from its initial draw in every layer (its gradients reached every rank)
    from diffmeg.checkpoints import build_single_rank_model, read_checkpoint_args

    args, _ = read_checkpoint_args(str(tmp / layout))
    init = build_single_rank_model(args).state_dict()
    lam = [k for k in weights if "linear_lambda" in k]
    assert len(lam) == args.num_layers
    for k in lam:
        assert (weights[k] - init[k]).abs().max().item() > 1e-4, f"{k} did not train"
