"""`--phase train --continue FILE` resumes the train phase: only the runs FILE lacks or holds with an error
are timed, FILE's rows are kept (named by the file that measured them), and a lever's gain is derived when
its twins were timed in two commands (benchmarks/campaign/resume.py, merge.py, train.py, runner.py)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pytest

from benchmarks.campaign import merge, resume, runner, schema, train
from benchmarks.campaign.part import Part
from benchmarks.campaign.plan import SMOKE_PLAN

RUN_S = 23.0  # each fake run moves the phase's clock on by this much (the last GPU run's rate)


def _fake_train_step(monkeypatch, fail=lambda preset, flags: False):
    """train_step.run_one answered at once, the phase's clock moved on RUN_S a run; the calls, in order."""
    from benchmarks import train_step

    calls: list[tuple[str, int, tuple[str, ...], int]] = []
    real = time.monotonic

    def run_one(preset, seq, opts, device):
        flags = tuple(opts.extra_args)
        calls.append((preset, seq, flags, opts.num_layers))
        error = "RuntimeError: boom" if fail(preset, flags) else None
        tps = None if error else 100.0 + len(flags)  # a lever's on run: more flags, more tokens/s
        return {"preset": preset, "seq": seq, "layers": opts.num_layers, "mbs": 1,
                "microbatches": opts.microbatches, "backend": "sdpa", "tokens_per_s": tps,
                "tflops_full_square": 1.1, "flops_per_token": 1.0, "mem_gib": None, "estimated_gib": 0.0,
                "resident_gib": None, "left_gib": None, "profile": None, "step_s": None if error else 0.64,
                "tflops": 1.0,
                "optimizer_s": None, "error": error}  # fmt: skip

    monkeypatch.setattr(train_step, "run_one", run_one)
    monkeypatch.setattr(train_step, "init_process", lambda: None)
    monkeypatch.setattr(train_step, "close_process", lambda: None)
    monkeypatch.setattr(train, "time", argparse.Namespace(monotonic=lambda: real() + RUN_S * len(calls)))
    return calls


def _timer(tmp_path, layers=2, compiled=False, name="p.json"):
    a = argparse.Namespace(peak=None, roof=None)
    deadline = time.monotonic() + 1e6
    return train._Timer(a, Part(tmp_path / name), deadline, SMOKE_PLAN, "cpu", layers, compiled)


def _matrix(timer):
    train.run_matrix(timer, SMOKE_PLAN, train.train_runs(SMOKE_PLAN), full_depth_fits=None)


def test_a_row_is_reused_only_for_the_same_run(monkeypatch, tmp_path):
    """Another layer count, TorchDynamo setting or flag set is another measurement; an error is measured
    again; a run asked to be profiled is not answered by a row measured without the profile."""
    calls = _fake_train_step(monkeypatch)
    first = _timer(tmp_path)
    _matrix(first)
    rows = first.part.data["train"]
    everything = list(calls)
    assert len(everything) == len(train.planned_runs(SMOKE_PLAN)) == len(rows)
    assert all(r["flags"] is not None and resume.run_key(r) for r in rows)

    def resumed(earlier_rows, **kw):
        calls.clear()
        timer = _timer(tmp_path, name="q.json", **kw)
        timer.reuse(earlier_rows, "campaign-earlier.json")
        _matrix(timer)
        return list(calls), timer

    again, timer = resumed(rows)
    assert again == [] and timer.part.data.get("train") is None  # all held: nothing timed, no row
    assert timer.part.data["_reused"] == len(rows)
    names = [lever.name for lever in SMOKE_PLAN.train_levers]
    assert [row["lever"] for row in timer.part.data["levers"]] == names
    assert {row["off_from"] for row in timer.part.data["levers"]} == {"campaign-earlier.json"}
    assert resumed(rows, layers=4)[0] == [(p, s, f, 4) for p, s, f, _ in everything]  # other layers: all
    assert len(resumed(rows, compiled=True)[0]) == len(everything)  # TorchDynamo on: all again
    broken = [{**r, "error": "OOM", "tokens_per_s": None} if r["impl"] == "reference" else r for r in rows]
    assert resumed(broken)[0] == [("diff-tiny", 64, ("--diff-attn-backend", "reference"), 2)]
    unprofiled = [{**r, "profiled": False} if r["impl"] == "baseline" else r for r in rows]
    assert resumed(unprofiled)[0] == [("transformer-tiny", 64, (), 2)]
    other_flags = [{**r, "flags": [*r["flags"], "--norm-impl", "torch"]} if r["impl"] == "sdpa" else r
                   for r in rows]  # fmt: skip
    sdpa = ("--diff-attn-backend", "sdpa")
    assert resumed(other_flags)[0] == [("diff-tiny", 64, sdpa, 2)]  # once: the levers' twin reuses it
    legacy = [{k: v for k, v in r.items() if k != "flags"} for r in rows]  # a file from before `flags`
    assert len(resumed(legacy)[0]) == len(everything)


