"""`--continue FILE`: one results file from several commands of the same code on the same GPU.

Every phase together takes longer than one device command may run (the first H100 run: env 10 s, tests
84, kernels 68, train 234, memory 266; 600 s per command), and a failed phase is re-run alone. A command
given an earlier results file starts from its rows and phases; the phases it runs replace theirs (rows
and status), the rest are kept, and the headline figures are derived again from the merged rows. A train
phase is resumed instead: it times only the runs the earlier file lacks (or holds with an error), and its
rows are added to the earlier file's (`benchmarks.campaign.resume`), which name the file they came from. The
file names what it continues (`continues`). Only the same revision, clean, on the same device is merged:
anything else would mix code or hardware in one file.
"""

from __future__ import annotations

import copy
from pathlib import Path

from benchmarks.campaign import schema
from benchmarks.campaign.resume import combined

# Keys every command writes itself (the env phase always runs): never taken from the earlier file.
OWN_KEYS = ("date", "machine", "versions", "device", "device_type", "bf16_matmul_tflops", "peak_bf16_tflops",
            "git_revision", "git_dirty", "git_source", "wheels", "smoke")  # fmt: skip


class ContinueError(Exception):
    """An earlier results file this command cannot continue; the message says why and what to do."""


def load_earlier(path: Path, revision: str, dirty: bool | None, smoke: bool) -> dict:
    """The earlier results, checked against this command's code before any phase runs."""
    try:
        earlier = schema.read(path)
    except ValueError as exc:
        raise ContinueError(f"--continue {path}: not a campaign results file: {exc}") from None
    if bool(earlier["smoke"]) != smoke:
        raise ContinueError(
            f"--continue {path}: a {'smoke' if earlier['smoke'] else 'GPU'} run; this one is not"
        )
    if earlier["git_dirty"] or dirty or earlier["git_revision"] != revision:
        theirs = f"{earlier['git_revision'][:12]}{' (modified)' if earlier['git_dirty'] else ''}"
        mine = f"{revision[:12]}{' (modified)' if dirty else ''}"
        raise ContinueError(
            f"--continue {path}: it ran {theirs}, this tree is {mine}; only one clean revision is merged: "
            "run every phase again (leave --continue out)"
        )
    return earlier


def merged(earlier: dict, earlier_name: str, current: dict, ran: list[str]) -> dict:
    """`current` on top of `earlier`: the phases in `ran` and the command's own keys from `current`, every
    other phase's status and rows from `earlier`. Raises ContinueError for another device."""
    if earlier["device"] != current["device"]:
        raise ContinueError(
            f"--continue {earlier_name}: it ran on {earlier['device']}, this command on {current['device']}: "
            "results of two GPUs are not merged (this command's file is written on its own)"
        )
    out = copy.deepcopy(earlier)
    written = {key for phase in ran for key in PHASE_KEYS.get(phase, ())}
    resumed = {key for phase in ran if phase in RESUMABLE_PHASES for key in PHASE_KEYS[phase]}
    for key in (*OWN_KEYS, *written):
        if key in resumed:  # a continued train phase timed only what the earlier file lacked
            now = copy.deepcopy(current.get(key) or [])
            out[key] = combined(key, earlier.get(key) or [], now, earlier_name)
        elif key in current:
            out[key] = copy.deepcopy(current[key])
    out["phases"] = {**earlier["phases"], **{p: current["phases"][p] for p in ran}}
    out["continues"] = [*earlier.get("continues", []), earlier_name]
    return out


PHASE_KEYS: dict[str, tuple[str, ...]] = {
    "env": (),  # its keys are OWN_KEYS
    "tests": ("tests",),
    "kernels": ("attention",),
    "train": ("train", "levers"),
    "memory": ("memory", "gpu_train_run"),
}
"""The row keys each phase writes: a re-run phase replaces exactly these (a resumable one adds to them)."""
RESUMABLE_PHASES = ("train",)
"""Phases that continue the earlier file's rows (`benchmarks.campaign.resume`) instead of replacing them:
the train phase's runs are independent measurements, and its matrix needs more than one command. A
re-run tests, kernels or memory phase replaces its rows: its figures (a pass count, the attention
timings, one memory plan) belong to one run of the phase."""
