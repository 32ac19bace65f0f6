"""Every parallel layout reproduces the single-rank run of diff-tiny (losses, grad norms, final weights).

All runs start from the same weights because initialisation is layout-free (diffmeg.init), so no
checkpoint is needed to line them up. Weights are compared through the layout-free checkpoints:
each run's is loaded into a single-rank model.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.runner import assert_same_run, load_weights, run_saved, single_rank_runs

ITERS = ["--train-iters", "10"]
# Two layouts also run the chunked loss (what the long-context recipes run) against the single rank's whole
# logits, at no extra launch: 24 tokens per chunk, which do not divide a micro-batch's 128.
CHUNKED = ["--cross-entropy-chunk-size", "24"]
# Likewise a fused candidate of issue 30 where it touches TP-sharded tensors: torch's F.rms_norm on
# sequence-parallel shards (the weight's SP tag).
LAYOUTS = {
    "tp2": ["--tensor-model-parallel-size", "2"],
    "tp2_sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--norm-impl", "torch", *CHUNKED],
    "pp2": ["--pipeline-model-parallel-size", "2", *CHUNKED],  # the loss on the last stage only
    "dp2_distopt": ["--use-distributed-optimizer"],
}


single_rank = single_rank_runs("parity", single=ITERS)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_rank(single_rank, single_rank_parallel_state, layout):
    tmp = single_rank
    run_saved(tmp, layout, [*ITERS, *LAYOUTS[layout]], nproc=2)
    assert_same_run(tmp, "single", layout, iterations=10)
    # The head-norm weights moved away from their init (so their TP gradient reduction was exercised).
    weights = load_weights(tmp / layout)
    assert any(not torch.allclose(v, torch.ones_like(v)) for k, v in weights.items() if "head_norm" in k)