def test_merged_rows_keep_the_earlier_file_and_replace_what_was_measured_again():
    def row(impl, variant=None, layers=2, tokens_per_s=None, error="skipped: time budget", **kw):
        return {"model": "m", "impl": impl, "seq": 64, "variant": variant, "flags": [], "layers": layers,
                "microbatches": 1, "tokens_per_s": tokens_per_s, "error": error, **kw}  # fmt: skip

    earlier = [
        row("a", layers=8, tokens_per_s=1.0, error=None),
        row("lever", "x: on"),
        row("lever", "y: off"),  # the same run under a second lever's label: skipped twice
        row("c", layers=4, error="OOM", **{"from": "campaign-first.json"}),
        {
            "model": "m",
            "impl": "fit",
            "seq": 64,
            "variant": "fit over 4 and 8 layers",
            "layers": 28,
            "tokens_per_s": 3.0,
            "error": None,
        },  # fmt: skip
    ]
    current = [row("lever", "x: on", tokens_per_s=2.0, error=None), {**earlier[-1], "tokens_per_s": 3.5}]
    out = resume.combined("train", earlier, current, "campaign-second.json")
    assert [(r["impl"], r["tokens_per_s"], r["error"], r.get("from")) for r in out] == [
        ("a", 1.0, None, "campaign-second.json"),  # kept, named by the file that measured it
        ("c", None, "OOM", "campaign-first.json"),  # not measured again here: kept as it was, and where
        ("lever", 2.0, None, None),  # this command's, for both labels of its run
        ("fit", 3.5, None, None),  # a fit derived again (no flags: known by its labels)
    ]
    levers = [{"lever": "x", "model": "m", "seq": 64, "gain": None}, {"lever": "z", "model": "m", "seq": 64}]
    out = resume.combined("levers", levers, [{**levers[0], "gain": 2.0}], "campaign-second.json")
    assert [(r["lever"], r.get("gain"), r.get("from")) for r in out] == [
        ("z", None, "campaign-second.json"),
        ("x", 2.0, None),
    ]
    assert set(merge.PHASE_KEYS["train"]) <= set(resume.IDENTITY)  # every table of a resumable phase
    assert set(merge.RESUMABLE_PHASES) == {"train"}


def _command(tmp_path, monkeypatch, name, argv):
    """One campaign command, its phases in this process: the env phase's results given, the train phase's
    child run in-process with its command line (what `run_child` passes, `--continue` included)."""
    seen: list[list[str]] = []

    def run_phase_process(cmd, budget, env, log, part_file):
        seen.append(cmd)
        a = runner.parse_args(cmd[3:])
        if a.child == "env":
            Part(part_file).set(device="cpu (test)", device_type="cpu")
        else:
            runner.child_main(a)
        return json.loads(part_file.read_text()), 1.0

    monkeypatch.setattr(runner, "run_phase_process", run_phase_process)
    out = tmp_path / name
    rc = runner.main(["--smoke", "--device", "cpu", "--phase", "train", "--out", str(out), *argv])
    (path,) = out.glob("campaign-*.json")
    return rc, schema.read(path), path, seen


