"""What the train phase's plan costs in device time: `python3 -m benchmarks.campaign --plan`.

The rate is read from the newest GPU results file whose train phase finished (`rate_from`). A file of this
design gives it directly: each train row's `build_s` (from the build request to the end of the warm-up
window) and its median step time. A file from before it (one process timing one run after another) gives
seconds a run: the phase's time over its rows (the first H100 run: 233.7 s for 10 rows, 23.4 s a run: a
model built, compiled and stepped 8 times, the phase's process start shared among them). A run of this
design maps onto it as a build (worker start, build, compilation and warm-up window: the old run's build
and its 8 steps) plus its comparison's timed windows at the file's step time (the slowest model's at
that length), both twins': 2 x windows x steps a window. Each command adds the wheels' install and the
env phase, and a profiled fast path one more step and the profiler's processing (PROFILE_S).

`simulate` plays the two commands of docs/gpu.md through the plan with the rule the train phase itself
applies (benchmarks/campaign/interleave.py): a comparison starts only if its estimate fits what is left
of the command, less the child's margin; what the first command leaves goes to the second (`--continue`).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from benchmarks.campaign import schema
from benchmarks.campaign.plan import CHILD_MARGIN_S, DEVICE_START_S
from benchmarks.campaign.train_plan import Comparison, Variant, alive_after

INSTALL_S = 10.0
"""The wheels' offline install (megatron-core, torchao) where a file does not record it (`wheels.seconds`)."""
PROFILE_S = 5.0
"""torch.profiler's step and the processing of its trace, for each profiled fast path (not yet measured)."""


@dataclass(frozen=True)
class Rate:
    """What the parts of a train phase cost on one GPU."""

    build_s: float
    """One variant: its worker's start, build, compilation and warm-up window."""
    step_s: dict[int, float]
    """Seconds an optimizer step takes at each length (the slowest model's)."""
    command_s: float
    """Each command's wheels' install and env phase."""
    source: str
    how: str
    """How `build_s` was read, for --plan's output."""

    def with_build_s(self, build_s: float) -> Rate:
        return replace(self, build_s=build_s)


def rate_from(results: Path) -> Rate | None:
    """The rate of the newest GPU results file under `results` whose train phase finished; None if none."""
    for path in sorted(results.glob("campaign-*.json"), reverse=True):  # names end in their UTC time
        try:
            r = schema.read(path)
        except ValueError:
            continue
        info = r["phases"].get("train") or {}
        rows = [t for t in r["train"] if t.get("tokens_per_s") and not t.get("from") and not t.get("error")]
        if r["device_type"] != "cuda" or r["smoke"] or info.get("status") != "ok" or not rows:
            continue
        steps: dict[int, float] = {}
        for t in rows:
            step = t.get("step_s") or t["micro_batch_size"] * t["microbatches"] * t["seq"] / t["tokens_per_s"]
            steps[t["seq"]] = max(steps.get(t["seq"], 0.0), step)
        wheels = r.get("wheels") or {}
        command = (r["phases"]["env"].get("seconds") or 0.0) + (wheels.get("seconds") or INSTALL_S)
        builds = [t["build_s"] for t in rows if t.get("build_s")]
        if builds:
            how = f"{len(builds)} builds there, {statistics.fmean(builds):.1f} s each on average"
            build = statistics.fmean(builds)
        else:
            build = info["seconds"] / len(r["train"])
            how = (f"its train phase: {len(r['train'])} runs in {info['seconds']:.1f} s, {build:.1f} s a run "
                   "(build, compilation and 8 steps), taken as one build and warm-up here")  # fmt: skip
        return Rate(build, steps, command, path.name, how)
    return None


def comparison_seconds(
    builds: int, profiles: int, build_s: float, step_s: float, window_steps: int, windows: int
) -> float:
    """A comparison's estimate: its builds, both twins' timed windows, and its fast paths' profiles."""
    return builds * build_s + 2 * windows * window_steps * step_s + profiles * (PROFILE_S + step_s)


def profiles_due(c: Comparison, profiled: set[tuple]) -> list[Variant]:
    """The twins of `c` to profile after its windows: fast paths not yet profiled in this command."""
    return [v for v in (c.off, c.on) if v.profile and v.key not in profiled]


def step_at(rate: Rate, seq: int) -> float:
    return rate.step_s.get(seq) or max(rate.step_s.values(), default=1.0)


@dataclass(frozen=True)
class Planned:
    """One comparison as the simulation places it."""

    comparison: Comparison
    command: int | None
    """1, 2, ...: the command that runs it; None: none of them (a later --continue)."""
    builds: int
    seconds: float


def simulate(
    comparisons: list[Comparison], rate: Rate, budgets: tuple[float, ...], window_steps: int, windows: int
) -> tuple[list[Planned], list[float]]:
    """Each comparison's command and estimate, and each command's estimated seconds (those with work)."""
    left = list(comparisons)
    placed: dict[str, Planned] = {}
    totals: list[float] = []
    for number, budget in enumerate(budgets, start=1):
        t, alive, skipped, profiled = rate.command_s, (), [], set()
        end = budget - min(CHILD_MARGIN_S, 0.15 * (budget - rate.command_s))
        for c in left:
            after, build = alive_after(alive, c)
            due = profiles_due(c, profiled)
            step = step_at(rate, c.on.seq)
            cost = comparison_seconds(len(build), len(due), rate.build_s, step, window_steps, windows)
            if t + cost > end:
                skipped.append(c)
                continue
            t, alive = t + cost, after
            profiled |= {v.key for v in due}
            placed[c.name] = Planned(c, number, len(build), cost)
        if len(skipped) < len(left):
            totals.append(t)
        left = skipped
    for c in left:
        placed[c.name] = Planned(c, None, 0, 0.0)
    return [placed[c.name] for c in comparisons], totals


def device_time_line(totals: list[float]) -> str:
    """--plan's last line: the machine's start and each command's estimate."""
    return f"device time: {DEVICE_START_S + sum(totals):.0f} s in {len(totals)} commands"
