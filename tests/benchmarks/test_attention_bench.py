"""benchmarks/attention.py as a library: one failing candidate never ends a sweep; correctness checks."""

from __future__ import annotations

import torch

from benchmarks import attention as bench
from diffmeg.kernels.reference import diff_attention_reference


class OutOfResources(Exception):
    """Stands in for a compiler's OutOfResources (a kernel needing more shared memory than the GPU has)."""


def _inputs(h=2, g=1, s=24, d=8):
    q = [torch.randn(1, h, s, d) for _ in range(2)]
    k = [torch.randn(1, g, s, d) for _ in range(2)]
    return [*q, *k, torch.randn(1, g, s, 2 * d), torch.tensor(0.5)]


def test_failures_become_row_errors():
    def too_big(*a, **k):
        raise OutOfResources("out of resource: shared memory, Required: 262144, Hardware limit: 232448")

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory")

    t = bench.bench_one(too_big, _inputs(), "cpu", 0, 1, scale=0.3)
    assert t.fwd_s is None and t.error.startswith("OutOfResources: out of resource: shared memory")
    assert bench.bench_one(oom, _inputs(), "cpu", 0, 1, scale=0.3).error == "OOM"
    ok = bench.bench_one(diff_attention_reference, _inputs(), "cpu", 0, 1, scale=0.3)
    assert ok.error is None and ok.fwd_s > 0 and ok.fwd_bwd_s > 0


def test_a_sweep_goes_on_after_a_failing_backend(monkeypatch):
    monkeypatch.setattr(bench, "v2_attention_fn", lambda: None)

    def broken(*a, **k):
        raise RuntimeError("kernel compilation failed\nlong traceback")

    backends = {
        "diff broken": broken,
        bench.SDPA_TWO_CALL: bench.make_backends()[bench.SDPA_TWO_CALL],
    }
    rows = bench.run_rows(
        [32, 48], heads=2, kv_heads=1, head_dim=8, dtype=torch.float32, device="cpu", backends=backends,
        warmup=0, iters=1,
    )  # fmt: skip
    assert [r["impl"] for r in rows] == [bench.BASELINE, "diff broken", bench.SDPA_TWO_CALL] * 2
    assert rows[1]["error"] == "RuntimeError: kernel compilation failed" and rows[1]["tflops"] is None
    assert rows[2]["error"] is None and rows[2]["tflops"] > 0 and rows[2]["vs_baseline"] > 0
    past = bench.run_rows(
        [32], heads=2, kv_heads=1, head_dim=8, dtype=torch.float32, device="cpu", backends=backends,
        deadline=0.0,
    )  # fmt: skip
    assert all(r["error"] == "skipped: time budget" for r in past)


def test_correctness_check_against_float64():
    good = bench.check_backend(bench.make_backends()[bench.SDPA_SPLIT_V], "cpu", torch.float32, 16)
    assert good["correct"] and good["max_rel_err"] < 1e-5 and good["error"] is None and good["failed"] == []
    assert list(good["rel_errs"]) == list(bench.CHECKED_TENSORS) == list(good["torch_rel_errs"])

    def off_by_a_little(q1, q2, k1, k2, v, lam, **kw):
        return diff_attention_reference(q1, q2, k1, k2, v, lam * 1.01, **kw)

    bad = bench.check_backend(off_by_a_little, "cpu", torch.float32, 16)
    assert not bad["correct"] and bad["max_rel_err"] > 1e-3
    assert "out" in bad["failed"] and "dv" in bad["failed"]  # lambda scales o2's share: output and dV move
    assert bad["rel_errs"]["out"] > 2 * bad["torch_rel_errs"]["out"] + 1e-3


def _lambda_grad_off_by(delta: float):
    """The float reference with `delta` added to lambda's gradient and nothing else changed."""

    def fn(q1, q2, k1, k2, v, lam, **kw):
        shifted = lam * 1.0
        shifted.register_hook(lambda grad: grad + delta)
        return diff_attention_reference(q1, q2, k1, k2, v, shifted, **kw)

    return fn


