"""Context parallelism matches the single-rank run: Ulysses all-to-all inside differential attention, and
megatron-core's TE-style CP (`--cp-comm-type p2p/all_gather`) through the plain-torch TE stand-in.

Run as a module (`python -m tests.distributed.test_context_parallel ARGS`), this file is pretrain_diff.py
with `AllGatherCPAttention` installed where TEDotProductAttention would be built (no TE on CPU).
"""

from __future__ import annotations

import sys

import pytest
import torch

from tests.conftest import REPO_ROOT
from tests.distributed.runner import assert_same_run, run_saved, single_rank_runs

SEQ256 = ["--seq-length", "256", "--train-iters", "10", "--micro-batch-size", "1", "--global-batch-size", "4"]


single_rank = single_rank_runs("cp", single=SEQ256)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,nproc,extra",
    [
        ("cp2", 2, ["--context-parallel-size", "2", "--cross-entropy-chunk-size", "40"]),  # + chunked loss
        ("cp2_tp2", 4, ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2"]),
    ],
)
def test_context_parallel_matches_single_rank(single_rank, single_rank_parallel_state, name, nproc, extra):
    run_saved(single_rank, name, [*SEQ256, *extra], nproc=nproc)
    assert_same_run(single_rank, "single", name, iterations=10)


@pytest.mark.slow
@pytest.mark.parametrize("comm", ["p2p", "all_gather"])  # V of width 2d in one call / split in halves
def test_te_style_context_parallel_matches_single_rank(single_rank, single_rank_parallel_state, comm):
    """CP=2 with both maps run by the TE stand-in: losses, grad norms, final weights (lambda, head norm)."""
    name = f"cp2_te_{comm}"
    extra = [*SEQ256, "--context-parallel-size", "2", "--cp-comm-type", comm]
    # This module's entry point installs the TE stand-in, then runs pretrain_diff.py's main.
    run_saved(single_rank, name, extra, nproc=2, target=["-m", "tests.distributed.test_context_parallel"])
    assert_same_run(single_rank, "single", name, iterations=10)


def test_all_to_all_round_trip_and_layout(single_rank_parallel_state):
    """With CP=1 groups the transforms are identities; the chunk bookkeeping is checked directly."""
    from diffmeg.parallel import cp_chunk_ids, natural_order, slice_sequence_for_cp

    assert cp_chunk_ids(0, 2) == (0, 3) and cp_chunk_ids(1, 2) == (1, 2)
    seq = torch.arange(16)[None]  # [b=1, s=16], cp=2 -> chunks of 4
    r0, r1 = (slice_sequence_for_cp(seq, 1, r, 2)[0] for r in (0, 1))
    assert r0.tolist() == [0, 1, 2, 3, 12, 13, 14, 15] and r1.tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    gathered = torch.cat([r0, r1])
    assert gathered[natural_order(16, 2, gathered.device)].tolist() == list(range(16))


def test_cp_layout_errors(monkeypatch):
    from diffmeg.errors import DiffmegError
    from diffmeg.training.arguments import resolve_args

    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(DiffmegError, match="divisible by it"):
        resolve_args(["--model", "diff-tiny", "--context-parallel-size", "8"])
    with pytest.raises(DiffmegError, match=r"divisible by 2 x CP"):
        resolve_args(["--model", "diff-tiny", "--context-parallel-size", "4", "--seq-length", "100"])
    with pytest.raises(DiffmegError, match="Transformer Engine"):
        resolve_args(["--model", "transformer-tiny", "--context-parallel-size", "2"])


# pretrain_diff.py with the TE stand-in installed; the dist-checkpoint writer's spawn needs the guard.
if __name__ == "__main__":
    sys.path.insert(0, str(REPO_ROOT))
    import pretrain_diff
    from tests.parallel import cp_stand_in

    cp_stand_in.install()
    sys.exit(pretrain_diff.main(sys.argv[1:]))
