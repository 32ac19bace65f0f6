"""The campaign's runner: one child process per phase under its budget, then the results file and table.

`python3 -m benchmarks.campaign` (benchmarks/campaign/__main__.py) calls `main`; each phase runs as
`python3 -m benchmarks.campaign --child PHASE ...` (`child_main`), so a CUDA fault in one phase cannot take
the others down. The package's docstring (benchmarks/campaign/__init__.py) lists the phases and commands.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from benchmarks.campaign import schema
from benchmarks.campaign.env import phase_env
from benchmarks.campaign.figures import kept_triton_best
from benchmarks.campaign.gpu_tests import phase_tests
from benchmarks.campaign.install import install_wheels
from benchmarks.campaign.kernels import phase_kernels
from benchmarks.campaign.memory import phase_memory
from benchmarks.campaign.part import Part, clean
from benchmarks.campaign.plan import (
    CHILD_MARGIN_S,
    DEFAULT_TOTAL_S,
    GPU_PLAN,
    MIN_PHASE_S,
    PHASES,
    SMOKE_PLAN,
    SMOKE_TOTAL_S,
    phase_budgets,
)
from benchmarks.campaign.procs import REPO, child_env, git, kill_group, lines_until
from benchmarks.campaign.summary import summary_lines
from benchmarks.campaign.train import phase_train

DESCRIPTION = (
    "The GPU validation and benchmark campaign: every figure of docs/benchmarks.md from a few commands."
)

PHASE_FUNCS = {
    "env": phase_env,
    "tests": phase_tests,
    "kernels": phase_kernels,
    "train": phase_train,
    "memory": phase_memory,
}


def child_main(a: argparse.Namespace) -> int:
    part = Part(Path(a.part))
    deadline = time.monotonic() + a.budget_s - min(CHILD_MARGIN_S, 0.15 * a.budget_s)
    plan = SMOKE_PLAN if a.smoke else GPU_PLAN
    try:
        PHASE_FUNCS[a.child](a, part, deadline, plan)
    except Exception as exc:  # noqa: BLE001 - recorded for the parent
        traceback.print_exc()
        part.set(_status="failed", _error=f"{type(exc).__name__}: {exc}"[:500])
    part.save()
    return 0


def run_child(
    phase: str,
    budget: float,
    a: argparse.Namespace,
    roof: float | None,
    tiles: Path | None,
    log: Callable[[str], None],
) -> tuple[dict, float]:
    """Run one phase in a child process; its results (what it kept before any crash) and seconds."""
    part_file = Path(tempfile.mkdtemp(prefix="campaign-part-")) / f"{phase}.json"
    cmd = [sys.executable, "-m", "benchmarks.campaign", "--child", phase, "--part", str(part_file)]
    cmd += ["--budget-s", str(budget)]
    if a.device:
        cmd += ["--device", a.device]
    if a.smoke:
        cmd.append("--smoke")
    if roof:
        cmd += ["--roof", str(roof)]
    if tiles is not None:
        cmd += ["--triton-tiles", str(tiles)]
    start = time.monotonic()
    log(f"=== phase {phase} (budget {budget:.0f}s)")
    env = child_env(a)
    env["TORCHDYNAMO_DISABLE"] = "1"  # as benchmarks/train_step.py: megatron-core's fusions run eagerly
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: a timeout ends the phase's subprocesses too
    )
    status_override = None
    try:
        for line in lines_until(proc, start + budget):
            log(line.rstrip("\n"))
        try:
            proc.wait(timeout=max(1.0, start + budget - time.monotonic()))
        except subprocess.TimeoutExpired:
            status_override = "timeout"
    finally:
        if proc.poll() is None:
            kill_group(proc)
        proc.wait()
    seconds = time.monotonic() - start
    part = json.loads(part_file.read_text()) if part_file.is_file() else {}
    shutil.rmtree(part_file.parent, ignore_errors=True)
    if status_override:
        part["_status"], part["_error"] = "timeout", f"killed after {budget:.0f}s"
    elif proc.returncode != 0 or not part:
        part["_status"] = "failed"
        part["_error"] = part.get("_error") or f"phase process exited with {proc.returncode}"
    return part, seconds


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python3 -m benchmarks.campaign", description=DESCRIPTION)
    p.add_argument(
        "--phase", default=",".join(PHASES), help=f"comma-separated, of {', '.join(PHASES)} (env always runs)"
    )
    p.add_argument("--out", required=False, help="folder for the results JSON and the log")
    p.add_argument(
        "--wheels", default=None, help="install the missing packages from these wheels first (offline)"
    )
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when available")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: checks every phase runs (CI, CPU)")
    p.add_argument(
        "--phase-budget",
        action="append",
        default=[],
        metavar="PHASE=SECONDS",
        help="override one phase's budget (repeatable); --budget still caps the command",
    )
    p.add_argument(
        "--budget",
        type=float,
        default=None,
        help=f"seconds for the whole command (default {DEFAULT_TOTAL_S}, smoke {SMOKE_TOTAL_S})",
    )
    p.add_argument(
        "--triton-tiles",
        default="auto",
        help="(train) tuned fused-kernel tiles: a JSON file, 'auto' (this command's kernels phase, else the "
        "newest results file of this GPU under benchmarks/results/ that has them) or 'none'",
    )
    p.add_argument("--child", choices=PHASES, default=None, help=argparse.SUPPRESS)
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)
    p.add_argument("--budget-s", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--roof", type=float, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child is None and not a.out:
        p.error("--out DIR is required")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before anything here or in a child queries CUDA
    if a.child:
        return child_main(a)
    selected = [p.strip() for p in a.phase.split(",") if p.strip()]
    unknown = [p for p in selected if p not in PHASES]
    if unknown:
        print(
            f"campaign: unknown phase(s) {', '.join(unknown)}; choose from {', '.join(PHASES)}",
            file=sys.stderr,
        )
        return 2
    phases = ["env"] + [p for p in PHASES[1:] if p in selected]
    try:
        overrides = {k: float(v) for k, v in (item.split("=", 1) for item in a.phase_budget)}
    except ValueError:
        overrides = {"?": 0.0}
    if not set(overrides) <= set(PHASES):
        print(
            f"campaign: --phase-budget takes PHASE=SECONDS, PHASE among {', '.join(PHASES)}", file=sys.stderr
        )
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    stamp = now.strftime("%Y%m%dT%H%M%SZ")
    log_path = out / f"campaign-{stamp}.log"
    log_file = log_path.open("a")

    def log(line: str) -> None:
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    started = time.monotonic()
    if a.wheels:
        install_wheels(Path(a.wheels), log)
    total = a.budget if a.budget is not None else (SMOKE_TOTAL_S if a.smoke else DEFAULT_TOTAL_S)
    result = schema.empty_result()
    result.update(
        date=now.isoformat(timespec="seconds"),
        git_revision=git("rev-parse", "HEAD") or "unknown",
        git_dirty=bool(git("status", "--porcelain", "--untracked-files=no")),
        smoke=bool(a.smoke),
    )
    tiles_file = Path(a.triton_tiles) if a.triton_tiles not in ("auto", "none") else None
    failed = False
    for i, phase in enumerate(phases):
        left = total - (time.monotonic() - started)
        budget = phase_budgets(phases[i:], left, a.smoke, overrides)[phase]
        if budget < MIN_PHASE_S / 2:
            result["phases"][phase] = {
                "status": "not run",
                "seconds": None,
                "error": "no time left in --budget",
            }
            continue
        part, seconds = run_child(phase, budget, a, result["bf16_matmul_tflops"], tiles_file, log)
        status, error = part.pop("_status", "failed"), part.pop("_error", None)
        result["phases"][phase] = {"status": status, "seconds": round(seconds, 1), "error": error}
        # A phase that raised fails the command; one cut short by its budget (partial, or killed as a
        # timeout on a slow machine) is reported, not fatal: the budget is what keeps CI bounded.
        failed |= status == "failed"
        for key, value in part.items():
            if key in result:
                result[key] = value
        if phase == "env" and result["device_type"] not in ("cuda", "cpu"):  # env failed: what we know
            import torch

            result["device_type"] = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
            result["device"] = result["device"] or f"unknown {result['device_type']} (env phase failed)"
        if phase == "env" and result["device_type"] == "cpu" and not a.smoke:
            log("campaign: no CUDA GPU here; a CPU run is a smoke test: add --smoke (and --device cpu)")
            break
        best = result["triton_best"] if phase == "kernels" else None
        if phase == "env" and a.triton_tiles == "auto" and "kernels" not in phases:
            best = kept_triton_best(REPO / "benchmarks" / "results", result["device"])
        if best and a.triton_tiles == "auto":
            tiles_file = out / f"triton-tiles-{stamp}.json"  # for the train phase of this command
            tiles_file.write_text(json.dumps(best))
    result = clean(result)
    name = f"campaign-{slug(result['device'] or 'unknown')}-{stamp}.json"
    problems = schema.validate(result)
    (out / name).write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")
    for line in summary_lines(result):
        log(line)
    if problems:
        log("results do not follow the schema: " + "; ".join(problems[:5]))
    log(f"results: {out / name}  (log: {log_path}; {time.monotonic() - started:.0f}s)")
    log_file.close()
    row_errors = [
        r["error"]
        for t in ("attention", "train", "memory", "gpu_train_run")
        for r in result[t]
        if r.get("error") and not str(r["error"]).startswith("skipped")
    ]
    if a.smoke and (row_errors or (result["tests"] or {}).get("failed")):
        failed = True  # on a CPU every smoke row must work; on a GPU a failing row is a result
        for e in row_errors[:10]:
            print(f"smoke: row error: {e}", file=sys.stderr)
    return 1 if (failed or problems) else 0


def slug(text: str) -> str:
    """File-name-safe lower-case form of a device name (letters, digits, '-')."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"
