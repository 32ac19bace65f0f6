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
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from benchmarks.campaign import schema
from benchmarks.campaign.env import phase_env
from benchmarks.campaign.figures import headlines
from benchmarks.campaign.gpu_tests import phase_tests
from benchmarks.campaign.install import install_wheels, missing_requirement
from benchmarks.campaign.kernels import phase_kernels
from benchmarks.campaign.memory import phase_memory
from benchmarks.campaign.merge import RESUMABLE_PHASES, ContinueError, load_earlier, merged
from benchmarks.campaign.part import Part, clean
from benchmarks.campaign.plan import (
    CHILD_MARGIN_S,
    DEFAULT_TOTAL_S,
    GPU_PLAN,
    MIN_PHASE_S,
    PHASES,
    SMOKE_PLAN,
    SMOKE_TOTAL_S,
    Plan,
    phase_budgets,
)
from benchmarks.campaign.procs import REPO, child_env, run_phase_process, torchdynamo_disable
from benchmarks.campaign.source import STAMP_NAME, source_revision, write_stamp
from benchmarks.campaign.summary import summary_lines
from benchmarks.campaign.train import phase_train, plan_lines

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


def plan_for(smoke: bool) -> Plan:
    return SMOKE_PLAN if smoke else GPU_PLAN


def child_main(a: argparse.Namespace) -> int:
    part = Part(Path(a.part))
    deadline = time.monotonic() + a.budget_s - min(CHILD_MARGIN_S, 0.15 * a.budget_s)
    plan = plan_for(a.smoke)
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
    device_type: str,
    figures: dict,
    log: Callable[[str], None],
    reuse: Path | None = None,
) -> tuple[dict, float]:
    """Run one phase in a child process; its results (what it kept before any crash) and seconds.
    `figures`: the env phase's roof and peak, for the train phase's MFU; `reuse`: the --continue file
    whose measured train runs the train phase does not time again (same GPU only)."""
    part_file = Path(tempfile.mkdtemp(prefix="campaign-part-")) / f"{phase}.json"
    cmd = [sys.executable, "-m", "benchmarks.campaign", "--child", phase, "--part", str(part_file)]
    cmd += ["--budget-s", str(budget)]
    if a.device:
        cmd += ["--device", a.device]
    if a.smoke:
        cmd.append("--smoke")
    for flag, key in (("--roof", "bf16_matmul_tflops"), ("--peak", "peak_bf16_tflops")):
        if figures.get(key):
            cmd += [flag, str(figures[key])]
    if reuse is not None and phase in RESUMABLE_PHASES:
        cmd += ["--continue", str(reuse)]
    log(f"=== phase {phase} (budget {budget:.0f}s)")
    env = child_env(a)
    env["TORCHDYNAMO_DISABLE"] = torchdynamo_disable(phase, device_type)
    return run_phase_process(cmd, budget, env, log, part_file)


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
        "--prepare",
        action="store_true",
        help="in the git checkout, before each GPU command: write campaign-source.json (revision, digest of "
        "the tracked files) into the --wheels folder (default .whl), which travels with the command",
    )
    p.add_argument(
        "--continue",
        dest="continue_from",
        default=None,
        metavar="FILE",
        help="add this command's phases to an earlier results file of the same clean revision and GPU "
        "(its other phases and rows are kept; the new file names it in 'continues'); a train phase "
        "times only the runs that file lacks or holds with an error, and keeps its rows",
    )
    p.add_argument(
        "--plan",
        action="store_true",
        help="print the train phase's runs in order (the GPU plan, or the smoke plan with --smoke), each "
        "lever twin once, their count and a time estimate from the newest GPU results file; runs nothing",
    )
    p.add_argument("--child", choices=PHASES, default=None, help=argparse.SUPPRESS)
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)
    p.add_argument("--budget-s", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--roof", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--peak", type=float, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child is None and not a.prepare and not a.plan and not a.out:
        p.error("--out DIR is required")
    return a


def prepare(folder: Path) -> int:
    """--prepare: stamp the checkout into the carried folder; list what the folder will carry."""
    stamp = write_stamp(folder, REPO)
    if not stamp:
        print(f"campaign: {REPO} is not a git checkout: nothing to stamp", file=sys.stderr)
        return 2
    dirty = " (tracked files modified: commit first to name the code exactly)" if stamp["git_dirty"] else ""
    print(f"campaign: {folder / STAMP_NAME}: revision {stamp['git_revision'][:12]}{dirty}, "
          f"{len(stamp['files'])} tracked files")  # fmt: skip
    wheels = sorted(w.name for w in folder.glob("*.whl"))
    print(f"campaign: wheels in {folder}: {', '.join(wheels) or 'none'}")
    if not any(w.startswith("megatron_core-") for w in wheels):
        print("campaign: no megatron_core wheel: the GPU machine lacks it (docs/gpu.md, 'Wheels to bring')")
    return 0


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before anything here or in a child queries CUDA
    if a.child:
        return child_main(a)
    if a.prepare:
        return prepare(Path(a.wheels or ".whl"))
    if a.plan:
        for line in plan_lines(plan_for(a.smoke), REPO / "benchmarks" / "results"):
            print(line)
        return 0
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
    with log_path.open("a") as log_file:

        def log(line: str) -> None:
            print(line, flush=True)
            log_file.write(line + "\n")
            log_file.flush()

        return _run(a, phases, overrides, out, now, log, log_path)


def _run(
    a: argparse.Namespace,
    phases: list[str],
    overrides: dict[str, float],
    out: Path,
    now: datetime.datetime,
    log: Callable[[str], None],
    log_path: Path,
) -> int:
    """Prepare the machine, run each phase's child, write the results file; the exit status."""
    started = time.monotonic()
    stamp = now.strftime("%Y%m%dT%H%M%SZ")
    result = schema.empty_result()
    carried = Path(a.wheels) if a.wheels else None
    if carried is not None:
        result["wheels"] = install_wheels(carried, log)
    problem = missing_requirement(result["wheels"])
    if problem:
        log(f"campaign: {problem}")
        return 2
    revision, dirty, source = source_revision(REPO, carried)
    earlier = None
    if a.continue_from:
        try:
            earlier = load_earlier(Path(a.continue_from), revision, dirty, bool(a.smoke))
        except ContinueError as exc:
            log(f"campaign: {exc}")
            return 2
    result.update(
        date=now.isoformat(timespec="seconds"),
        git_revision=revision,
        git_dirty=dirty,
        git_source=source,
        smoke=bool(a.smoke),
    )
    total = a.budget if a.budget is not None else (SMOKE_TOTAL_S if a.smoke else DEFAULT_TOTAL_S)
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
        device_type = result["device_type"] or a.device or ""
        reuse = None
        if earlier is not None and earlier["device"] == result["device"]:  # another GPU's rows: never
            reuse = Path(a.continue_from)
        part, seconds = run_child(phase, budget, a, device_type, result, log, reuse=reuse)
        status, error = part.pop("_status", "failed"), part.pop("_error", None)
        result["phases"][phase] = {"status": status, "seconds": round(seconds, 1), "error": error}
        if reuse is not None and phase in RESUMABLE_PHASES:  # runs the earlier command measured
            result["phases"][phase]["reused"] = part.pop("_reused", 0)
        # A phase that raised fails the command; one cut short by its budget (partial, or killed as a
        # timeout on a slow machine) is reported, not fatal: the budget is what keeps CI bounded.
        failed |= status == "failed"
        for key, value in part.items():
            if key in result:
                result[key] = value
        result.update(headlines(result))  # from the rows kept, finished or not
        if phase == "env" and result["device_type"] not in ("cuda", "cpu"):  # env failed: what we know
            import torch

            result["device_type"] = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
            result["device"] = result["device"] or f"unknown {result['device_type']} (env phase failed)"
        if phase == "env" and result["device_type"] == "cpu" and not a.smoke:
            log("campaign: no CUDA GPU here; a CPU run is a smoke test: add --smoke (and --device cpu)")
            break
    if earlier is not None:
        try:
            result = merged(earlier, Path(a.continue_from).name, result, phases)
            result.update(headlines(result))
        except ContinueError as exc:  # another GPU: this command's results stand alone
            log(f"campaign: {exc}")
            failed = True
    result = clean(result)
    name = f"campaign-{slug(result['device'] or 'unknown')}-{stamp}.json"
    problems = schema.validate(result)
    (out / name).write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")
    for line in summary_lines(result):
        log(line)
    if problems:
        log("results do not follow the schema: " + "; ".join(problems[:5]))
    log(f"results: {out / name}  (log: {log_path}; {time.monotonic() - started:.0f}s)")
    row_errors = [
        r["error"]
        for t in ("attention", "train", "memory", "gpu_train_run")
        for r in result[t]
        if r.get("error") and not str(r["error"]).startswith("skipped")
    ]
    tests = result["tests"] or {}
    if a.smoke and (row_errors or tests.get("failed") or tests.get("errors")):
        failed = True  # on a CPU every smoke row must work; on a GPU a failing row is a result
        for e in row_errors[:10]:
            print(f"smoke: row error: {e}", file=sys.stderr)
    return 1 if (failed or problems) else 0


def slug(text: str) -> str:
    """File-name-safe lower-case form of a device name (letters, digits, '-')."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"