def test_the_lambda_gradient_is_judged_against_its_terms_not_its_cancelled_sum():
    """An error of 1% of sum(|dO| |A2 V|) fails (only dlambda); one of 0.01% of it passes although it is a
    far larger share of the cancelled sum dlambda (what the old rule compared with)."""
    from diffmeg.kernels.reference import lambda_grad_scale

    gen = torch.Generator().manual_seed(0)  # check_backend's own draw at head dim 16, seq 333, 4/2 heads
    shapes = [(1, 4, 333, 16), (1, 4, 333, 16), (1, 2, 333, 16), (1, 2, 333, 16), (1, 2, 333, 32)]
    ts = [torch.randn(s, generator=gen, dtype=torch.float64).float() for s in shapes]
    dout = torch.randn((1, 4, 333, 32), generator=gen, dtype=torch.float64).float()
    scale = lambda_grad_scale(ts[1], ts[3], ts[4], dout, scale=16**-0.5)  # q2, k2, v
    q1, q2, k1, k2, v = (t.double() for t in ts)
    zero, one = torch.tensor(0.0, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64)
    a2v = diff_attention_reference(q1, q2, k1, k2, v, zero, scale=0.25) - diff_attention_reference(
        q1, q2, k1, k2, v, one, scale=0.25
    )
    dlam = -(dout.double() * a2v).sum().item()
    assert abs(dlam) < 0.1 * scale  # the sum cancels
    bad = bench.check_backend(_lambda_grad_off_by(0.01 * scale), "cpu", torch.float32, 16)
    assert bad["failed"] == ["dlambda"] and not bad["correct"]
    small = 1e-4 * scale
    assert small / abs(dlam) > 1e-3  # over the old bound, relative to dlambda itself
    good = bench.check_backend(_lambda_grad_off_by(small), "cpu", torch.float32, 16)
    assert good["correct"] and good["failed"] == []


def test_diff_v2_rows_appear_once_v2_exists(monkeypatch):
    """The place left for DIFF V2: a row per length, at twice the baseline's core FLOPs."""
    calls = []

    def fake_v2(q, k, v, gate, *, scale):
        calls.append((q.shape, k.shape, gate.shape))
        return (q[:, ::2] - gate.unsqueeze(-1) * q[:, 1::2]).clone()

    monkeypatch.setattr(bench, "v2_attention_fn", lambda: fake_v2)
    rows = bench.run_rows(
        [32],
        heads=2,
        kv_heads=1,
        head_dim=8,
        dtype=torch.float32,
        device="cpu",
        backends={},
        warmup=0,
        iters=1,
    )
    assert [r["impl"] for r in rows] == [bench.BASELINE, "diff2"] and rows[1]["error"] is None
    assert calls[0] == ((1, 8, 32, 8), (1, 2, 32, 8), (1, 4, 32))  # 2H = 8 query heads over the baseline's KV


def test_a_timing_pair_brackets_back_to_back_calls():
    """Issue 30, item 9: a 0.3 ms call timed alone includes its dispatch; on a GPU a pair holds >= 20."""
    calls = []
    seconds = bench.time_it(lambda: calls.append(1), "cpu", warmup=2, iters=3, calls=5)
    assert len(calls) == 2 + 3 * 5 and seconds >= 0
    calls.clear()
    bench.time_it(lambda: calls.append(1), "cpu", warmup=0, iters=3)
    assert len(calls) == 3  # a CPU call runs synchronously: one per pair unless asked
    assert bench.BACK_TO_BACK_CALLS >= 20


def test_rows_record_the_sdpa_backend_chosen_per_shape(monkeypatch):
    from benchmarks.step_profile import SDPA_OPS

    monkeypatch.setattr(bench, "v2_attention_fn", lambda: None)
    rows = bench.run_rows(
        [32], heads=2, kv_heads=1, head_dim=8, dtype=torch.float32, device="cpu", warmup=0, iters=1,
        backends={bench.SDPA_TWO_CALL: bench.make_backends()[bench.SDPA_TWO_CALL]},
    )  # fmt: skip
    assert [r["impl"] for r in rows] == [bench.BASELINE, bench.SDPA_TWO_CALL]
    for row in rows:
        assert row["sdpa"], row  # both attend through SDPA: what it chose is on the row
        assert {c["backend"] for c in row["sdpa"]} <= set(SDPA_OPS.values())
        assert all(c["q_shape"][2] == 32 for c in row["sdpa"])
    assert len(rows[1]["sdpa"]) >= 1 and sum(c["calls"] for c in rows[1]["sdpa"]) == 2  # two calls
