"""tools/activation_stats.py end to end on two tiny checkpoints, reading an indexed dataset."""

from __future__ import annotations

import csv
import json

import numpy as np

from tests.eval.helpers import periodic_documents, write_indexed_dataset
from tests.tools.helpers import run_tool

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_two_checkpoints_give_csv_json_and_png(tiny_ckpts, tmp_path):
    prefix = write_indexed_dataset(tmp_path / "docs", periodic_documents([50, 30, 90]))
    out = tmp_path / "out"
    proc = run_tool(
        "activation_stats", "--load", tiny_ckpts["diff"], tiny_ckpts["transformer"], "--data-prefix", prefix,
        "--tokens", "150", "--output-dir", out,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out / "activation_stats.csv") as f:
        rows = list(csv.DictReader(f))
    kinds = {(r["label"], r["kind"]) for r in rows}
    assert kinds == {
        ("DIFF (diff)", "attention_logits"),
        ("DIFF (diff)", "attention_logits_1"),
        ("DIFF (diff)", "attention_logits_2"),
        ("DIFF (diff)", "hidden_states"),
        ("Transformer (transformer)", "attention_logits"),
        ("Transformer (transformer)", "hidden_states"),
    }
    for r in rows:
        tops = [float(r[k]) for k in ("top1", "top2", "top3", "top10", "top100")]
        assert tops == sorted(tops, reverse=True) and np.isfinite(tops).all()
        assert 0 < float(r["median"]) <= tops[-1]
    summary = json.loads((out / "activation_stats.json").read_text())
    hidden = summary["checkpoints"][0]["stats"]["hidden_states"]
    assert hidden["count"] == 150 * 4 * 256  # tokens x layers x hidden size
    assert (out / "activation_stats.png").read_bytes()[:8] == PNG_MAGIC
