"""diffmeg/eval/upcycle_results.py (tools/upcycle_results.py): the upcycling section of docs/results.md from
a results JSON whose cells were worked out by hand; the page shows exactly the committed
docs/results/upcycle.json; examples/upcycle.sh at UPCYCLE_SMOKE=1 end to end (what CI runs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tests.examples.test_examples import run_example
from tests.tools.helpers import run_tool

# Two seeds, validation every 100 tokens up to 300. Transformer seed 1: 7.0, 6.5, 6.0; seed 2: 7.2, 6.7,
# 6.2 -> means 7.1, 6.6, 6.1 (min-max). DIFF V2 seed 1: 7.0, 6.4, 5.9; seed 2 only 7.0, 6.6 (its run
# stopped early): 300 tokens has one value. Final per seed at the last common step: seed 1 at 300 (5.9 -
# 6.0 = -0.1), seed 2 at 200 (6.6 - 6.7 = -0.1). First steps: 7.5 for both in seed 1; seed 2's DIFF V2
# has no first step (-).
RESULTS = {
    "meta": {"runs": []},
    "pretrain": {"final_val_loss": 7.4},
    "first_step": [
        {"model": "transformer", "seed": 1, "loss": 7.5},
        {"model": "diff2", "seed": 1, "loss": 7.5},
        {"model": "transformer", "seed": 2, "loss": 7.25},
    ],
    "val": [
        *(
            {"model": "transformer", "seed": s, "tokens": t, "val_loss": v}
            for s, values in ((1, (7.0, 6.5, 6.0)), (2, (7.2, 6.7, 6.2)))
            for t, v in zip((100, 200, 300), values, strict=True)
        ),
        *(
            {"model": "diff2", "seed": 1, "tokens": t, "val_loss": v}
            for t, v in ((100, 7.0), (200, 6.4), (300, 5.9))
        ),
        *({"model": "diff2", "seed": 2, "tokens": t, "val_loss": v} for t, v in ((100, 7.0), (200, 6.6))),
    ],
}
EXPECTED = """\
### Upcycling: validation loss while continuing (mean (min-max) over seeds)

| model | seeds | 100 tokens | 200 tokens | 300 tokens |
|---|---|---|---|---|
| Transformer (continued) | 2 | 7.100 (7.000-7.200) | 6.600 (6.500-6.700) | 6.100 (6.000-6.200) |
| DIFF V2 (upcycled) | 2 | 7.000 (7.000-7.000) | 6.500 (6.400-6.600) | 5.900 |

### Upcycling: per seed, first step and final validation loss

| seed | first-step loss, Transformer | first-step loss, DIFF V2 | final validation loss, Transformer | \
final validation loss, DIFF V2 | DIFF V2 - Transformer |
|---|---|---|---|---|---|
| 1 | 7.500000 | 7.500000 | 6.0000 | 5.9000 | -0.1000 |
| 2 | 7.250000 | - | 6.7000 | 6.6000 | -0.1000 |
"""


def test_tables_from_hand_worked_results(tmp_path):
    path = tmp_path / "results.json"
    path.write_text(json.dumps(RESULTS))
    proc = run_tool("upcycle_results", "tables", path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == EXPECTED
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"mqar": []}))
    proc = run_tool("upcycle_results", "tables", bad)
    assert proc.returncode == 2 and proc.stderr.strip() == "error: not an upcycle results file: no 'meta'"


def test_docs_results_show_the_committed_json():
    """docs/results.md's upcycling tables are the ones generated from docs/results/upcycle.json, so no
    figure there is typed by hand; the committed run is the full one (3 seeds, not the smoke run)."""
    committed = REPO_ROOT / "docs" / "results" / "upcycle.json"
    proc = run_tool("upcycle_results", "tables", committed)
    assert proc.returncode == 0, proc.stderr
    doc = (REPO_ROOT / "docs" / "results.md").read_text()
    sections = proc.stdout.split("### ")[1:]
    assert len(sections) == 2
    for section in sections:
        assert "### " + section.strip() in doc, section.splitlines()[0]
    results = json.loads(committed.read_text())
    assert not results["meta"]["smoke"] and {r["seed"] for r in results["val"]} == {1, 2, 3}
    first = {(r["model"], r["seed"]): r["loss"] for r in results["first_step"]}
    assert all(first[("diff2", s)] == first[("transformer", s)] for s in (1, 2, 3))  # the same function
    assert (REPO_ROOT / "docs" / "results" / "upcycle_val_loss.png").is_file()


@pytest.mark.slow
def test_upcycle_example_smoke(tmp_path, tokenizer_file):
    out = tmp_path / "upcycle"
    proc = run_example(
        "upcycle.sh",
        timeout=900,
        UPCYCLE_OUT=str(out),
        UPCYCLE_SMOKE="1",
        DIFFMEG_TOKENIZER_FILE=tokenizer_file,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    results = json.loads((out / "results.json").read_text())
    assert results["meta"]["smoke"] and {r["model"] for r in results["val"]} == {"transformer", "diff2"}
    first = {r["model"]: r["loss"] for r in results["first_step"]}
    assert first["diff2"] == first["transformer"]  # upcycling kept the function: the same first loss
    assert "pretrain_diff.py Transformer checkpoint" in proc.stdout
    assert (out / "tables.md").read_text().startswith("### Upcycling: validation loss")
    assert Path(out / "upcycle_val_loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
