"""benchmarks/campaign/kernels.py: rows written a length at a time, so a fault that kills the phase keeps
the lengths before it; each head dim's rows judged by that head dim's check, none started past the
deadline."""

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

PLAN = dataclasses.replace(SMOKE_PLAN, attn_seqs=(64, 48), check_seq=32, attn_extra=((2, 1, 16, (64,)),))


class CompilerAbort(BaseException):
    """Stands for a fault that ends the phase's process (no Python handler survives it)."""


def _phase(tmp_path, monkeypatch, abort_at_seq=None, deadline_s=300.0):
    def split_v(q1, *args, **kw):
        if q1.shape[2] == abort_at_seq:
            raise CompilerAbort(abort_at_seq)
        return diff_attention_sdpa(q1, *args, split_v=True, **kw)

    monkeypatch.setattr(bench, "make_backends", lambda: {bench.SDPA_SPLIT_V: split_v})
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


def test_a_fault_that_kills_the_phase_leaves_every_length_before_it(tmp_path, monkeypatch):
    data, _ = _phase(tmp_path, monkeypatch, abort_at_seq=48)
    rows = [(r["impl"], r["seq"]) for r in data["attention"]]
    assert rows[0] == (bench.BASELINE, 64) and (bench.SDPA_SPLIT_V, 64) in rows
    assert all(seq == 64 for _, seq in rows)
    row = next(r for r in data["attention"] if r["impl"] == bench.SDPA_SPLIT_V)
    assert row["fwd_bwd_ms"] and row["error"] is None and row["vs_baseline"] is not None
    assert row["correct"] is False  # its check (d=32) ran and judged it


def test_each_head_dim_has_its_own_check_and_none_past_the_deadline(tmp_path, monkeypatch):
    data, calls = _phase(tmp_path, monkeypatch)
    by_dim = {(r["impl"], r["head_dim"]): r["correct"] for r in data["attention"]}
    assert by_dim[bench.SDPA_SPLIT_V, 32] is False and by_dim[bench.SDPA_SPLIT_V, 16] is True
    assert by_dim[bench.BASELINE, 16] is None
    assert sorted(calls) == [16, 32]  # split-v at both dims, once each

    (tmp_path / "late").mkdir()
    data, calls = _phase(tmp_path / "late", monkeypatch, deadline_s=-1.0)
    assert calls == [] and data["_status"] == "partial"
    assert {r["error"] for r in data["attention"]} == {"skipped: time budget"}


@pytest.fixture(autouse=True)
def _seeded():
    import torch

    torch.manual_seed(0)
