"""examples/toy_compare.sh at TOY_SMOKE=1 (what CI runs): every step end to end on tiny settings, the
attention and activation-outlier analyses included. The full comparison's numbers are in docs/results.md."""

from __future__ import annotations

import json
import math
import re

import pytest

from tests.examples.test_examples import run_example


@pytest.mark.slow
def test_toy_compare_smoke(tmp_path, tokenizer_file):
    out = tmp_path / "toy"
    # DIFF V1 and the Transformer (what the comparison is about): DIFF V2 would add a third of the runs
    # (~100 s of CI) to check the same script paths; V2 trains and evaluates in its own tests.
    proc = run_example(
        "toy_compare.sh",
        timeout=1800,
        TOY_OUT=str(out),
        TOY_SMOKE="1",
        TOY_MODELS="diff transformer",
        DIFFMEG_TOKENIZER_FILE=tokenizer_file,
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
    # the analyses of the final checkpoints: every model, setting and seed, every layer, both scales
    attention = results["attention"]
    layers = {r["layer"] for r in attention}
    assert layers == set(range(meta["layers"]))
    assert {(r["model"], r["setting"], r["seed"], r["layer"], r["normalised"]) for r in attention} == {
        (m, s, seed, layer, norm)
        for m in models
        for s in settings
        for seed in seeds
        for layer in layers
        for norm in (True, False)
    }
    for r in attention:
        assert all(math.isfinite(r[k]) for k in ("pair_mass", "noise_mass", "query_mass"))
        if r["normalised"]:  # rows sum to 1 on every architecture's scale
            assert r["pair_mass"] + r["noise_mass"] + r["query_mass"] == pytest.approx(1, abs=1e-4)
        assert (r["lambda"] is None) == (r["model"] == "transformer")
    kinds = {(r["model"], r["setting"], r["seed"], r["kind"]) for r in results["outliers"]}
    for m in models:
        for s in settings:
            for seed in seeds:
                assert {(m, s, seed, "attention_logits"), (m, s, seed, "hidden_states")} <= kinds
    assert all(r["top1"] >= r["top10"] >= r["median"] > 0 for r in results["outliers"])
    # one progress line per run, numbered per phase
    sweep = len(models) * len(settings) * len(lrs)
    assert len(re.findall(rf"\[\d+/{sweep}\] mqar ", proc.stdout)) == sweep
    assert len(re.findall(r"\] lm ", proc.stdout)) == len(models) * len(seeds)
    assert len(re.findall(rf"\[\d+/{2 * len(settings)}\] (attention|outliers) ", proc.stdout)) == 2 * len(
        settings
    )
    for png in ("mqar_accuracy.png", "lm_val_loss.png", "mqar_attention.png"):
        assert (out / "plots" / png).stat().st_size > 0
    tables = (out / "tables.md").read_text()
    assert all(f"| {s} |" in tables for s in settings) and "Language modelling" in tables
    assert "attention at the answers" in tables and "activation outliers" in tables
    # the final checkpoint of every run is kept (for the attention analyses), the intermediate ones not
    kept = sorted(p.name for p in out.glob(f"mqar/{settings[0]}/{models[0]}/*/ckpt/iter_*"))
    assert kept and all(name == f"iter_{meta['mqar_iters']:07d}" for name in kept)
