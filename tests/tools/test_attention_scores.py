"""tools/attention_scores.py end to end on two tiny checkpoints (DIFF and Transformer)."""

from __future__ import annotations

import csv
import json

import pytest

from tests.tools.helpers import run_tool

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_two_checkpoints_give_csv_json_and_png(tiny_ckpts, tmp_path):
    out = tmp_path / "out"
    proc = run_tool(
        "attention_scores", "--load", tiny_ckpts["diff"], tiny_ckpts["transformer"], "--samples", "2",
        "--depths", "0", "0.5", "1", "--output-dir", out,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out / "attention_scores.csv") as f:
        rows = list(csv.DictReader(f))
    labels = {"DIFF (diff)": "DIFF", "Transformer (transformer)": "Transformer"}
    assert {r["label"] for r in rows} == set(labels)
    for label, arch in labels.items():
        mine = [r for r in rows if r["label"] == label]
        assert {r["architecture"] for r in mine} == {arch}
        assert {float(r["depth"]) for r in mine} == {0.0, 0.5, 1.0}
        assert {int(r["layer"]) for r in mine} == set(range(4))
        for r in mine:
            answer, noise = float(r["answer_mass"]), float(r["noise_mass"])
            if arch == "Transformer":  # a softmax row: non-negative, at most 1 over the context
                assert 0 <= answer <= 1 and 0 <= noise and answer + noise <= 1 + 1e-6
            else:  # A1 - lambda A2: rows sum to 1 - lambda < 1
                assert answer + noise < 1
    summary = json.loads((out / "attention_scores.json").read_text())
    diff, transformer = summary["checkpoints"]
    assert diff["architecture"] == "DIFF" and set(diff["lambda_by_layer"]) == {"0", "1", "2", "3"}
    assert transformer["lambda_by_layer"] is None
    assert set(diff["by_depth"]) == {"0.0", "0.5", "1.0"}
    assert (out / "attention_scores.png").read_bytes()[:8] == PNG_MAGIC
    assert "DIFF (diff)" in proc.stdout


def test_text_files_with_a_mock_checkpoint_is_refused_before_loading(tiny_ckpts, tmp_path):
    from diffmeg.errors import DiffmegError
    from diffmeg.eval.attention_scores import AttentionScoresConfig, run_attention_scores
    from diffmeg.eval.common import CheckpointSet

    cfg = AttentionScoresConfig(
        CheckpointSet([str(tiny_ckpts["diff"])]), text_files=[str(tmp_path)], output_dir=str(tmp_path / "o")
    )
    with pytest.raises(DiffmegError, match="was trained on mock ids .* need a cl100k checkpoint"):
        run_attention_scores(cfg)
