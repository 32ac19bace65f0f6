"""benchmarks/report.py: docs/benchmarks.md's GPU tables come from results files only."""

from __future__ import annotations

import json

import pytest

from benchmarks import report
from tests.benchmarks.fixtures import cpu_smoke_result, gpu_result


def _write(folder, name, result):
    (folder / name).write_text(json.dumps(result))


def test_tables_render_from_the_gpu_file_and_never_from_a_cpu_smoke(tmp_path):
    _write(tmp_path, "campaign-h100-1.json", gpu_result())
    _write(tmp_path, "campaign-cpu-1.json", cpu_smoke_result())
    text = report.render(report.load_results(tmp_path))
    assert text.startswith(report.BEGIN) and text.endswith(report.END)
    assert "| bf16 matmul TFLOP/s (measured) | 782 |" in text
    assert "| dense bf16 peak TFLOP/s (the MFU denominator) | 989 |" in text
    assert "1.35x | >= 1.3x" in text
    assert "0.941 (bound 0.956)" in text
    assert "| MFU transformer at 4K (baseline) | 47.2% | >= 45% |" in text
    assert "40 passed, 1 failed, 0 errors, 3 skipped" in text
    assert (
        "| diff triton f128x64s2w8 kv32x128 q128x32 w8 | – | – | – | – | – | OutOfResources: smem |" in text
    )
    assert "| diff-3b 4L s4096 mbs2 recompute=none | 30.00 | 28.50 | 0.95 |  |" in text
    # the profiled row only (the baseline row has none), in KINDS order; 0.0 GiB held before the DIFF row
    profiled = "| diff-3b | triton | 4096 | 512.5 | 58% | 25% | 4% | 3% | 0% | 10% | `nvjet_tst_256x128` |"
    assert profiled in text
    assert "| transformer-3b | baseline | 4096 | 512.5" not in text and "| 41.0 | 42.0 | 0.0 |" in text
    assert "| diff-tiny | 50 | 11.610 → 6.020 | True | 0.0e+00 | True |  |" in text
    assert "git 012345678" in text and "NVIDIA H100 80GB HBM3" in text
    # the CPU smoke file is named as such, its numbers never shown
    assert "Not GPU results (CPU or smoke runs, never shown above): `campaign-cpu-1.json`." in text
    assert "987" not in text and "0.000123" not in text


def test_newest_file_holding_a_figure_wins(tmp_path):
    _write(tmp_path, "a.json", gpu_result("2026-12-01T10:00:00+00:00", speedup=1.10))
    newer = gpu_result("2026-12-03T10:00:00+00:00", speedup=1.42)
    newer["train"] = []
    _write(tmp_path, "b.json", newer)
    text = report.render(report.load_results(tmp_path))
    assert "1.42x" in text and "1.10x" not in text
    assert "Training steps" in text and "`a.json`" in text.split("Training steps")[1].splitlines()[0]


def test_only_cpu_files_means_no_gpu_results(tmp_path):
    _write(tmp_path, "campaign-cpu-1.json", cpu_smoke_result())
    text = report.render(report.load_results(tmp_path))
    assert "No GPU results yet" in text and "| file |" not in text


def test_doc_update_check_and_refusal(tmp_path, capsys):
    results, doc = tmp_path / "results", tmp_path / "doc.md"
    results.mkdir()
    _write(results, "g.json", gpu_result())
    doc.write_text(f"# Benchmarks\n\nintro\n\n{report.BEGIN}\nstale\n{report.END}\n\ntail\n")
    args = ["--results", str(results), "--doc", str(doc)]
    assert report.main([*args, "--check"]) == 1
    assert report.main(args) == 0
    text = doc.read_text()
    assert (
        text.startswith("# Benchmarks\n\nintro\n\n") and text.endswith("\n\ntail\n") and "stale" not in text
    )
    assert report.main([*args, "--check"]) == 0
    _write(results, "bad.json", {"schema": "other"})
    assert report.main([*args, "--check"]) == 2
    assert "bad.json" in capsys.readouterr().err


def test_update_doc_appends_when_markers_are_missing():
    section = f"{report.BEGIN}\nx\n{report.END}"
    assert report.update_doc("# Doc\n", section) == f"# Doc\n\n{section}\n"


def test_the_repository_doc_matches_its_results_files():
    """docs/benchmarks.md carries no GPU number that benchmarks/results/ does not hold."""
    if not report.DOC.is_file():
        pytest.skip("docs/benchmarks.md missing")
    assert report.main(["--check"]) == 0


