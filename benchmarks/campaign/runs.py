"""The memory phase's pretrain_diff.py runs: straight, saved at the half, resumed; then generation."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
import traceback
from pathlib import Path

from benchmarks.campaign.plan import Plan
from benchmarks.campaign.procs import REPO, kill_group


def skipped_run(model: str, iterations: int) -> dict:
    return {
        "model": model,
        "iterations": iterations,
        "loss_first": None,
        "loss_last": None,
        "resume_exact": None,
        "generation_ok": None,
        "error": "skipped: time budget",
    }


def _losses(path: Path) -> dict[int, float]:
    out = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if "lm_loss" in rec:
                out[rec["iteration"]] = rec["lm_loss"]
    return out


def train_and_resume(model: str, plan: Plan, work: Path, deadline: float, env: dict) -> dict:
    """pretrain_diff.py three times: N iterations straight; N/2 then exit (saving); resume to N (no save).

    resume_exact: the first resumed iteration's loss equals the uninterrupted run's bit for bit (its
    forward uses the restored weights and data position; later steps may differ by non-deterministic
    GPU reductions, reported as resume_max_abs_diff)."""
    n, half = plan.run_iterations, plan.run_iterations // 2
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / "ckpt"
    base = [sys.executable, str(REPO / "pretrain_diff.py"), "--model", model, *plan.run_args]
    base += ["--train-iters", str(n), "--log-interval", "1", "--eval-iters", "0"]
    runs = {
        "full": base + ["--metrics-file", str(work / "full.jsonl")],
        "first": base
        + ["--save", str(ckpt), "--exit-interval", str(half), "--metrics-file", str(work / "first.jsonl")],
        "resume": base + ["--load", str(ckpt), "--metrics-file", str(work / "resume.jsonl")],
    }
    row = {
        "model": model,
        "iterations": n,
        "loss_first": None,
        "loss_last": None,
        "loss_falls": None,
        "resume_exact": None,
        "resume_max_abs_diff": None,
        "generation_ok": None,
        "error": None,
    }
    for name, cmd in runs.items():
        left = deadline - time.monotonic()
        if left < 5:
            row["error"] = f"skipped: time budget (before the {name} run)"
            return row
        start = time.monotonic()
        proc = subprocess.Popen(
            cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,  # the checkpoint writer's spawned processes end with it
        )  # fmt: skip
        try:
            stdout, stderr = proc.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            proc.communicate()
            row["error"] = f"skipped: time budget (the {name} run did not finish)"
            return row
        proc.stdout, proc.stderr = stdout, stderr
        print(f"  {model} {name}: exit {proc.returncode} in {time.monotonic() - start:.0f}s", flush=True)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
            row["error"] = f"{name} run failed: {tail[0][:300]}"
            print(proc.stderr[-4000:], flush=True)
            return row
    full, first, resumed = (_losses(work / f"{k}.jsonl") for k in ("full", "first", "resume"))
    if len(full) < n or half + 1 not in resumed:
        row["error"] = f"missing losses (full: {len(full)}, resumed: {sorted(resumed)[:3]}...)"
        return row
    row["loss_first"], row["loss_last"] = full[1], full[n]
    row["loss_falls"] = full[n] < full[1] and all(math.isfinite(v) for v in full.values())
    row["resume_exact"] = resumed[half + 1] == full[half + 1] and all(first[i] == full[i] for i in first)
    row["resume_max_abs_diff"] = max(abs(resumed[i] - full[i]) for i in resumed)
    return row


def generation_check(ckpt: Path, device: str, tokens: int) -> dict:
    """Greedy decoding with the KV cache equals recomputation; seeded sampling repeats; ids in the vocab."""
    import torch

    from diffmeg.generation import SamplingConfig, generate, load_model

    try:
        model, _ = load_model(str(ckpt), dtype=torch.bfloat16 if device == "cuda" else torch.float32)
        prompt = [1, 2, 3, 4, 5]
        cached = generate(model, prompt, tokens, use_cache=True)
        full = generate(model, prompt, tokens, use_cache=False)
        s1 = generate(model, prompt, tokens, SamplingConfig(temperature=1.0, top_p=0.9, seed=3))
        s2 = generate(model, prompt, tokens, SamplingConfig(temperature=1.0, top_p=0.9, seed=3))
        vocab = model.vocab_size
        ids = cached.output_ids + s1.output_ids
        checks = {
            "cache_equals_recompute": cached.output_ids == full.output_ids,
            "seeded_sampling_repeats": s1.output_ids == s2.output_ids,
            "ids_in_vocab": all(0 <= i < vocab for i in ids),
            "lengths": len(cached.output_ids) == tokens and len(s1.output_ids) == tokens,
            "device": str(next(model.parameters()).device),
        }
        ok = all(v for k, v in checks.items() if k != "device")
        del model
        return {"ok": ok, **checks, "error": None}
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
