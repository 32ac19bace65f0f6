"""tools/toy_compare_results.py: docs/results.md's tables from a results.json fixture whose expected
cells were worked out by hand, the learning-rate choice, and collecting a toy_compare.sh directory."""

from __future__ import annotations

import json
from pathlib import Path

from tests.tools.helpers import run_tool

FIXTURE = Path(__file__).parent / "fixtures" / "toy_compare_results.json"

# The fixture: seed 1 sweeps lr 0.001 and 0.003. DIFF V1 on kv8 validates 0.5 / 0.95 -> 0.003; the
# Transformer ties at 0.4 -> the smaller 0.001. Held-out finals at the chosen rate: DIFF 0.92, 0.95, 0.5
# (mean 0.79), first >= 0.9 at steps 100, 50, never; Transformer 0.3, 0.35, 0.25. A DIFF run at 0.001
# that reaches 0.99 is not at the chosen rate and must not appear. LM: DIFF seeds 5.0/5.2 and 4.0/4.2.
# Attention (kv8, normalised): DIFF layer 0 pair 0.6 / 0.8, noise 0.2 / 0.1 -> ratio 0.7 / 0.15 = 4.67,
# raw pair 0.3 / 0.5, raw noise 0.1 / 0.06, lambda 0.5 / 0.4; layer 1 noise -0.05 / 0.05 averages to 0:
# no ratio. Outliers: DIFF top-1 10 / 12 over medians 0.5 / 1 -> ratios 20 / 12, mean 16; its
# attention_logits_1 row is not one of the table's kinds.
EXPECTED = """\
### MQAR: held-out accuracy at the chosen learning rate

| setting | model | lr | seeds | final accuracy, mean (min-max) | steps to 90% per seed |
|---|---|---|---|---|---|
| kv8 | DIFF V1 | 0.003 | 3 | 0.790 (0.500-0.950) | 100, 50, - |
| kv8 | Transformer | 0.001 | 3 | 0.300 (0.250-0.350) | -, -, - |
| kv16 | DIFF V1 | 0.003 | 1 | 0.250 | - |

### MQAR: learning-rate sweep (final validation accuracy, seed 1)

| setting | model | lr 0.001 | lr 0.003 |
|---|---|---|---|
| kv8 | DIFF V1 | 0.500 | 0.950 |
| kv8 | Transformer | 0.400 | 0.400 |
| kv16 | DIFF V1 | - | 0.200 |

### Language modelling: validation loss

| model | seeds | 1,000 tokens | 2,000 tokens |
|---|---|---|---|
| DIFF V1 | 2 | 5.100 (5.000-5.200) | 4.100 (4.000-4.200) |
| Transformer | 1 | 5.100 | 4.100 |

### MQAR: attention at the answers on the queried pair vs the rest of the context

| setting | model | layer | seeds | pair | noise | pair / noise | raw pair | raw noise | lambda |
|---|---|---|---|---|---|---|---|---|---|
| kv8 | DIFF V1 | 0 | 2 | 0.700 (0.600-0.800) | 0.150 (0.100-0.200) | 4.67 | 0.400 | 0.080 | 0.450 |
| kv8 | DIFF V1 | 1 | 2 | 0.150 (0.100-0.200) | 0.000 (-0.050-0.050) | - | 0.075 | 0.000 | 0.500 |
| kv8 | Transformer | 0 | 1 | 0.300 | 0.600 | 0.50 | 0.300 | 0.600 | - |

### MQAR: activation outliers on the held-out documents

| setting | model | kind | seeds | top-1 | top-10 | median | top-1 / median | kurtosis |
|---|---|---|---|---|---|---|---|---|
| kv8 | DIFF V1 | attention logits | 2 | 11.00 (10.00-12.00) | 6.00 | 0.750 | 16.0 | 25.0 (20.0-30.0) |
| kv8 | DIFF V1 | hidden states | 2 | 150.00 (100.00-200.00) | 55.00 | 1.500 | 100.0 | 600.0 (500.0-700.0) |
| kv8 | Transformer | attention logits | 1 | 8.00 | 4.00 | 0.500 | 16.0 | 10.0 |
| kv8 | Transformer | hidden states | 1 | 50.00 | 20.00 | 0.250 | 200.0 | 3.5 |
"""


