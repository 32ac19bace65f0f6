"""Continued pretraining of an imported Motif checkpoint (tests/conversion/test_motif_import.py's tiny
folders, 4 layers) reproduces its single-rank run on the parallel layouts: losses, grad norms, then final
weights (lambda vectors, head norm, PolyNorm's weight and bias included), and a saved and resumed run
continues with the uninterrupted run's losses.

Both of Motif's layouts: Motif-2-12.7B's grouped differential attention (2 groups of [signal x 4, noise], a
K1/K2 pair each) and Motif-2.6B's paired sub-heads (4 DIFF heads over 2 K1/K2 pairs). Each is started from
its import with the flags hf-to-mcore prints, and trained at TP2 with sequence parallelism (one group, one
half of the FFN dimension a rank: PolyNorm's means are the sum of both shards' squares, its weight and bias
gradients the sum of both ranks') and at PP2 (Motif's lambda_init by global layer number on the second
stage); the grouped model also at DP2 and CP2. Two launches: the references and the resume on one rank,
the six layouts on two. The interleaved pipeline runs the same model family from scratch in
test_parity_gda.py.
"""

from __future__ import annotations

import shlex

import pytest

from tests.conversion.helpers import cached, convert_ok
from tests.conversion.test_motif_import import write_motif_folder
from tests.distributed.runner import assert_same_run, load_weights, read_losses
from tests.distributed.sequence import run_sequence

ITERS = 5
RESUME_AT = 3
TRAIN = ["--train-iters", str(ITERS), "--lr", "3e-4", "--min-lr", "3e-5"]
LAYOUTS = {
    "tp2_sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "dp2": [],  # two data-parallel ranks, half the global batch each
    "cp2": ["--context-parallel-size", "2"],
}
MOTIF = ("2.6b", "12.7b")
# every layout for the grouped model (Motif-2-12.7B); the paired one shares its data and context splitting
RUNS = [(layout, m) for m in MOTIF for layout in LAYOUTS if m == "12.7b" or layout in ("tp2_sp", "pp2")]
EXPECT = ("lambda_q1", "lambda_k2", "head_norm", "poly_norm.weight", "poly_norm.bias")


def continue_flags(factory, layout: str) -> list[str]:
    """The model flags (and --load CKPT --finetune) hf-to-mcore prints for the import of a 4-layer folder of
    `layout`, without the command's own --lr / --train-iters, nor its tokenizer (the runs train on
    --mock-data's token ids)."""

    def build(path):
        write_motif_folder(path, layout, num_hidden_layers=4)

    folder = cached(factory, f"motif-{layout}-4", build)
    ckpt = factory.getbasetemp() / f"motif-{layout}-import"
    command = shlex.split(convert_ok("hf-to-mcore", "--load", folder, "--save", ckpt).stdout.splitlines()[-1])
    assert command[:2] == ["python", "pretrain_diff.py"] and "--finetune" in command
    for flag in ("--lr", "--train-iters", "--tokenizer-type", "--tokenizer-model"):
        at = command.index(flag)
        del command[at : at + 2]
    return command[2:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parity_motif")
    model = {layout: continue_flags(tmp_path_factory, layout) for layout in MOTIF}
    resume = model["12.7b"][: model["12.7b"].index("--load")]  # the model flags, no --load / --finetune
    run_sequence(
        tmp,
        {
            **{f"single_{m}": [*model[m], *TRAIN] for m in MOTIF},
            # the same run interrupted after RESUME_AT steps (saved), then resumed from its checkpoint
            "part": [*model["12.7b"], *TRAIN, "--exit-interval", str(RESUME_AT)],
            "resumed": [*resume, *TRAIN, "--load", str(tmp / "part")],
        },
        nproc=1,
    )
    run_sequence(
        tmp,
        {f"{layout}_{m}": [*model[m], *TRAIN, *LAYOUTS[layout]] for layout, m in RUNS},
        nproc=2,
    )
    return tmp


@pytest.mark.slow
@pytest.mark.parametrize("layout, motif", RUNS)
def test_imported_motif_continues_training_on_the_layout_as_on_one_rank(
    runs, single_rank_parallel_state, motif, layout
):
    run = f"{layout}_{motif}"
    assert_same_run(runs, f"single_{motif}", run, iterations=ITERS, expect=EXPECT)
    ref, got = load_weights(runs / f"single_{motif}"), load_weights(runs / run)
    start = load_weights(runs.parent / f"motif-{motif}-import")
    # PolyNorm's parameters and the lambda vectors moved from the import (their gradients were summed)
    for name in ("poly_norm.weight", "poly_norm.bias", "lambda_q1"):
        keys = [k for k in ref if k.endswith(name)]
        assert keys and all(not got[k].equal(start[k]) for k in keys), name

    def worst(keys) -> float:
        return max((got[k] - ref[k]).abs().max().item() for k in keys)

    vocab = [k for k in ref if "word_embeddings" in k or "output_layer" in k]
    diff = [k for k in ref if any(name in k for name in EXPECT)]
    print(
        f"parity {run}: max abs weight difference {worst(set(ref) - set(vocab)):.2e} (lambda, head norm, "
        f"PolyNorm {worst(diff):.2e}; vocabulary matrices {worst(vocab):.2e})",
        flush=True,
    )


@pytest.mark.slow
def test_an_imported_motif_run_resumes_exactly(runs):
    """12.7B layout: RESUME_AT steps from the import, saved, exited, loaded (no --finetune: its iteration,
    optimizer and data position), the rest: the uninterrupted run's losses."""
    part, straight = read_losses(runs, "part"), read_losses(runs, "single_12.7b")
    resumed = read_losses(runs, "resumed")
    assert sorted(part) == list(range(1, RESUME_AT + 1))
    assert sorted(resumed) == list(range(RESUME_AT + 1, ITERS + 1))
    for it in range(1, ITERS + 1):
        assert {**part, **resumed}[it] == pytest.approx(straight[it], rel=1e-6, abs=0), it
