"""Step time while a checkpoint is being written: synchronous saves vs --async-save, in one run.

    python benchmarks/async_save.py                                    # CPU: diff-tiny, 100288 vocabulary
    torchrun --nproc_per_node 8 benchmarks/async_save.py --model diff-3b --mock-data --bf16 \\
        --use-distributed-optimizer --save-dir /lustre/$USER/tmp                  # a GPU node

One training run (pretrain_diff.py's Trainer: its `train_step` and `CheckpointManager`, on mock data) that
saves every --save-interval steps, alternating synchronous saves and --async-save ones, so both meet the
same machine (a shared or noisy host changes speed over minutes: alternating keeps the comparison fair).
A step's time is its wall time from one step's start to the next's, with what the loop does after it:
the poll that finalizes a background save, and a save. Steps that overlap a save:
- sync: the step that saves (it waits for the whole write);
- async: the step that saves (planning, the copy of the tensors into the writer's shared buffer) and every
  following step until the poll after one of them finds every rank's files written and finalizes the save.
Normal steps: all others after --warmup. Prints the normal step time (median) and, per mode, the mean time
of the overlapping steps and its ratio to normal, the process's minor page faults per step, the time the
save call itself took (sync: the whole save; async: planning and the copy) and, for async, the CPU time
of the writer process per save (the work that competes with training for the host's cores). The goal
(async overlapped steps within 1.2x of normal, where sync stalls for the whole write) is reported, never
asserted. The run is an --async-save run (its writer process starts with it, as in training) whose every
other save is made synchronous. Other arguments are pretrain_diff.py's (defaults on CPU: CPU_FLAGS). On CPU
the run uses one thread (torch.set_num_threads(1)), leaving the host's other core to the writer as a GPU
rank leaves its CPU cores.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

GOAL = 1.2
CPU_FLAGS = [
    "--model", "diff-tiny", "--mock-data", "--vocab-size", "100288", "--seq-length", "64",
    "--micro-batch-size", "2", "--global-batch-size", "2", "--lr-warmup-iters", "2", "--eval-iters", "0",
]  # fmt: skip
"""A small network with a large vocabulary: 54M parameters, a 0.6 GB checkpoint (weights and Adam)."""


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--saves", type=int, default=8, help="saves in all, alternating sync and async")
    parser.add_argument("--save-interval", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out")
    parser.add_argument(
        "--save-dir",
        default=None,
        help="where checkpoints go (default: a temporary dir; needed with torchrun)",
    )
    bench, flags = parser.parse_known_args()

    import torch

    from benchmarks import model_flags
    from diffmeg import runtime
    from diffmeg.run_config import RunConfig
    from diffmeg.training.arguments import resolve_args
    from diffmeg.training.trainer import Trainer

    flags, _ = model_flags(flags, CPU_FLAGS)
    steps = bench.warmup + bench.saves * bench.save_interval + 1
    load = os.getloadavg()  # other work on the host: a loaded CPU host gives the writer no free core
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    if ranks > 1 and bench.save_dir is None:
        raise SystemExit("give --save-dir: a directory every rank sees (the file system checkpoints go to)")
    workdir = (
        tempfile.mkdtemp(prefix="async_save_", dir=bench.save_dir)
        if ranks == 1
        else os.path.join(bench.save_dir, "async_save_bench")
    )
    try:
        argv = [*flags, "--train-iters", str(steps + 1), "--save", workdir, "--async-save"]
        trainer = Trainer(RunConfig.from_args(resolve_args(argv)), callbacks=[])
        manager, log = trainer.checkpoints, trainer.log
        manager.log = lambda line: None  # the per-save lines would interleave with the table
        for chunk in trainer.model:  # the model chunks (one, or one per virtual pipeline stage)
            chunk.train()
        times: list[float] = []
        faults: list[int] = []  # minor page faults of this process per step
        in_save: dict[str, list[float]] = {"sync": [], "async": []}  # seconds in manager.save
        writer_cpu: list[tuple[float, float]] = []  # (user, system) CPU seconds of the writer per async save
        writer, writer_start = None, (0.0, 0.0)
        overlaps: dict[str, set[int]] = {"sync": set(), "async": set()}
        background: int | None = None  # the step that started the pending async save
        saved = 0
        for step in range(steps):
            start, start_faults = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            trainer.train_step()
            if background is not None:
                overlaps["async"].add(step)
                manager.poll()
                if manager.pending is None:
                    background = None
                    writer_cpu.append(_cpu_since(writer, writer_start))
            if step >= bench.warmup and (step - bench.warmup + 1) % bench.save_interval == 0:
                mode = "sync" if saved % 2 == 0 else "async"
                manager.config.async_save = mode == "async"
                if mode == "async":
                    writer = _only_child()  # started with the run (a new one if it died)
                    writer_start = _cpu_since(writer)
                save_start = time.perf_counter()
                manager.save(step, 0, trainer.model, trainer.optimizer, trainer.scheduler)
                in_save[mode].append(time.perf_counter() - save_start)
                overlaps[mode].add(step)
                background = step if mode == "async" else None
                saved += 1
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start_faults)
        manager.wait()
        if background is not None:
            writer_cpu.append(_cpu_since(writer, writer_start))
        manager.close()
    finally:
        if int(os.environ.get("RANK", "0")) == 0:
            shutil.rmtree(workdir, ignore_errors=True)

    busy = overlaps["sync"] | overlaps["async"]
    quiet = [i for i in range(bench.warmup, steps) if i not in busy]
    normal = statistics.median(times[i] for i in quiet)
    log(f"{' '.join(flags)}: {steps} steps, {saves_line(bench)}")
    log(f"host: {os.cpu_count()} CPUs, load average {load[0]:.1f} at start, {os.getloadavg()[0]:.1f} at end")
    normal_faults = statistics.median(faults[i] for i in quiet)
    log(
        f"normal step: {normal * 1000:.0f} ms, {normal_faults / 1000:.0f}K page faults "
        f"(medians of {len(quiet)} steps)"
    )
    log(
        f"{'mode':<6} {'saves':>5} {'overlapped steps':>17} {'mean ms':>8} {'ratio':>6} {'faults':>7}"
        f" {'in save()':>10}   per save (ms)"
    )
    ratios = {}
    for mode in ("sync", "async"):
        over = sorted(overlaps[mode])
        mean = statistics.mean(times[i] for i in over)
        ratios[mode] = mean / normal
        per_save = _per_save(over, times)
        over_faults = statistics.mean(faults[i] for i in over) / 1000
        log(
            f"{mode:<6} {bench.saves // 2 + (mode == 'sync') * (bench.saves % 2):>5} {len(over):>17} "
            f"{mean * 1000:>8.0f} {ratios[mode]:>5.2f}x {over_faults:>6.0f}K "
            f"{statistics.mean(in_save[mode]) * 1000:>7.0f} ms   {per_save}"
        )
    calls = " | ".join(f"{t * 1000:.0f}" for t in in_save["async"])
    log(f"async save() calls (ms): {calls} (planning, the copy into the buffer; the first allocates it)")
    if writer_cpu:
        user, system = (statistics.mean(t[i] for t in writer_cpu) for i in (0, 1))
        log(
            f"writer process: {user + system:.2f} s CPU per async save ({user:.2f} s user, "
            f"{system:.2f} s system)"
        )
    verdict = "met" if ratios["async"] <= GOAL else "not met"
    log(
        f"goal: async overlapped steps within {GOAL}x of normal: {verdict} ({ratios['async']:.2f}x; "
        f"sync: {ratios['sync']:.2f}x)"
    )
    runtime.teardown()
    return 0


def _only_child():
    """The writer process: the one child of this process (psutil, a megatron-core requirement)."""
    import psutil

    (child,) = psutil.Process().children()
    return child


def _cpu_since(process, start: tuple[float, float] = (0.0, 0.0)) -> tuple[float, float]:
    """(user, system) CPU seconds of `process` since `start`."""
    times = process.cpu_times()
    return times.user - start[0], times.system - start[1]


def saves_line(bench: argparse.Namespace) -> str:
    return f"a save every {bench.save_interval} after {bench.warmup} warmup steps, sync and async in turn"


def _per_save(steps: list[int], times: list[float]) -> str:
    """The overlapped steps of each save, grouped where consecutive: '1234+980 | 2211'."""
    groups: list[list[int]] = []
    for step in steps:
        if groups and step == groups[-1][-1] + 1:
            groups[-1].append(step)
        else:
            groups.append([step])
    return " | ".join("+".join(f"{times[i] * 1000:.0f}" for i in g) for g in groups)


if __name__ == "__main__":
    sys.exit(main())