def test_tables_from_the_fixture():
    proc = run_tool("toy_compare_results", "tables", FIXTURE)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == EXPECTED.strip()


def test_best_lr():
    for model, lr in (("diff", "0.003"), ("transformer", "0.001")):
        proc = run_tool("toy_compare_results", "best-lr", FIXTURE, "--model", model, "--setting", "kv8")
        assert proc.returncode == 0 and proc.stdout.strip() == lr, proc.stderr
    proc = run_tool("toy_compare_results", "best-lr", FIXTURE, "--model", "transformer", "--setting", "kv16")
    assert proc.returncode == 2 and "no validation result for transformer on kv16" in proc.stderr


def test_a_file_that_is_not_results_is_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"mqar": []}))
    proc = run_tool("toy_compare_results", "tables", bad)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "no 'lm' list" in proc.stderr


def _write(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else json.dumps(data))


def test_collect_a_run_directory(tmp_path):
    out = tmp_path / "run"
    _write(out / "meta.json", {"settings": ["kv4"], "seeds": [1]})
    run = out / "mqar" / "kv4" / "diff" / "lr0.003-s1"
    _write(run / "run.json", {"kind": "mqar", "model": "diff", "setting": "kv4", "seed": 1, "lr": 0.003})
    evals = [(10, "test", 0.25), (10, "valid", 0.5), (20, "test", 0.5), (20, "valid", 0.75)]
    evals = [{"iteration": i, "data_prefix": f"/d/kv4-{s}", "accuracy": a} for i, s, a in evals]
    evals[2] |= {"by_query": [0.75, 0.25], "by_pair": [0.5, 0.5]}  # step 20, test
    _write(run / "eval" / "mqar_summary.json", {"results": evals})
    lm = out / "lm" / "transformer" / "s1"
    _write(lm / "run.json", {"kind": "lm", "model": "transformer", "seed": 1, "tokens_per_iter": 1024})
    metrics = [{"iteration": 5, "lm_loss": 7.0}, {"iteration": 5, "validation_lm_loss": 6.5}]
    _write(lm / "metrics.jsonl", "\n".join(json.dumps(m) for m in metrics) + "\n")
    analysis = out / "analysis" / "kv4"
    layers = [
        {"layer": 0, "answers": 8, "lambda": 0.3}
        | {
            s: {"pair": p, "noise": n, "query": 0.1, "ratio": p / n}
            for s, p, n in (("normalised", 0.6, 0.3), ("raw", 0.42, 0.21))
        }
    ]
    attention = {"results": [{"label": "diff2-s1", "iteration": 20, "setting": "kv4", "layers": layers}]}
    _write(analysis / "attention" / "mqar_attention.json", attention)
    stats = {k: 1.0 for k in ("top1", "top2", "top3", "top10", "top100", "median", "kurtosis")} | {"count": 9}
    _write(
        analysis / "outliers" / "activation_stats.json",
        {"checkpoints": [{"label": "diff2-s1", "stats": {"hidden_states": stats}}]},
    )
    proc = run_tool("toy_compare_results", "collect", out)
    assert proc.returncode == 0, proc.stderr
    results = json.loads((out / "results.json").read_text())
    key = {"model": "diff", "setting": "kv4", "seed": 1, "lr": 0.003}
    assert results["mqar"] == [
        {**key, "step": 10, "accuracy": 0.25, "split": "test"},
        {**key, "step": 10, "accuracy": 0.5, "split": "valid"},
        {**key, "step": 20, "accuracy": 0.5, "split": "test"},
        {**key, "step": 20, "accuracy": 0.75, "split": "valid"},
    ]
    assert results["mqar_positions"] == [{**key, "step": 20, "by_query": [0.75, 0.25], "by_pair": [0.5, 0.5]}]
    assert results["lm"] == [{"model": "transformer", "seed": 1, "tokens": 5120, "val_loss": 6.5}]
    assert results["meta"]["settings"] == ["kv4"] and len(results["meta"]["runs"]) == 2
    where = {"model": "diff2", "setting": "kv4", "seed": 1}
    assert results["attention"] == [
        {**where, "step": 20, "layer": 0, "normalised": True, "pair_mass": 0.6, "noise_mass": 0.3}
        | {"query_mass": 0.1, "ratio": 0.6 / 0.3, "lambda": 0.3},
        {**where, "step": 20, "layer": 0, "normalised": False, "pair_mass": 0.42, "noise_mass": 0.21}
        | {"query_mass": 0.1, "ratio": 0.42 / 0.21, "lambda": 0.3},
    ]
    assert results["outliers"] == [{**where, "kind": "hidden_states", **stats}]
    for png in ("mqar_accuracy.png", "lm_val_loss.png", "mqar_attention.png"):
        assert (out / "plots" / png).stat().st_size > 0
    attention["results"][0]["label"] = "diff2 seed 1"  # not the MODEL-sSEED examples/toy_compare.sh gives
    _write(analysis / "attention" / "mqar_attention.json", attention)
    proc = run_tool("toy_compare_results", "collect", out)
    assert proc.returncode == 2 and "label 'diff2 seed 1' is not MODEL-sSEED" in proc.stderr


