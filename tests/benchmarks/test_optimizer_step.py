"""benchmarks/optimizer_step.py: both optimizer steps of a tiny model timed alone, each row the impl asked."""

from __future__ import annotations


def test_both_steps_are_timed_on_their_own(single_rank_parallel_state, monkeypatch):
    from benchmarks import optimizer_step, train_step
    from diffmeg.fusions import optimizer_step as fused_step

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "")  # the Trainer sets the launcher variables; restored at teardown
        monkeypatch.delenv(key)
    applied = []
    monkeypatch.setattr(
        fused_step,
        "apply_fused_step",
        lambda opt, _f=fused_step.apply_fused_step: (applied.append(opt), _f(opt))[1],
    )  # the registry's loader reads the function from the module when the fused step is chosen
    opts = train_step.StepOptions(tokens_per_microbatch=32, microbatches=1, warmup=1, iters=2, vocab_size=256)
    opts.num_layers = 1
    rows = [optimizer_step.run_one("diff-tiny", impl, 32, opts, "cpu") for impl in optimizer_step.IMPLS]
    assert [r["error"] for r in rows] == [None, None], rows
    assert [r["impl"] for r in rows] == ["megatron", "fused"] and len(applied) == 1  # fused: once, its row
    assert all(r["step_ms"] > 0 and r["params"] > 0 and r["layers"] == 1 for r in rows)
    assert opts.extra_args == []  # the caller's options are not changed
