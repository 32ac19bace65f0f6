"""`--lent-gpu --continue FILE` resumes the train phase: only the comparisons FILE lacks or holds with an
error are timed, FILE's rows are kept (named by the file that measured them) and a variant measured again
replaces its row (benchmarks/campaign/resume.py, merge.py, train.py, runner.py), with fake workers."""

from __future__ import annotations

import json

from benchmarks.campaign import merge, resume, runner, schema, train
from benchmarks.campaign.part import Part
from tests.benchmarks.campaign.fakes import FakeWorkers


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


def _command(tmp_path, monkeypatch, name, argv, workers):
    """One smoke campaign command, its phases in this process: the env phase's results given, the train
    phase's child run in-process with its command line (what `run_child` passes, `--continue` included),
    its workers `workers`' fakes."""
    seen: list[list[str]] = []

    def run_phase_process(cmd, budget, env, log, part_file, on_update=None):
        seen.append(cmd)
        a = runner.parse_args(cmd[3:])
        if a.child == "env":
            Part(part_file).set(device="cpu (test)", device_type="cpu")
        else:
            runner.child_main(a)
        return json.loads(part_file.read_text()), 1.0

    monkeypatch.setattr(runner, "run_phase_process", run_phase_process)
    monkeypatch.setattr(train, "Worker", lambda env: workers.spawn())
    out = tmp_path / name
    rc = runner.main(["--smoke", "--device", "cpu", "--phase", "train", "--out", str(out), *argv])
    (path,) = out.glob("campaign-*.json")
    return rc, schema.read(path), path, seen


def test_a_continued_train_phase_times_only_what_failed_or_is_missing(monkeypatch, tmp_path):
    """Command 1 cannot build DIFF V1's fast path (its two comparisons fail); command 2 continues its file:
    it times only those two, and its file holds every comparison once, each variant's row once."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(runner, "source_revision", lambda repo, carried: ("ab" * 20, False, "git"))
    fast_diff = lambda spec: spec["preset"] == "diff-tiny" and spec["flags"]  # noqa: E731
    first = FakeWorkers(fail=lambda spec, op, n: "OOM" if op == "build" and fast_diff(spec) else None)
    rc, one, one_path, _ = _command(tmp_path, monkeypatch, "one", [], first)
    assert rc == 1  # a smoke row failed
    assert [row["error"] for row in one["levers"]] == [None, "on twin failed: OOM", "on twin failed: OOM"]
    assert all(len(row["off_windows"]) >= 2 for row in one["levers"][:1])

    second = FakeWorkers()
    rc, two, _, seen = _command(tmp_path, monkeypatch, "two", ["--continue", str(one_path)], second)
    assert rc == 0
    assert ["--continue", str(one_path)] == seen[-1][-2:]  # the train child got the file
    ratio = one["levers"][1]
    assert second.built == [
        ("transformer-tiny", tuple(ratio["off"])),
        ("diff-tiny", tuple(ratio["on"])),
        ("diff-tiny", ()),
    ]
    assert two["phases"]["train"]["reused"] == 1 and two["continues"] == [one_path.name]
    levers = {row["lever"]: row for row in two["levers"]}
    assert len(levers) == len(two["levers"]) == 3 and all(row["gain"] for row in levers.values())
    assert levers["fast path vs defaults (transformer) s64"]["from"] == one_path.name
    keys = [resume.run_key(r) for r in two["train"]]
    assert len(keys) == len(set(keys)) == 4  # the Transformer's fast path measured again: one row
    assert [r.get("from") for r in two["train"]] == [one_path.name, None, None, None]
    assert not any(r["error"] for r in two["train"])
    assert two["diff_vs_transformer_ratio_4k"] is None  # the smoke runs at 64 tokens: no 4K figure


def test_the_measured_comparisons_of_an_earlier_file():
    rows = [
        {"lever": "a", "gain": 1.1, "error": None, "off_windows": [1.0, 1.0]},
        {"lever": "b", "gain": None, "error": "skipped: time budget", "off_windows": []},
        {"lever": "c", "gain": 1.2, "error": None},  # a file before the windows: measured again
    ]
    assert resume.measured_comparisons(rows) == {"a"}
    assert set(merge.RESUMABLE_PHASES) == {"train"}
