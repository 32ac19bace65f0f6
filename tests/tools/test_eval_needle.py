"""tools/eval_needle.py end to end on two tiny checkpoints (mock vocabulary: id needles)."""

from __future__ import annotations

import csv
import json

import pytest

from tests.tools.helpers import run_tool

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_two_checkpoints_give_csv_json_and_heatmap_whatever_queries_are_asked(tiny_ckpts, tmp_path):
    out = tmp_path / "out"
    args = [
        "--load",
        tiny_ckpts["diff"],
        tiny_ckpts["transformer"],
        "--needles",
        "1",
        "2",
        "--queries",
        "2",
    ]
    args += ["--depths", "0", "1", "--samples", "1", "--output-dir", out]
    proc = run_tool("eval_needle", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out / "needle_accuracy.csv") as f:
        rows = list(csv.DictReader(f))
    combos = {(r["label"], r["needles"], r["queries"], r["length"], r["depth"]) for r in rows}
    # checkpoints x (2,2) and the heatmap's (2,1), though --queries leaves R=1 out (N=1, R=2: skipped)
    assert len(rows) == len(combos) == 2 * 2 * 2
    assert {r["length"] for r in rows} == {"64"} and all(0 <= float(r["accuracy"]) <= 1 for r in rows)
    summary = json.loads((out / "needle_summary.json").read_text())
    assert [c["architecture"] for c in summary["checkpoints"]] == ["DIFF", "Transformer"]
    assert set(summary["checkpoints"][0]["table"]) == {"N=2,R=2", "N=2,R=1"}
    assert summary["heatmap"] == {"needles": 2, "queries": 1}
    assert (out / "needle_heatmap.png").read_bytes()[:8] == PNG_MAGIC
    assert "N=2,R=2" in proc.stdout


def test_cli_missing_checkpoint_is_one_line_error(tmp_path, capsys):
    import importlib.util

    from tests.data.helpers import REPO_ROOT

    spec = importlib.util.spec_from_file_location("eval_needle", REPO_ROOT / "tools" / "eval_needle.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    with pytest.raises(SystemExit) as exit_info:
        tool.main(["--load", str(tmp_path / "nope"), "--output-dir", str(tmp_path / "o")])
    assert exit_info.value.code == 2
    assert (
        capsys.readouterr().err.strip().splitlines()[-1]
        == f"error: --load {tmp_path / 'nope'} is not a directory"
    )
