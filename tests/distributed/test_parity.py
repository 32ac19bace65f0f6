"""Every parallel layout reproduces the single-rank run of diff-tiny (losses and final weights).

All runs start from the same weights because initialisation is layout-free (diffmeg.init), so no
checkpoint is needed to line them up. Weights are compared through the layout-free checkpoints:
each run's is loaded into a single-rank model.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.runner import read_losses, run_training

ITERS = ["--train-iters", "10"]
LAYOUTS = {
    "tp2": ["--tensor-model-parallel-size", "2"],
    "tp2_sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "dp2_distopt": ["--use-distributed-optimizer"],
}


@pytest.fixture(scope="module")
def single_rank(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parity")
    run_training(tmp, "single", [*ITERS, "--save", str(tmp / "single")])
    return tmp


def _weights(root) -> dict[str, torch.Tensor]:
    from diffmeg.training.checkpointing import load_model_weights

    model, _ = load_model_weights(str(root))
    return {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_rank(single_rank, single_rank_parallel_state, layout):
    tmp = single_rank
    run_training(tmp, layout, [*ITERS, *LAYOUTS[layout], "--save", str(tmp / layout)], nproc=2)
    ref, got = read_losses(tmp, "single"), read_losses(tmp, layout)
    assert sorted(got) == list(range(1, 11))
    for it in ref:
        assert got[it] == pytest.approx(ref[it], rel=1e-5), f"iteration {it}: {got[it]} vs {ref[it]}"
    w_ref, w_got = _weights(tmp / "single"), _weights(tmp / layout)
    assert w_ref.keys() == w_got.keys()
    lambda_keys = [k for k in w_ref if "lambda" in k or "head_norm" in k]
    assert lambda_keys, "the lambda vectors and head norm must be compared"
    # 10 Adam steps of lr <= 1e-3 move weights by up to ~1e-2; Adam's normalisation turns float rounding
    # in near-zero gradients (a rarely seen embedding row) into differences up to ~1e-5. 5e-5 is far
    # below any real error (a missing TP reduction of lambda shows up at ~1e-3).
    for key in w_ref:
        torch.testing.assert_close(w_got[key], w_ref[key], rtol=1e-4, atol=5e-5, msg=f"{layout}: {key}")
    # The lambda / head-norm weights moved (so their TP gradient reduction was exercised).
    init_free = [k for k in lambda_keys if "head_norm" in k]
    assert any(not torch.allclose(w_ref[k], torch.ones_like(w_ref[k])) for k in init_free)
