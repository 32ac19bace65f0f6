"""The interleaving timer: each comparison's two variants alive at once, their windows alternated.

A twin timed once can mislead by far (a clean-clone smoke on a loaded machine once timed the `sdpa` twin at
120 tokens/s against ~1,400 for its partners, and four levers "gained" 12-22x from it), and so can a cold
first process on a GPU. Here both twins of a comparison are live workers (benchmarks/campaign/worker.py):
after each one's warm-up window (compilation, cuDNN's heuristics, the allocator, CUDA graphs' capture;
recorded as `warmup_windows`, never in a gain) their timed windows alternate off, on, off, on, ... and the
gain is median(on) / median(off) of their tokens/s. A variant alive from the comparison before is kept
(the anchor) and only its new partner is built; every other worker is ended first, so the GPU holds two
models at a time; the next build's worker is started while a comparison's windows run, so its imports
cost no time. Each variant's own train row is the median of all its timed windows (tokens/s, MFU).

Rows are written to the phase's results (`Part`) after every window, so a phase killed at its budget keeps
what it measured. A comparison starts only when its estimate (benchmarks/campaign/estimate.py, corrected
by this command's own builds) fits the time left; a variant that fails to build or step is recorded with
its error, never built again in this command, and the comparisons that need it say so; the rest go on.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from benchmarks.campaign.estimate import Rate, comparison_seconds, profiles_due, step_at
from benchmarks.campaign.part import Part
from benchmarks.campaign.train_plan import Comparison, Variant, alive_after
from benchmarks.campaign.worker import WorkerError

SKIPPED = "skipped: time budget"
BUILD_TIMEOUT_S = 600.0
"""At most this long for a build, and for the warm-up window after it (where the compiled layers compile)."""
WINDOW_TIMEOUT_S = 180.0
"""At most this long for a timed window or a profiled step: far over any step of these models, short of
letting a hung worker take the command."""


class _Live:
    """A variant's worker and its train row."""

    def __init__(self, variant: Variant, worker, row: dict) -> None:
        self.variant, self.worker, self.row = variant, worker, row


