"""benchmarks/campaign/kernels.py: rows in the order that keeps the most when a candidate kills the phase;
each head dim's rows judged by that head dim's check, none started past the deadline."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import pytest

from benchmarks import attention as bench
from benchmarks.campaign import kernels
from benchmarks.campaign.part import Part
from benchmarks.campaign.plan import SMOKE_PLAN
from diffmeg.kernels.sdpa import diff_attention_sdpa
from diffmeg.kernels.triton_diff import TritonDiffConfig

PLAN = dataclasses.replace(SMOKE_PLAN, attn_seqs=(64,), check_seq=32, attn_extra=((2, 1, 16, (64,)),))


class CompilerAbort(BaseException):
    """Stands for a fault that ends the phase's process (no Python handler survives it)."""


def _sdpa(*args, **kw):
    return diff_attention_sdpa(*args, split_v=True, **kw)


def _candidates(abort_at: str | None) -> dict:
    def fn(label):
        def run(*args, **kw):
            if label == abort_at:
                raise CompilerAbort(label)
            return _sdpa(*args, **kw)

        return run

    return {f"{bench.TRITON} {x}": (x, TritonDiffConfig(), fn(x)) for x in ("A", "B", "C")}


def _phase(tmp_path, monkeypatch, abort_at=None, deadline_s=300.0):
    unfused = {bench.SDPA_SPLIT_V: _sdpa}
    monkeypatch.setattr(kernels, "backends_to_time", lambda *a: (unfused, _candidates(abort_at)))
    calls = []
    real_check = bench.check_backend

    def check(fn, device, dtype, head_dim, **kw):
        calls.append(head_dim)
        verdict = real_check(fn, device, dtype, head_dim, **kw)
        return {**verdict, "correct": head_dim == 16}  # tell the head dims' verdicts apart

    monkeypatch.setattr(bench, "check_backend", check)
    part = Part(tmp_path / "kernels.json")
    a = argparse.Namespace(device="cpu")
    try:
        kernels.phase_kernels(a, part, time.monotonic() + deadline_s, PLAN)
    except CompilerAbort:
        pass
    return json.loads((tmp_path / "kernels.json").read_text()), calls


def test_a_candidate_that_kills_the_phase_leaves_every_row_before_it(tmp_path, monkeypatch):
    data, _ = _phase(tmp_path, monkeypatch, abort_at="B")
    impls = [r["impl"] for r in data["attention"]]
    assert impls[0] == bench.BASELINE and bench.SDPA_SPLIT_V in impls
    assert f"{bench.TRITON} A" in impls and f"{bench.TRITON} B" not in impls
    assert [c["label"] for c in data["triton_candidates"]] == ["A"]
    row = next(r for r in data["attention"] if r["impl"] == f"{bench.TRITON} A")
    assert row["fwd_bwd_ms"] and row["error"] is None and row["vs_baseline"] is not None


def test_each_head_dim_has_its_own_check_and_none_past_the_deadline(tmp_path, monkeypatch):
    data, calls = _phase(tmp_path, monkeypatch)
    by_dim = {(r["impl"], r["head_dim"]): r["correct"] for r in data["attention"]}
    assert by_dim[bench.SDPA_SPLIT_V, 32] is False and by_dim[bench.SDPA_SPLIT_V, 16] is True
    assert by_dim[f"{bench.TRITON} C", 32] is False and by_dim[bench.BASELINE, 16] is None
    assert sorted(calls) == [16, 32, 32, 32, 32]  # split-v at both dims, each candidate once

    (tmp_path / "late").mkdir()
    data, calls = _phase(tmp_path / "late", monkeypatch, deadline_s=-1.0)
    assert calls == [] and data["_status"] == "partial"
    assert {r["error"] for r in data["attention"]} == {"skipped: time budget"}


@pytest.fixture(autouse=True)
def _seeded():
    import torch

    torch.manual_seed(0)
