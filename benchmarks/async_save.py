"""Step time while a checkpoint is being written: synchronous saves vs --async-save, in one run.

    python benchmarks/async_save.py                                 # CPU: diff-tiny with a 100288 vocabulary
    python benchmarks/async_save.py --nproc 8 --model diff-3b --bf16 --use-distributed-optimizer ...  # GPU

Runs pretrain_diff.py twice with the same flags (mock data, --log-interval 1, a save every --save-interval
steps), once with synchronous saves and once with --async-save, and reads every step's time from its
--metrics-file. A step's time runs from one logged step to the next, so a synchronous save's whole write
lands in the step after it. Steps that overlap a save:
- sync: the step after each save (it waits for the whole write);
- async: every step from the save until the step that finalized it (the "saved checkpoint ... written in
  the background" line comes at that step's end): the host copy of the tensors, then steps that run beside
  the background write.
Normal steps: all others after the first --warmup steps; the last save (end of training) is left out, no
step follows it. Prints one row per mode: the normal and the overlapped step times and their ratio. The
goal (async overlapped steps within 1.2x of normal, where sync stalls for the whole write) is reported,
never asserted. On CPU the training gets one thread (OMP_NUM_THREADS=1, as each GPU rank would leave the
host's other cores to the writer).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOAL = 1.2

CPU_DEFAULTS = [
    "--model", "diff-tiny", "--mock-data", "--vocab-size", "100288", "--seq-length", "64",
    "--micro-batch-size", "2", "--global-batch-size", "2", "--lr-warmup-iters", "2", "--eval-iters", "0",
]  # fmt: skip
"""A small network with a large vocabulary: 53M parameters, a 0.6 GB checkpoint (weights and Adam)."""


@dataclass
class Result:
    mode: str
    normal_ms: float
    overlapped_ms: list[float]
    saves: int
    save_s: list[float]
    """sync: the overlapped step minus a normal one; async: the background write until finalized."""

    @property
    def ratio(self) -> float:
        return statistics.mean(self.overlapped_ms) / self.normal_ms


def run(mode: str, flags: list[str], args: argparse.Namespace, workdir: Path) -> Result:
    """One pretrain_diff.py run; its step times split into normal and save-overlapping ones."""
    ckpt, metrics = workdir / f"ckpt_{mode}", workdir / f"{mode}.jsonl"
    argv = [
        *flags,
        "--train-iters", str(args.train_iters), "--save-interval", str(args.save_interval),
        "--log-interval", "1", "--save", str(ckpt), "--metrics-file", str(metrics),
    ]  # fmt: skip
    if mode == "async":
        argv.append("--async-save")
    script = [str(ROOT / "pretrain_diff.py"), *argv]
    cmd = (
        [sys.executable, *script]
        if args.nproc == 1
        else [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}"]
        + script
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT), TORCHDYNAMO_DISABLE="1", PYTHONUNBUFFERED="1")
    if args.cpu:
        env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        raise SystemExit(f"{mode} run failed ({proc.returncode}):\n{tail}")
    steps = {r["iteration"]: r["elapsed_ms"] for r in map(json.loads, metrics.read_text().splitlines())}
    saves = list(range(args.save_interval, args.train_iters, args.save_interval))  # not the final one
    overlapped: dict[int, list[int]] = {}
    if mode == "sync":
        overlapped = {s: [s + 1] for s in saves}
    else:
        # The finalize line of save s is printed inside the step that finalized it, before its log line.
        finalized_at: dict[int, int] = {}
        last = 0
        for line in proc.stdout.splitlines():
            step = re.match(r" \[.*\] iteration +(\d+)/", line)
            if step:
                last = int(step.group(1))
            done = re.match(r" saved checkpoint at iteration (\d+) .*in the background", line)
            if done:
                finalized_at[int(done.group(1))] = last + 1
        overlapped = {s: list(range(s + 1, finalized_at[s] + 1)) for s in saves}
    busy = {it for its in overlapped.values() for it in its}
    normal = [ms for it, ms in steps.items() if it > args.warmup and it not in busy]
    normal_ms = statistics.median(normal)
    over = [steps[it] for it in sorted(busy) if it in steps]
    if mode == "sync":
        save_s = [(steps[s + 1] - normal_ms) / 1000 for s in saves]
    else:
        done = re.finditer(r"saved checkpoint at iteration (\d+) .*background in ([\d.]+) s", proc.stdout)
        save_s = [float(m.group(2)) for m in done if int(m.group(1)) in saves]
    return Result(mode, normal_ms, over, len(saves), save_s)


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--nproc", type=int, default=1, help="ranks (torchrun) per run")
    parser.add_argument("--train-iters", type=int, default=24)
    parser.add_argument("--save-interval", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the normal time")
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary dir)")
    args, flags = parser.parse_known_args()
    import torch

    args.cpu = not torch.cuda.is_available()
    flags = flags or (CPU_DEFAULTS if args.cpu else [])
    if not flags:
        raise SystemExit("give the pretrain_diff.py flags of the model to time (on GPU there is no default)")
    workdir = Path(tempfile.mkdtemp(prefix="async_save_", dir=args.dir))
    try:
        results = [run(mode, flags, args, workdir) for mode in ("sync", "async")]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"pretrain_diff.py {' '.join(flags)}; {args.train_iters} steps, a save every {args.save_interval}")
    print(f"{'mode':<6} {'saves':>5} {'normal step ms':>15} {'overlapped steps':>17} {'overlapped ms':>14} "
          f"{'ratio':>6} {'save s (each)':>14}")  # fmt: skip
    for r in results:
        saves = ", ".join(f"{s:.1f}" for s in r.save_s)
        print(
            f"{r.mode:<6} {r.saves:>5} {r.normal_ms:>15.0f} {len(r.overlapped_ms):>17} "
            f"{statistics.mean(r.overlapped_ms):>14.0f} {r.ratio:>5.2f}x {saves:>14}"
        )
    sync, asyn = results
    verdict = "met" if asyn.ratio <= GOAL else "not met"
    print(
        f"goal: async overlapped steps within {GOAL}x of normal: {verdict} ({asyn.ratio:.2f}x; sync stalls "
        f"{sync.ratio:.2f}x for one step per save)"
    )


if __name__ == "__main__":
    main()
