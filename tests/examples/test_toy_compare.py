"""examples/toy_compare.sh at TOY_SMOKE=1 (what CI runs): every step end to end on tiny settings. The
full comparison's numbers are in docs/results.md."""

from __future__ import annotations

import json
import re

import pytest

from tests.examples.test_examples import run_example


@pytest.mark.slow
def test_toy_compare_smoke(tmp_path, tokenizer_file):
    out = tmp_path / "toy"
    proc = run_example(
        "toy_compare.sh", timeout=1800, TOY_OUT=str(out), TOY_SMOKE="1", DIFFMEG_TOKENIZER_FILE=tokenizer_file
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    results = json.loads((out / "results.json").read_text())
    meta = results["meta"]
    models, settings, seeds, lrs = meta["models"], meta["settings"], meta["seeds"], meta["lrs"]
    assert {"diff", "transformer"} <= set(models) and len(settings) >= 2 and len(seeds) >= 2
    mqar = results["mqar"]
    for model in models:
        for setting in settings:
            valid = {
                (r["lr"], r["seed"])
                for r in mqar
                if (r["model"], r["setting"], r["split"]) == (model, setting, "valid")
            }
            assert {(lr, seeds[0]) for lr in lrs} <= valid  # the first seed sweeps every rate
            test = [r for r in mqar if (r["model"], r["setting"], r["split"]) == (model, setting, "test")]
            assert {r["seed"] for r in test} == set(seeds)
            assert sorted({r["step"] for r in test}) == list(
                range(meta["eval_every"], meta["mqar_iters"] + 1, meta["eval_every"])
            )
            assert all(0.0 <= r["accuracy"] <= 1.0 for r in test)
        lm = [r for r in results["lm"] if r["model"] == model]
        assert {r["seed"] for r in lm} == set(seeds) and all(r["val_loss"] > 0 for r in lm)
    # one progress line per run, numbered per phase
    sweep = len(models) * len(settings) * len(lrs)
    assert len(re.findall(rf"\[\d+/{sweep}\] mqar ", proc.stdout)) == sweep
    assert len(re.findall(r"\] lm ", proc.stdout)) == len(models) * len(seeds)
    for png in ("mqar_accuracy.png", "lm_val_loss.png"):
        assert (out / "plots" / png).stat().st_size > 0
    tables = (out / "tables.md").read_text()
    assert all(f"| {s} |" in tables for s in settings) and "Language modelling" in tables
    # the final checkpoint of every run is kept (for the attention analyses), the intermediate ones not
    kept = sorted(p.name for p in out.glob(f"mqar/{settings[0]}/{models[0]}/*/ckpt/iter_*"))
    assert kept and all(name == f"iter_{meta['mqar_iters']:07d}" for name in kept)