def test_model_flags_keep_the_head_size_and_scale_the_heads():
    import subprocess

    from tests.tools.helpers import tool_cmd, tool_env

    def flags(hidden: int, heads: int = 8, groups: int = 8) -> subprocess.CompletedProcess:
        dry = {"model": {"preset": "transformer-tiny", "hidden_size": 256, "num_attention_heads": heads}}
        dry["model"].update(num_query_groups=groups, head_dim=32)
        cmd = tool_cmd("toy_compare_results", "model-flags", "--layers", "2", "--hidden", str(hidden))
        return subprocess.run(cmd, input=json.dumps(dry), env=tool_env(), capture_output=True, text=True)

    proc = flags(64)
    assert proc.returncode == 0, proc.stderr
    assert (
        proc.stdout.split()
        == (
            "--model transformer-tiny --num-layers 2 --hidden-size 64 --num-attention-heads 2 "
            "--num-query-groups 2 --kv-channels 32 --ffn-hidden-size 128"
        ).split()
    )
    assert "--num-attention-heads 4 --num-query-groups 1" in flags(128, 8, 2).stdout
    three = flags(96, 8, 8)  # 8 heads x 96/256 = 3 heads: fine; 2 KV groups would not be
    assert three.returncode == 0 and "--num-attention-heads 3" in three.stdout
    proc = flags(96, 8, 2)
    assert proc.returncode == 2 and "cannot scale transformer-tiny" in proc.stderr


def test_model_flags_keep_a_grouped_preset_grouping():
    """gda-tiny (8 signal heads of 32 over 2 noise heads and 2 KV heads at hidden 256) at hidden 64: one
    noise group of 4 signal heads, so the head size shrinks to 16; at hidden 128 it keeps 32."""
    import subprocess

    from tests.tools.helpers import tool_cmd, tool_env

    def flags(hidden: int) -> subprocess.CompletedProcess:
        dry = {"model": {"preset": "gda-tiny", "hidden_size": 256, "num_attention_heads": 8}}
        dry["model"].update(num_query_groups=2, num_noise_heads=2, head_dim=32)
        cmd = tool_cmd("toy_compare_results", "model-flags", "--layers", "2", "--hidden", str(hidden))
        return subprocess.run(cmd, input=json.dumps(dry), env=tool_env(), capture_output=True, text=True)

    want = {
        64: "--num-attention-heads 4 --num-noise-heads 1 --num-query-groups 1 --kv-channels 16",
        128: "--num-attention-heads 4 --num-noise-heads 1 --num-query-groups 1 --kv-channels 32",
        512: "--num-attention-heads 16 --num-noise-heads 4 --num-query-groups 4 --kv-channels 32",
    }
    for hidden, heads in want.items():
        proc = flags(hidden)
        assert proc.returncode == 0 and heads in proc.stdout, (hidden, proc.stdout, proc.stderr)
    proc = flags(66)
    assert proc.returncode == 2 and "cannot hold gda-tiny's 4:1 grouping" in proc.stderr


