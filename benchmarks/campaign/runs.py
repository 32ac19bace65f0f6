"""The memory phase's pretrain_diff.py runs: straight, saved at the half and exited, resumed.

The runs use --deterministic-mode (Plan.run_args): the comparison is bit for bit, so cuBLAS's workspace,
the embedding's backward and every reduction must be deterministic. Each run's output goes to files (a
checkpoint-writer helper that outlives its run cannot hold a pipe open), and each run ends with every
process it started (procs.end).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.campaign.plan import Plan
from benchmarks.campaign.procs import REPO, end

_NONDETERMINISTIC = re.compile(r"(\S+) does not have a deterministic implementation")


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


def run_data(plan: Plan, env: dict[str, str]) -> tuple[list[str], str]:
    """(pretrain_diff.py data flags, what the row records): the embedded corpus where the plan asks for it
    and the runs' environment finds cl100k_base (DIFFMEG_TOKENIZER_FILE or tiktoken's cache), else mock
    ids, saying why."""
    if plan.run_data != "builtin":
        return ["--mock-data"], "mock"
    from diffmeg.data.tiktoken_cl100k import TOKENIZER_FILE_ENV, load_tokenizer
    from diffmeg.errors import DiffmegError

    try:
        load_tokenizer(env.get(TOKENIZER_FILE_ENV))
    except DiffmegError as exc:
        return ["--mock-data"], f"mock (no tokenizer for the builtin corpus: {exc})"
    return ["--data-path", "builtin"], "builtin"


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

    resume_exact: the runs agree before the save and the first resumed iteration's loss equals the
    uninterrupted run's bit for bit (its forward uses the restored weights and data position);
    resume_all_equal: every resumed iteration does (deterministic mode: the optimizer state and RNG
    restored exactly too). resume_max_abs_diff is the largest difference after the resume;
    nondeterministic_ops names the ops torch warned have no deterministic kernel."""
    n, half = plan.run_iterations, plan.run_iterations // 2
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / "ckpt"
    data_args, data = run_data(plan, env)
    base = [sys.executable, str(REPO / "pretrain_diff.py"), "--model", model, *plan.run_args, *data_args]
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
        "resume_all_equal": None,
        "resume_max_abs_diff": None,
        "data": data,
        "deterministic": "--deterministic-mode" in plan.run_args,
        "nondeterministic_ops": [],
        "generation_ok": None,
        "error": None,
    }
    for name, cmd in runs.items():
        left = deadline - time.monotonic()
        if left < 5:
            row["error"] = f"skipped: time budget (before the {name} run)"
            return row
        start = time.monotonic()
        log = work / f"{name}.log"
        with log.open("w") as out:
            proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # fmt: skip
            try:
                proc.wait(timeout=left)
            except subprocess.TimeoutExpired:
                row["error"] = f"skipped: time budget (the {name} run did not finish)"
            finally:
                end(proc)  # the run and its checkpoint writer's helpers, finished or not
        text = log.read_text(errors="replace")
        row["nondeterministic_ops"] = sorted(
            set(row["nondeterministic_ops"]) | set(_NONDETERMINISTIC.findall(text))
        )
        if row["error"]:
            return row
        print(f"  {model} {name}: exit {proc.returncode} in {time.monotonic() - start:.0f}s", flush=True)
        if proc.returncode != 0:
            tail = text.strip().splitlines()[-1:] or [""]
            row["error"] = f"{name} run failed: {tail[0][:300]}"
            print(text[-4000:], flush=True)
            return row
    full, first, resumed = (_losses(work / f"{k}.jsonl") for k in ("full", "first", "resume"))
    if len(full) < n or half + 1 not in resumed:
        row["error"] = f"missing losses (full: {len(full)}, resumed: {sorted(resumed)[:3]}...)"
        return row
    row["loss_first"], row["loss_last"] = full[1], full[n]
    row["loss_falls"] = full[n] < full[1] and all(math.isfinite(v) for v in full.values())
    row["resume_exact"] = resumed[half + 1] == full[half + 1] and all(first[i] == full[i] for i in first)
    row["resume_all_equal"] = all(resumed[i] == full[i] for i in resumed)
    row["resume_max_abs_diff"] = max(abs(resumed[i] - full[i]) for i in resumed)
    return row