def test_a_continued_train_phase_times_only_the_missing_and_failed_runs(monkeypatch, tmp_path):
    """Command 1 is cut by its budget (and one run fails); command 2 continues its file: it times only
    what command 1 skipped or failed, and its file holds every run once, the gains across the two."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(runner, "source_revision", lambda repo, carried: ("ab" * 20, False, "git"))
    chunked = ("--diff-attn-backend", "sdpa", "--cross-entropy-chunk-size", "16")
    calls = _fake_train_step(monkeypatch, fail=lambda preset, flags: flags == chunked)
    rc, first, first_path, _ = _command(tmp_path, monkeypatch, "one", ["--phase-budget", "train=150"])
    assert rc == 1  # a smoke row failed (the chunked loss)
    # 130 s to start runs (150 less the child's 20 s margin), 23 s a run: six timed, the rest skipped
    assert len(calls) == 6 and first["phases"]["train"]["status"] == "partial"
    planned = [(r["model"], r["seq"], tuple(r["flags"]), r["layers"]) for r in train.planned_runs(SMOKE_PLAN)]
    assert calls == planned[:6]
    fused = next(lever for lever in SMOKE_PLAN.train_levers if lever.name == "fused optimizer")
    assert calls[-1] == ("diff-tiny", 64, fused.off, 2)  # its on run: skipped for the budget

    done_before = list(calls)
    calls_second = _fake_train_step(monkeypatch)  # the chunked loss works this time
    argv = ["--phase-budget", "train=600", "--continue", str(first_path)]
    rc, second, _, seen = _command(tmp_path, monkeypatch, "two", argv)
    assert rc == 0
    assert ["--continue", str(first_path)] == seen[-1][-2:]  # the train child got the file
    missing = [run for run in planned if run not in done_before or run[2] == chunked]
    assert calls_second == missing  # the skipped runs and the failed one, nothing measured before
    assert second["phases"]["train"] == {**second["phases"]["train"], "status": "ok", "reused": 5}
    assert second["continues"] == [first_path.name]
    rows = second["train"]
    keys = [resume.run_key(r) for r in rows]
    assert len(keys) == len(set(keys))  # each run once: the skipped rows replaced by their measurement
    assert len(rows) == len(planned) and not any(r["error"] for r in rows)
    assert sum(r.get("from") == first_path.name for r in rows) == 5  # command 1's five good rows
    levers = {row["lever"]: row for row in second["levers"]}
    assert list(levers) == [lever.name for lever in SMOKE_PLAN.train_levers]  # one row each, derived again
    assert all(row["gain"] and not row["error"] for row in levers.values())
    across = levers["fused optimizer"]
    assert (across["off_from"], across["on_from"]) == (first_path.name, None)
    assert across["gain"] == pytest.approx((100.0 + len(fused.on)) / (100.0 + len(fused.off)))
    assert Path(first_path).is_file()


def test_the_full_depth_fit_is_derived_from_cuts_of_the_continued_file(monkeypatch, tmp_path):
    """Cuts timed by the earlier command still give the straight-line fit; nothing is timed again, and no
    row of this command takes another run's amortized figures."""
    from benchmarks.campaign.plan import GPU_PLAN

    calls = _fake_train_step(monkeypatch)
    monkeypatch.setattr(train, "_fits", lambda plan, preset, full, layers, device: False)
    full = GPU_PLAN.train_full_depth
    a = argparse.Namespace(peak=None, roof=None)
    later = time.monotonic() + 1e6
    first = train._Timer(a, Part(tmp_path / "p.json"), later, GPU_PLAN, "cuda", 8, True)
    train.full_depth(first, full)
    assert len(calls) == 2 * len(full.fallback_layers)
    earlier = first.part.data["train"]
    fits = [r for r in earlier if r["impl"] == "fit"]
    assert len(fits) == 2 and all(r["step_s"] for r in earlier if r["impl"] != "fit")
    calls.clear()
    again = train._Timer(a, Part(tmp_path / "q.json"), later, GPU_PLAN, "cuda", 8, True)
    again.reuse(earlier, "campaign-earlier.json")
    train.full_depth(again, full)
    assert calls == [] and again.part.data["train"] == fits  # only the fits, derived again, the same
