"""benchmarks/train_step.py: --device cpu hides the GPUs before CUDA is first queried."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref

from benchmarks.train_step import baseline_of
from tests.conftest import REPO_ROOT

_PROBE = """
import os, sys, torch
class FirstQuery(Exception):
    pass
def probe():
    print("CUDA_VISIBLE_DEVICES at the first CUDA query:", repr(os.environ.get("CUDA_VISIBLE_DEVICES")))
    raise FirstQuery
torch.cuda.is_available = probe
torch.cuda.device_count = probe
sys.path.insert(0, sys.argv[1])
from benchmarks import train_step
try:
    train_step.main(["--device", "cpu", "--model", "diff-tiny"])
except FirstQuery:
    pass
"""


def test_cpu_device_is_set_before_cuda_is_queried():
    """torch caches the device count at the first query: CUDA_VISIBLE_DEVICES set later is ignored."""
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, str(REPO_ROOT)], capture_output=True, text=True, timeout=300
    )
    assert "CUDA_VISIBLE_DEVICES at the first CUDA query: ''" in proc.stdout, (
        proc.stdout + proc.stderr[-2000:]
    )


def test_baselines_of_diff_presets():
    assert baseline_of("diff-3b") == "transformer-3b"
    assert baseline_of("diff2-1.4b") == "transformer-1.4b"
    assert baseline_of("transformer-3b") is None


def test_a_row_is_charged_only_with_its_own_memory(monkeypatch):
    """What earlier runs of the process still hold is not this run's peak (a GPU row once read 25.5 GiB
    over its plan: the previous run's weights and optimizer); what the run leaves behind is reported."""
    import torch

    from benchmarks import train_step

    gib = 2**30
    state = {"allocated": 10 * gib, "peak": 10 * gib}

    def run(args, opts, device):  # a run that peaks 25 GiB above what it found and leaves 1 GiB
        state["peak"] = state["allocated"] + 25 * gib
        state["allocated"] += gib
        return {"seconds": 0.5, "backend": "sdpa", "profile": None}

    monkeypatch.setattr(train_step, "_time_steps", run)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: state["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: state["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: state.update(peak=state["allocated"]))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    r = train_step.run_one("diff-tiny", 64, train_step.StepOptions(), "cuda")
    assert r["error"] is None and r["backend"] == "sdpa"
    assert (r["mem_gib"], r["resident_gib"], r["left_gib"]) == (25.0, 10.0, 1.0)


def test_the_rows_time_the_trainers_own_step(single_rank_parallel_state, monkeypatch):
    """Issue 32, item 3: what a row times is `Trainer.train_step` on mock data (warm-up, timed and profiled
    steps alike), no step of the benchmark's own, and the run's model is freed after it (the overlapped
    parameter gather's hooks would keep it alive unless `release_training_objects` removes them)."""
    from benchmarks import step_profile, train_step
    from diffmeg.training import builders
    from diffmeg.training.trainer import Trainer

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "")  # the Trainer sets the launcher variables; restored at teardown
        monkeypatch.delenv(key)
    steps, released = [], []
    trainer_step, release = Trainer.train_step, builders.release_training_objects

    def counted(self):
        out = trainer_step(self)
        steps.append(out.iteration)
        return out

    def recorded(config, model) -> None:
        released.extend(weakref.ref(chunk) for chunk in model)
        release(config, model)

    monkeypatch.setattr(Trainer, "train_step", counted)
    monkeypatch.setattr(builders, "release_training_objects", recorded)
    opts = train_step.StepOptions(tokens_per_microbatch=32, microbatches=2, warmup=1, iters=2, vocab_size=256)
    opts.num_layers, opts.profile = 1, True
    opts.extra_args = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
    r = train_step.run_one("diff-tiny", 32, opts, "cpu")
    assert r["error"] is None, r["error"]
    assert steps == [1, 2, 3, 4]  # 1 warm-up, 2 timed, 1 profiled
    gc.collect()
    assert len(released) == 1 and released[0]() is None  # nothing holds the run's model after it
    assert (r["mbs"], r["microbatches"], r["backend"]) == (1, 2, "sdpa")
    assert r["tokens_per_s"] > 0 and r["tflops"] > 0 and r["profile"]["total_ms"] > 0
    assert r["tflops_full_square"] > r["tflops"]  # Megatron-LM's convention counts the full square
    assert r["profile"]["busy"] > 0
    chosen = r["profile"]["sdpa"]  # what SDPA chose per shape on this CPU (whatever it is, recorded)
    assert chosen and {c["backend"] for c in chosen} <= set(step_profile.SDPA_OPS.values())
    assert all(c["q_shape"][-1] == 32 for c in chosen)  # diff-tiny's head dim
