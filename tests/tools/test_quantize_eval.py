"""tools/quantize_eval.py end to end on two tiny checkpoints with an id-form multiple-choice file."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from tests.tools.helpers import run_tool

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_two_checkpoints_give_csv_json_and_png(tiny_ckpts, tmp_path):
    rng = np.random.default_rng(0)
    items = [
        {
            "context_ids": rng.integers(0, 512, 12).tolist(),
            "choices_ids": [[1, 2], [3], [4, 5, 6]],
            "label": i % 3,
        }
        for i in range(3)
    ]
    (tmp_path / "mc.jsonl").write_text("".join(json.dumps(i) + "\n" for i in items))
    out = tmp_path / "out"
    proc = run_tool(
        "quantize_eval", "--load", tiny_ckpts["diff"], tiny_ckpts["transformer"], "--bits", "16", "4",
        "--choices", tmp_path / "mc.jsonl", "--tokens", "130", "--output-dir", out,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out / "quantize_eval.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["label"], r["bits"]) for r in rows] == [
        ("DIFF (diff)", "16"),
        ("DIFF (diff)", "4"),
        ("Transformer (transformer)", "16"),
        ("Transformer (transformer)", "4"),
    ]
    for r in rows:
        assert 0 <= float(r["acc"]) <= 1 and 0 <= float(r["acc_norm"]) <= 1
        assert abs(float(r["val_loss"]) - np.log(512)) < 1.0
    summary = json.loads((out / "quantize_eval.json").read_text())
    assert summary["items"] == 3 and summary["validation_tokens"] == 128  # windows of 65: 64 + 64 predictions
    for c in summary["checkpoints"]:
        assert c["bits"]["16"]["val_loss"] != c["bits"]["4"]["val_loss"]
    assert (out / "quantize_eval.png").read_bytes()[:8] == PNG_MAGIC


def test_a_bad_choices_file_is_one_line_error(tiny_ckpts, tmp_path):
    from diffmeg.errors import DiffmegError
    from diffmeg.eval.common import CheckpointSet
    from diffmeg.eval.quantize import QuantizeEvalConfig, run_quantize_eval

    (tmp_path / "bad.jsonl").write_text('{"context_ids": [1], "choices_ids": [[2]], "label": 0}\n')
    cfg = QuantizeEvalConfig(
        CheckpointSet([str(tiny_ckpts["diff"])]),
        choices=str(tmp_path / "bad.jsonl"),
        output_dir=str(tmp_path / "o"),
    )
    with pytest.raises(DiffmegError, match=r"bad.jsonl:1: needs a non-empty context, >= 2 non-empty choices"):
        run_quantize_eval(cfg)


def test_cli_bad_bit_width_is_one_line_error(tmp_path, capsys):
    """In-process through the tool's main (the check comes before any checkpoint is read)."""
    import importlib.util

    from tests.data.helpers import REPO_ROOT

    spec = importlib.util.spec_from_file_location("quantize_eval", REPO_ROOT / "tools" / "quantize_eval.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    with pytest.raises(SystemExit) as exit_info:
        tool.main(["--load", str(tmp_path), "--bits", "16", "1", "--output-dir", str(tmp_path / "o")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: bit widths must be 2..15, or 16 for no quantization; got 1"
    )
