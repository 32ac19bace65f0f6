"""benchmarks/campaign/schema.py: what a campaign results file must hold."""

from __future__ import annotations

from benchmarks.campaign import schema


def test_an_empty_result_follows_the_schema():
    result = schema.empty_result()
    result.update(device="cpu", device_type="cpu", date="2026-01-01T00:00:00+00:00", git_revision="abc")
    assert schema.validate(result) == []
    assert set(result["phases"]) == set(schema.PHASES)
    assert result["attention"] == [] and result["bf16_matmul_tflops"] is None


def test_problems_are_named():
    result = schema.empty_result()
    result.update(device="x", device_type="gpu", date="d", git_revision="r")
    del result["flop_bound_4k"]
    result["bf16_matmul_tflops"] = True  # a bool is not a number
    result["attention"] = [{"impl": "diff sdpa split-v", "seq": 4096}]
    result["phases"]["kernels"] = {"status": "fine"}
    problems = "\n".join(schema.validate(result))
    assert "device_type must be 'cuda' or 'cpu'" in problems
    assert "missing top-level key 'flop_bound_4k'" in problems
    assert "'bf16_matmul_tflops' has type bool" in problems
    assert "attention[0] lacks 'fwd_ms'" in problems
    assert "phase 'kernels' needs a status" in problems
    assert schema.validate([]) == ["the results file must hold a JSON object"]


def test_keys_added_later_may_be_absent_but_are_typed():
    """Files written before git_source, peak_bf16_tflops and wheels existed still validate; the retired
    Triton kernel's keys are typed where an older file holds them, and no new file has them."""
    result = schema.empty_result()
    result.update(device="cpu", device_type="cpu", date="d", git_revision="r")
    for key in schema.OPTIONAL_TOP_LEVEL:
        assert key in result
        del result[key]
    assert schema.validate(result) == []
    result["peak_bf16_tflops"] = "989"
    assert schema.validate(result) == ["'peak_bf16_tflops' has type str"]
    assert not set(schema.RETIRED_TOP_LEVEL) & set(schema.empty_result())
    del result["peak_bf16_tflops"]
    result.update(triton_candidates=[], triton_best=None, fused_speedup_vs_best_unfused_4k=1.2)
    assert schema.validate(result) == []
    result["triton_best"] = "tiles"
    assert schema.validate(result) == ["'triton_best' has type str"]
