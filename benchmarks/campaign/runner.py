"""The campaign's runner: one child process per phase under its budget, then the results file and table.

`python3 -m benchmarks.campaign` (benchmarks/campaign/__main__.py) calls `main`; each phase runs as
`python3 -m benchmarks.campaign --child PHASE ...` (`child_main`), so a CUDA fault in one phase cannot take
the others down. The package's docstring (benchmarks/campaign/__init__.py) lists the phases and commands.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from benchmarks.campaign import schema
from benchmarks.campaign.env import phase_env
from benchmarks.campaign.gpu_tests import phase_tests
from benchmarks.campaign.install import install_wheels, missing_requirement
from benchmarks.campaign.kernels import phase_kernels
from benchmarks.campaign.memory import phase_memory
from benchmarks.campaign.merge import RESUMABLE_PHASES, ContinueError, load_earlier
from benchmarks.campaign.part import Part
from benchmarks.campaign.plan import (
    CHILD_MARGIN_S,
    DEFAULT_TOTAL_S,
    GPU_PLAN,
    LENT_CONTINUE_S,
    LENT_GPU_S,
    MIN_PHASE_S,
    PHASES,
    SMOKE_PLAN,
    SMOKE_TOTAL_S,
    Plan,
    phase_budgets,
)
from benchmarks.campaign.procs import REPO, child_env, run_phase_process, torchdynamo_disable
from benchmarks.campaign.results_file import ResultsFile, with_part
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
    on_update: Callable[[dict], None] | None = None,
) -> tuple[dict, float]:
    """Run one phase in a child process; its results (what it kept before any crash) and seconds.
    `figures`: the env phase's roof, peak and GPU memory, for the train phase's MFU and layer count;
    `reuse`: the --continue file whose measured comparisons the train phase does not time again (same GPU
    only); `on_update`: called with the phase's results each time the child saved them."""
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
    if (figures.get("machine") or {}).get("gpu_memory_gib"):
        cmd += ["--gpu-gib", str(figures["machine"]["gpu_memory_gib"])]
    if reuse is not None and phase in RESUMABLE_PHASES:
        cmd += ["--continue", str(reuse)]
    log(f"=== phase {phase} (budget {budget:.0f}s)")
    env = child_env(a)
    env["TORCHDYNAMO_DISABLE"] = torchdynamo_disable(phase, device_type)
    return run_phase_process(cmd, budget, env, log, part_file, on_update)


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
        "--lent-gpu",
        action="store_true",
        help=f"one lent GPU's command (docs/gpu.md): the env and train phases within {LENT_GPU_S} s, or with "
        f"--continue the comparisons the first left within {LENT_CONTINUE_S} s (--budget still wins)",
    )
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
        help=f"seconds for the whole command (default {DEFAULT_TOTAL_S}, smoke {SMOKE_TOTAL_S}, "
        f"--lent-gpu {LENT_GPU_S} or {LENT_CONTINUE_S})",
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
        "times only the comparisons that file lacks or holds with an error, and keeps its rows",
    )
    p.add_argument(
        "--plan",
        action="store_true",
        help="print the train phase's comparisons in order (the GPU plan, or the smoke plan with --smoke), "
        "where docs/gpu.md's two --lent-gpu commands reach, and the device time they take at the rate of "
        "the newest GPU results file (the last line); runs nothing",
    )
    p.add_argument("--child", choices=PHASES, default=None, help=argparse.SUPPRESS)
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)
    p.add_argument("--budget-s", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--roof", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--peak", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--gpu-gib", type=float, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.lent_gpu:
        a.phase = "env,train"
        if a.budget is None:
            a.budget = LENT_CONTINUE_S if a.continue_from else LENT_GPU_S
        a.phase_budget = [f"train={a.budget}", *a.phase_budget]  # all the env phase leaves
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
        for line in plan_lines(plan_for(a.smoke), REPO / "benchmarks" / "results", a.smoke):
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
    """Prepare the machine, run each phase's child, write the results file; the exit status. The file is
    written whole (a temporary file renamed over it) after every phase and whenever a phase's child saved
    its rows, so a command stopped at any moment, even killed, leaves a file holding what it measured."""
    started = time.monotonic()
    stamp = now.strftime("%Y%m%dT%H%M%SZ")
    result = schema.empty_result()
    carried = Path(a.wheels) if a.wheels else None
    if carried is not None:
        result["wheels"] = install_wheels(carried, log)
        result["wheels"]["seconds"] = round(time.monotonic() - started, 1)
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
    results = ResultsFile(out, stamp, earlier, Path(a.continue_from).name if earlier else None, phases)
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

        def progress(part: dict, phase: str = phase, before: dict = result) -> None:
            running = {"status": "partial", "seconds": None, "error": "unfinished: the command ended here"}
            results.write(with_part(before, phase, part, running))

        part, seconds = run_child(phase, budget, a, device_type, result, log, reuse=reuse, on_update=progress)
        status, error = part.pop("_status", "failed"), part.pop("_error", None)
        info = {"status": status, "seconds": round(seconds, 1), "error": error}
        if reuse is not None and phase in RESUMABLE_PHASES:  # comparisons the earlier command measured
            info["reused"] = part.get("_reused", 0)
        # A phase that raised fails the command; one cut short by its budget (partial, or killed as a
        # timeout on a slow machine) is reported, not fatal: the budget is what keeps CI bounded.
        failed |= status == "failed"
        result = with_part(result, phase, part, info)
        if phase == "env" and result["device_type"] not in ("cuda", "cpu"):  # env failed: what we know
            import torch

            result["device_type"] = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
            result["device"] = result["device"] or f"unknown {result['device_type']} (env phase failed)"
        results.write(result)
        if phase == "env" and result["device_type"] == "cpu" and not a.smoke:
            log("campaign: no CUDA GPU here; a CPU run is a smoke test: add --smoke (and --device cpu)")
            break
    if results.merge_error:  # another GPU: this command's results stand alone
        log(f"campaign: {results.merge_error}")
        failed = True
    final = results.write(result)
    problems = schema.validate(final)
    for line in summary_lines(final):
        log(line)
    if problems:
        log("results do not follow the schema: " + "; ".join(problems[:5]))
    log(f"results: {results.path}  (log: {log_path}; {time.monotonic() - started:.0f}s)")
    row_errors = [
        r["error"]
        for t in ("attention", "train", "memory", "gpu_train_run", "levers")
        for r in final.get(t) or []
        if r.get("error") and not str(r["error"]).startswith(("skipped", "unfinished"))  # cut by the budget
    ]
    tests = final["tests"] or {}
    if a.smoke and (row_errors or tests.get("failed") or tests.get("errors")):
        failed = True  # on a CPU every smoke row must work; on a GPU a failing row is a result
        for e in row_errors[:10]:
            print(f"smoke: row error: {e}", file=sys.stderr)
    return 1 if (failed or problems) else 0