def test_the_lever_table_shows_each_gain_from_a_results_file():
    """Rendered from any results file's `levers` (here a CPU smoke's; GPU files fill the doc)."""
    r = cpu_smoke_result()
    base = ["--diff-attn-backend", "sdpa"]
    fused = {"lever": "fused optimizer", "model": "diff-tiny", "seq": 64, "note": "", "error": None}
    fused.update(on=[*base, "--optimizer-impl", "fused"], off=[*base, "--optimizer-impl", "megatron"])
    fused.update(off_tokens_per_s=100.0, on_tokens_per_s=125.0, gain=1.25)
    chunked = {"lever": "chunked loss", "model": "diff-tiny", "seq": 64, "note": "a memory option"}
    chunked.update(on=[*base, "--cross-entropy-chunk-size", "16"], off=base, error="skipped: time budget")
    chunked.update(off_tokens_per_s=100.0, on_tokens_per_s=None, gain=None)
    resumed = {**fused, "lever": "fused norm", "off_from": "campaign-cpu-0.json", "on_from": None}
    r["levers"] = [fused, chunked, resumed]
    assert report.schema.validate(r) == []
    text = "\n".join(report.levers_table("campaign-cpu-1.json", r))
    assert (
        "| fused optimizer | diff-tiny | 64 | 100 | 125 | 1.250x | – | – | `--optimizer-impl` `fused` |"
        in text
    )
    assert "| `--optimizer-impl` `megatron` |" in text
    assert "| `--cross-entropy-chunk-size` `16` | – | a memory option | skipped: time budget |" in text
    fused_row = next(line for line in text.splitlines() if line.startswith("| fused optimizer |"))
    assert "run from" not in fused_row  # both runs timed by this command
    assert "| off run from `campaign-cpu-0.json` |" in text  # a twin an earlier command timed
    assert report.levers_table("x.json", cpu_smoke_result()) == []  # files before the matrix: no table
    gpu = gpu_result()
    gpu["levers"] = r["levers"]
    assert "| fused optimizer | diff-tiny | 64 | 100 | 125 | 1.250x" in report.render([("g.json", gpu)])


def test_the_interleaved_design_shows_each_twins_windows():
    """A comparison's row holds both twins' timed windows; a ratio names both models; a train row of this
    design gives its windows' count and spread."""
    r = cpu_smoke_result()
    ratio = {"lever": "DIFF V1 / Transformer (fast path) s64", "kind": "ratio", "model": "diff-tiny",
             "off_model": "transformer-tiny", "seq": 64, "on": ["--norm-impl", "torch"],
             "off": ["--norm-impl", "torch"], "off_windows": [100.0, 104.0, 98.0],
             "on_windows": [95.0, 94.0, 96.0], "off_tokens_per_s": 100.0, "on_tokens_per_s": 95.0,
             "gain": 0.95, "note": "", "error": None}  # fmt: skip
    r["levers"] = [ratio]
    r["train"] = [{"model": "diff-tiny", "impl": "fast path", "arch": "diff", "seq": 64, "layers": 2,
                   "tokens_per_s": 95.0, "mfu": None, "error": None, "variant": None,
                   "windows": [95.0, 94.0, 96.0, 100.0]}]  # fmt: skip
    assert report.schema.validate(r) == []
    text = "\n".join(report.levers_table("campaign-cpu-1.json", r))
    assert (
        "| diff-tiny / transformer-tiny | 64 | 100 | 95 | 0.950x | 100, 104, 98 | 95, 94, 96 | – | – |"
        in text
    )
    train = "\n".join(report._train("campaign-cpu-1.json", r))
    assert "| diff-tiny | fast path | 64 | 2 | 95 |" in train and "| 4 (6.3%) |" in train


def test_mfu_in_the_full_square_convention_from_the_row_or_the_flop_model():
    row = {"model": "transformer-3b", "seq": 4096, "layers": 8, "mfu": 0.304}
    derived = report.mfu_full_square(row)
    assert 0.304 < derived < 0.304 * 1.2  # the core is a minor share of a 3B's FLOPs at 4K
    assert report.mfu_full_square({**row, "mfu_full_square": 0.33}) == 0.33  # the row's own wins
    assert report.mfu_full_square({**row, "mfu": None}) is None
    text = report.render([("g.json", gpu_result())])
    assert "full square (Megatron-LM's convention)" in text
