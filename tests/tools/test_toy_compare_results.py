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
    for png in ("mqar_accuracy.png", "lm_val_loss.png"):
        assert (out / "plots" / png).stat().st_size > 0


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