class Bench:
    """Runs comparisons (benchmarks/campaign/train_plan.py) with workers from `spawn`, writing `train` rows
    (one per variant) and `levers` rows (one per comparison) to `part`."""

    def __init__(
        self,
        spawn: Callable[[], object],
        spec: Callable[[Variant], dict],
        row_of: Callable[[Variant, dict], dict],
        part: Part,
        deadline: float,
        window_steps: int,
        windows: int,
        warmup_steps: int,
        rate: Rate | None = None,
        mfu_of: tuple[float | None, float | None] = (None, None),
        clock: Callable[[], float] = time.monotonic,
        log: Callable[[str], None] = print,
    ) -> None:
        """`spec(variant)`: the worker's build request; `row_of(variant, facts)`: its train row from the
        build's facts (`update_row` fills in the windows' figures, MFU against `mfu_of`: the dense peak and
        the measured matmul rate, TFLOP/s); `rate`: what a build and a step cost, for the estimate that
        decides whether a comparison still fits before `deadline` (this command's own builds and steps
        replace it as they are measured)."""
        self.spawn, self.spec, self.row_of, self.part = spawn, spec, row_of, part
        self.deadline, self.window_steps, self.windows = deadline, window_steps, windows
        self.warmup_steps, self.rate, self.mfu_of = warmup_steps, rate, mfu_of
        self.clock, self.log = clock, log
        self.alive: dict[tuple, _Live] = {}
        self.rows: dict[tuple, dict] = {}
        self.failed: dict[tuple, str] = {}
        self.profiled: set[tuple] = set()
        self.build_costs: list[float] = []
        self.spare = None
        self.started = clock()

    def say(self, text: str) -> None:
        self.log(f"[{self.clock() - self.started:5.0f} s] {text}")

    def run(self, comparisons: list[Comparison], done: set[str] = frozenset()) -> None:
        """Every comparison in order, except those named in `done` (measured by a continued file)."""
        todo = [c for c in comparisons if c.name not in done]
        try:
            for i, c in enumerate(todo):
                self.compare(c, more=i + 1 < len(todo))
        finally:
            self.close()

    def close(self) -> None:
        for live in list(self.alive.values()):
            self._stop(live)
        if self.spare is not None:
            self.spare.close()
            self.spare = None

    def compare(self, c: Comparison, more: bool = False) -> dict:
        """Time one comparison (its row is returned and kept in `part`); `more`: start a worker ahead for
        the next one's build while this one's windows run."""
        row = lever_row(c)
        self.part.add("levers", row)
        failed = [f"{side} twin failed: {self.failed[v.key]}" for side, v in (("off", c.off), ("on", c.on))
                  if v.key in self.failed]  # fmt: skip
        if failed:
            return self._finish(row, "; ".join(failed))
        _, build = alive_after(tuple(self.alive), c)
        if self.clock() + self._estimate(c, build) > self.deadline:
            self.part.set(_status="partial", _error="some comparisons skipped: time budget")
            return self._finish(row, SKIPPED)
        for key in [k for k in self.alive if k not in (c.off.key, c.on.key)]:
            self._stop(self.alive[key])
        workers = [self.spare] if self.spare is not None else []  # both started now: imports overlap
        workers += [self.spawn() for _ in range(len(build) - len(workers))]
        self.spare = None
        for side, variant in (("off", c.off), ("on", c.on)):
            if variant not in build:
                continue
            error = self._start(variant, workers.pop(0), row["warmup_windows"][side])
            if error:
                self.spare = workers.pop() if workers else None
                return self._finish(row, f"{side} twin failed: {error}")
        self.spare = workers.pop() if workers else (self.spawn() if more else None)
        self.say(f"--- {c.name}: {c.on.label} against {c.off.label}")
        for _ in range(self.windows):
            for side, variant in (("off", c.off), ("on", c.on)):
                tokens_per_s = self._window(variant)
                if tokens_per_s is None:
                    return self._finish(row, f"{side} twin failed: {self.failed[variant.key]}")
                row[f"{side}_windows"].append(tokens_per_s)
                self.part.save()
        for variant in profiles_due(c, self.profiled):
            self._profile(variant)
        return self._finish(row, None)

    def _estimate(self, c: Comparison, built: list[Variant]) -> float:
        """Seconds `c` should take: this command's own builds and steps where measured, else the rate's;
        0 where neither is known (the first comparison of a CPU smoke run)."""
        steps = [r["step_s"] for r in self.rows.values() if r.get("step_s") and r["seq"] == c.on.seq]
        step = max(steps) if steps else (step_at(self.rate, c.on.seq) if self.rate else 0.0)
        if self.build_costs:
            build = statistics.fmean(self.build_costs)
        else:
            build = self.rate.build_s if self.rate else 0.0
        due = len(profiles_due(c, self.profiled))
        return comparison_seconds(len(built), due, build, step, self.window_steps, self.windows)

    def _start(self, variant: Variant, worker, warmups: list[float]) -> str | None:
        """Build `variant` in `worker` and run its warm-up window; its tokens/s go to `warmups` (the
        comparison's) and to the variant's row. The error, where it failed."""
        start = self.clock()
        try:
            facts = worker.request("build", BUILD_TIMEOUT_S, spec=self.spec(variant))
        except WorkerError as exc:
            worker.close()
            return self._fail(variant, str(exc), None)
        train_row = self.rows.get(variant.key)
        if train_row is None:
            train_row = self.row_of(variant, facts)
            self.rows[variant.key] = train_row
            self.part.add("train", train_row)
        live = self.alive[variant.key] = _Live(variant, worker, train_row)
        warmup = self._steps(live, self.warmup_steps, BUILD_TIMEOUT_S)  # compilation is in it
        if warmup is None:
            return self.failed[variant.key]
        train_row["warmup_windows"].append(warmup)
        warmups.append(warmup)
        train_row["build_s"] = self.clock() - start
        self.build_costs.append(train_row["build_s"])
        what = f"{variant.model} s{variant.seq} {variant.label} ({facts.get('backend')})"
        self.say(f"built {what} and warmed up in {train_row['build_s']:.0f} s: warm-up {warmup:.0f} tokens/s")
        self.part.save()
        return None

    def _steps(self, live: _Live, steps: int, timeout: float) -> float | None:
        """Tokens/s of one window of `steps` steps; None when the worker failed (recorded, ended)."""
        try:
            reply = live.worker.request("window", timeout, steps=steps)
        except WorkerError as exc:
            self.alive.pop(live.variant.key, None)
            live.worker.close()
            self._fail(live.variant, str(exc), live.row)
            return None
        if reply.get("mem_gib") is not None:
            live.row["mem_gib"] = reply["mem_gib"]
        return live.row["tokens_per_step"] * steps / reply["seconds"]

    def _window(self, variant: Variant) -> float | None:
        live = self.alive.get(variant.key)
        if live is None:
            return None
        tokens_per_s = self._steps(live, self.window_steps, WINDOW_TIMEOUT_S)
        if tokens_per_s is not None:
            live.row["windows"].append(tokens_per_s)
            live.row["window_steps"] = self.window_steps
            update_row(live.row, *self.mfu_of)
        return tokens_per_s

    def _profile(self, variant: Variant) -> None:
        live = self.alive[variant.key]
        self.profiled.add(variant.key)
        try:
            live.row["profile"] = live.worker.request("profile", WINDOW_TIMEOUT_S)["profile"]
            live.row["profiled"] = True
        except WorkerError as exc:  # a profile that fails costs the row nothing it measured
            live.row["profile_error"] = str(exc)
        self.part.save()

    def _fail(self, variant: Variant, error: str, row: dict | None) -> str:
        self.failed[variant.key] = error
        self.say(f"{variant.model} s{variant.seq} {variant.label}: {error}")
        if row is None:
            row = self.rows.get(variant.key)
        if row is None:  # failed to build: its row says why
            row = self.rows[variant.key] = self.row_of(variant, {})
            self.part.add("train", row)
        if not row["windows"]:
            row["error"] = error
        else:
            row["note"] = f"later: {error}"
        self.part.save()
        return error

    def _stop(self, live: _Live) -> None:
        live.worker.close()
        self.alive.pop(live.variant.key, None)

    def _finish(self, row: dict, error: str | None) -> dict:
        off, on = row["off_windows"], row["on_windows"]
        if error is None and (len(off) < 2 or len(on) < 2):
            error = "fewer than two timed windows a twin"
        row["off_tokens_per_s"] = statistics.median(off) if off else None
        row["on_tokens_per_s"] = statistics.median(on) if on else None
        row["gain"] = row["on_tokens_per_s"] / row["off_tokens_per_s"] if error is None else None
        row["error"] = error
        self.part.save()
        if error is None:
            self.say(f"    gain {row['gain']:.3f}x: median {row['on_tokens_per_s']:.0f} over "
                     f"{row['off_tokens_per_s']:.0f} tokens/s ({len(on)} + {len(off)} windows)")  # fmt: skip
        else:
            self.say(f"    {row['lever']}: {error}")
        return row


