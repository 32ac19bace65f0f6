"""Child-process plumbing: a phase's environment and process, reading its output until a deadline, and
ending it with everything it started.

A phase runs in a process session of its own; so do the subprocesses a phase starts (pytest and its
workers, the pretrain_diff.py runs and their checkpoint writers), so that each can be ended whole.
`end` ends such a process: while it runs, its whole tree (`end_tree`: every descendant, found by parent
id across sessions, and the process groups they lead); after it exited, what its group still holds (a
helper that outlived it). So nothing a phase started keeps the GPU busy during the next phase.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COMPILED_PHASES = ("train", "memory")
"""Phases that run megatron-core's fusions compiled by TorchDynamo on a GPU, as pretrain_diff.py does."""
TOKENIZER_FILE_NAME = "cl100k_base.tiktoken"
"""A tokenizer file in the carried folder: the memory phase's runs read the builtin corpus with it."""
TOKENIZER_FILE_ENV = "DIFFMEG_TOKENIZER_FILE"
"""diffmeg.data.tokenizer.TOKENIZER_FILE_ENV, named here because this module runs before megatron-core
(which that module imports) is installed from the wheels."""


def child_env(a: argparse.Namespace) -> dict[str, str]:
    """This process's environment for a child: the checkout on the path, unbuffered output, one rank."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), env.get("PYTHONPATH", "")] if p)
    env["PYTHONUNBUFFERED"] = "1"
    for key in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "SLURM_PROCID",
        "SLURM_NTASKS",
    ):
        env.pop(key, None)  # every run here is one process: never join an outer launcher's job
    if a.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    carried = Path(a.wheels) / TOKENIZER_FILE_NAME if getattr(a, "wheels", None) else None
    if carried is not None and carried.is_file() and not env.get(TOKENIZER_FILE_ENV):
        # the GPU machine is offline: the tokenizer file is carried with the wheels
        env[TOKENIZER_FILE_ENV] = str(carried.resolve())
    return env


def torchdynamo_disable(phase: str, device_type: str) -> str:
    """TORCHDYNAMO_DISABLE for a phase's process. On a GPU the train and memory phases compile megatron-core's
    fusions as pretrain_diff.py does (what users get); on a CPU they run eagerly, as diffmeg.runtime.setup
    has it there (each compile costs ~20 s); the other phases never train a model."""
    return "0" if device_type == "cuda" and phase in COMPILED_PHASES else "1"


def _children_by_parent() -> dict[int, list[int]]:
    """Every live process's children, from /proc (Linux, where the campaign runs)."""
    out: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])  # fields after "(comm)": state, ppid, ...
        out.setdefault(ppid, []).append(int(entry.name))
    return out


def descendants(pid: int) -> list[int]:
    """Ids of every process below `pid`, whatever session or group it runs in."""
    children, found, todo = _children_by_parent(), [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _signal(target: int, sig: int, group: bool = False) -> None:
    try:
        (os.killpg if group else os.kill)(target, sig)
    except (ProcessLookupError, PermissionError):
        pass


def end_tree(pid: int) -> None:
    """SIGKILL the running process `pid`, every descendant and the process groups they lead (a group
    outlives its leader: grandchildren left behind by an exited child stay reachable through it)."""
    for target in (pid, *descendants(pid)):  # stopped first, so none starts more while we look
        _signal(target, signal.SIGSTOP)
    for target in (pid, *descendants(pid)):
        _signal(target, signal.SIGKILL, group=True)
        _signal(target, signal.SIGKILL)


def end(proc: subprocess.Popen) -> None:
    """End a process started in a session of its own with all it started: its tree while it runs, then
    whatever its process group still holds (helpers of a process that has exited), and reap it."""
    if proc.poll() is None:
        end_tree(proc.pid)
    _signal(proc.pid, signal.SIGKILL, group=True)  # its group id stays taken while members live
    proc.wait()


def lines_until(proc: subprocess.Popen, end: float) -> Iterator[str]:
    """The child's output lines until it exits or the time is up."""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    while True:
        left = end - time.monotonic()
        if left <= 0:
            return
        if not sel.select(timeout=min(left, 1.0)):
            if proc.poll() is not None:
                return
            continue
        line = proc.stdout.readline()
        if not line:
            return
        yield line


def run_phase_process(
    cmd: list[str], budget: float, env: dict[str, str], log: Callable[[str], None], part_file: Path
) -> tuple[dict, float]:
    """Run a phase's process for at most `budget` seconds, passing its output to `log`; end it with all
    it started, however it ended. Returns what it kept in `part_file` (rows written before a crash or
    kill included; `_status` timeout or failed where it did not end by itself with exit 0) and seconds."""
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    timed_out = False
    try:
        for line in lines_until(proc, start + budget):
            log(line.rstrip("\n"))
        try:
            proc.wait(timeout=max(1.0, start + budget - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
    finally:
        end(proc)  # a finished phase too: a helper it left behind must not outlive it
        proc.stdout.close()
    seconds = time.monotonic() - start
    try:
        part = json.loads(part_file.read_text()) if part_file.is_file() else {}
    except ValueError:
        part = {}
    shutil.rmtree(part_file.parent, ignore_errors=True)
    if timed_out:
        part["_status"], part["_error"] = "timeout", f"killed after {budget:.0f}s"
    elif proc.returncode != 0 or not part:
        part["_status"] = "failed"
        part["_error"] = part.get("_error") or f"phase process exited with {proc.returncode}"
    return part, seconds
