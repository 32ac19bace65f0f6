"""Several pretrain_diff.py runs in one launch: each process trains them one after the other in one
process group, so a test pays the launch (interpreter, imports, rendezvous) once, not once per run.

`run_sequence(tmp, {name: flags, ...}, nproc)` runs them as `tests.distributed.runner.run_saved` would
(metrics in tmp/NAME.jsonl, checkpoint in tmp/NAME); runs may differ in layout (megatron-core's parallel
state is rebuilt between them) but not in world size. Run as a module, this file is the launched program.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.distributed.runner import TINY, job_env, launch_cmd, preloaded_cmd

THEN = "--then"
"""Separates the runs' argument lists on the command line."""
BANNER = "=== run "
"""Printed (rank 0) before each run: `split_output` cuts the job's stdout at it."""


def run_sequence(tmp: Path, runs: dict[str, list[str]], nproc: int, timeout: int = 900) -> dict[str, str]:
    """Train `runs` (NAME: flags after the tiny defaults) in one launch; returns each run's stdout."""
    argv: list[str] = []
    for name, extra in runs.items():
        argv += [THEN] if argv else []
        argv += [*TINY, "--metrics-file", str(tmp / f"{name}.jsonl"), *extra, "--save", str(tmp / name)]
    target, env = ["-m", "tests.distributed.sequence", *argv], job_env(tmp, nproc)
    cmd = launch_cmd(nproc, target) if nproc > 1 else preloaded_cmd(target, env)
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(
            f"{', '.join(runs)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    parts = proc.stdout.split(BANNER)[1:]
    return dict(zip(runs, parts, strict=True))


def main(argv: list[str]) -> int:
    from megatron.core import parallel_state

    from diffmeg import runtime
    from diffmeg.run_config import RunConfig
    from diffmeg.training.arguments import resolve_args
    from diffmeg.training.trainer import Trainer

    runs: list[list[str]] = [[]]
    for word in argv:
        runs.append([]) if word == THEN else runs[-1].append(word)
    runtime.setup()
    try:
        for number, run in enumerate(runs):
            if parallel_state.model_parallel_is_initialized():  # the next run may have another layout
                parallel_state.destroy_model_parallel()
            if os.environ.get("RANK", "0") == "0":
                print(f"{BANNER}{number}", flush=True)
            code = Trainer(RunConfig.from_args(resolve_args(run))).train()["exit_code"]
            if code:
                return code
    finally:
        runtime.teardown()
    return 0


if __name__ == "__main__":  # the dist-checkpoint writer uses a spawn context: this guard is required
    sys.exit(main(sys.argv[1:]))
