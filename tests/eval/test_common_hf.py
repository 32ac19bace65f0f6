"""Analysis inputs mixing pretrain_diff.py checkpoints and their Hugging Face exports: the same models,
the same activation statistics (Llama export: bit-identical; DiffLlama export: to fp32 rounding)."""

from __future__ import annotations

import pytest

from diffmeg.errors import DiffmegError
from diffmeg.eval.common import CheckpointSet, forward, loaded_models
from tests.conversion.helpers import exported_eval


@pytest.fixture(scope="module")
def loads(tmp_path_factory) -> list[str]:
    """DIFF checkpoint, its DiffLlama export, Transformer checkpoint, its Llama export."""
    return [str(p) for arch in ("diff", "transformer") for p in exported_eval(tmp_path_factory, arch)]


def test_mixed_inputs_load_the_same_models(loads):
    import torch

    infos = CheckpointSet(loads).resolve()
    assert [i.hf for i in infos] == [False, True, False, True]
    assert [i.label for i in infos] == [
        "DIFF (diff)",
        "DIFF (exported-eval-diff)",
        "Transformer (transformer)",
        "Transformer (exported-eval-transformer)",
    ]
    prompt = list(range(3, 60, 2))
    logits = [forward(model, prompt) for _, model in loaded_models(infos)]
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(logits[3], logits[2])


def test_activation_stats_of_exports_equal_their_checkpoints(loads, tmp_path):
    from diffmeg.eval.activation_stats import ActivationStatsConfig, run_activation_stats

    summary = run_activation_stats(
        ActivationStatsConfig(
            CheckpointSet(loads), tokens=96, seq_length=48, output_dir=str(tmp_path), plot=False
        ),
        log=lambda message: None,
    )
    rows = {(r["label"], r["kind"]): r for r in _rows(tmp_path / "activation_stats.csv")}
    pairs = [("DIFF (diff)", "DIFF (exported-eval-diff)", 1e-5)]
    pairs.append(("Transformer (transformer)", "Transformer (exported-eval-transformer)", 0.0))
    for ours, export, rtol in pairs:
        kinds = [k for (label, k) in rows if label == ours]
        assert kinds and kinds == [k for (label, k) in rows if label == export]
        for kind in kinds:
            a, b = rows[(ours, kind)], rows[(export, kind)]
            assert a["count"] == b["count"]
            for column in ("top1", "top2", "top3", "top10", "top100", "median"):
                x, y = float(a[column]), float(b[column])
                assert abs(x - y) <= rtol * abs(x), (ours, kind, column, x, y)
    assert len(summary["checkpoints"]) == 4


def _rows(path):
    import csv

    with open(path) as f:
        return list(csv.DictReader(f))


def test_iteration_for_a_folder_is_refused(loads):
    with pytest.raises(DiffmegError, match="does not apply to .*Hugging Face folder"):
        CheckpointSet(loads[:2], iterations=[2]).resolve()
    infos = CheckpointSet(loads[:2], iterations=[2, None]).resolve()  # per --load: fine
    assert [i.iteration for i in infos] == [2, None]