def _part(models: list[str], **meta) -> dict:
    protocol = {"settings": ["kv8"], "lrs": [0.001], "seeds": [1], "mqar_iters": 10, "hidden": 64}
    rows = {k: [{"model": m, "seed": 1} for m in models] for k in ("mqar", "lm", "attention", "outliers")}
    arch = {m: f"--model {m}-tiny" for m in models}
    return {"meta": protocol | {"models": models, "arch": arch} | meta} | rows


def test_merge_adds_a_model_run_later(tmp_path):
    """A model run on its own (TOY_MODELS=gda) joins the committed results when the protocol matches;
    another protocol, a model in both, or a smoke run is one line."""
    first, later = tmp_path / "a.json", tmp_path / "b.json"
    _write(first, _part(["diff", "transformer"], date="d1", runs=[{"model": "diff"}]))
    _write(later, _part(["gda"], date="d2", runs=[{"model": "gda"}]))
    out = tmp_path / "merged.json"
    proc = run_tool("toy_compare_results", "merge", first, later, "--output", out)
    assert proc.returncode == 0, proc.stderr
    merged = json.loads(out.read_text())
    assert merged["meta"]["models"] == ["diff", "gda", "transformer"]  # the tables' order
    assert merged["meta"]["arch"] == {m: f"--model {m}-tiny" for m in ("diff", "transformer", "gda")}
    assert [r["model"] for r in merged["meta"]["runs"]] == ["diff", "gda"]
    sources = [(m["source"], m["date"]) for m in merged["meta"]["merged"]]
    assert sources == [("a.json", "d1"), ("b.json", "d2")]
    assert [r["model"] for r in merged["lm"]] == ["diff", "transformer", "gda"]
    assert merged["meta"]["settings"] == ["kv8"] and merged["meta"]["mqar_iters"] == 10
    _write(later, _part(["gda"], mqar_iters=20))
    proc = run_tool("toy_compare_results", "merge", first, later, "--output", out)
    assert proc.returncode == 2 and "other mqar_iters" in proc.stderr and "20 vs 10" in proc.stderr
    _write(later, _part(["diff"]))
    proc = run_tool("toy_compare_results", "merge", first, later, "--output", out)
    assert proc.returncode == 2 and "holds diff again" in proc.stderr
    _write(later, _part(["gda"], smoke=True))
    proc = run_tool("toy_compare_results", "merge", first, later, "--output", out)
    assert proc.returncode == 2 and "is a smoke run" in proc.stderr


def test_docs_results_show_the_committed_json():
    """docs/results.md's tables are the ones generated from docs/results/toy_compare.json, so no figure
    there is typed by hand and the two cannot drift apart."""
    from tests.data.helpers import REPO_ROOT

    committed = REPO_ROOT / "docs" / "results" / "toy_compare.json"
    proc = run_tool("toy_compare_results", "tables", committed)
    assert proc.returncode == 0, proc.stderr
    doc = (REPO_ROOT / "docs" / "results.md").read_text()
    sections = proc.stdout.split("### ")[1:]
    assert len(sections) >= 4  # MQAR accuracy, learning-rate sweep, language modelling, analyses
    for section in sections:
        assert "### " + section.strip() in doc, section.splitlines()[0]
    results = json.loads(committed.read_text())
    assert {r["seed"] for r in results["mqar"]} == {1, 2, 3} and {r["seed"] for r in results["lm"]} == {
        1,
        2,
        3,
    }