def lever_row(c: Comparison) -> dict:
    """The `levers` row of a comparison before its windows."""
    return {
        "lever": c.name, "kind": c.kind, "group": c.group, "model": c.on.model, "seq": c.on.seq,
        "on_model": c.on.model, "off_model": c.off.model, "on_label": c.on.label, "off_label": c.off.label,
        "on": list(c.on.flags), "off": list(c.off.flags), "on_flags": list(c.on.flags),
        "off_flags": list(c.off.flags), "off_windows": [], "on_windows": [],
        "warmup_windows": {"off": [], "on": []}, "off_tokens_per_s": None, "on_tokens_per_s": None,
        "gain": None, "note": c.note, "error": "unfinished",
    }  # fmt: skip


def update_row(row: dict, peak: float | None, roof: float | None) -> None:
    """A train row's figures from its timed windows: the median tokens/s, its step time and TFLOP/s, and
    MFU against the dense `peak` and the measured matmul rate `roof` (TFLOP/s; None on a CPU)."""
    windows = row["windows"]
    if not windows:
        return
    tokens_per_s = statistics.median(windows)
    tflops = row["flops_per_token"] * tokens_per_s / 1e12 if row.get("flops_per_token") else None
    full = row.get("flops_per_token_full_square")
    row.update(
        tokens_per_s=tokens_per_s,
        step_s=row["tokens_per_step"] / tokens_per_s,
        tflops=tflops,
        mfu=tflops / peak if (tflops and peak) else None,
        mfu_full_square=full * tokens_per_s / 1e12 / peak if (full and peak) else None,
        mfu_vs_matmul=tflops / roof if (tflops and roof) else None,
        error=None,
    )
