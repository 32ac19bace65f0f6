"""The optimizer step on its own: megatron-core's against the fused one (`--optimizer-impl`), per model.

    python -m benchmarks.optimizer_step                                        # GPU: diff-3b cut to 8 layers
    python -m benchmarks.optimizer_step --model diff-tiny --device cpu         # CPU smoke run

Each row builds pretrain_diff.py's Trainer (benchmarks/train_step.py), runs one training step so every
gradient and optimizer state exists, then times `optimizer.step()` alone (grad norm, clip, AdamW, the
main-to-model copy) over `--iters` calls after `--warmup` (train_step.time_optimizer_step). The step is
what a data-parallel run with the distributed optimizer shards. Prints a table; never a timed test.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

IMPLS = ("megatron", "fused")


def run_one(preset: str, impl: str, seq: int, opts, device: str) -> dict:
    """{preset, impl, layers, params, step_ms, error} of one model's optimizer step with `impl`."""
    from benchmarks import train_step
    from diffmeg.training.builders import release_training_objects

    opts = dataclasses.replace(opts, extra_args=[*opts.extra_args, "--optimizer-impl", impl])
    args = train_step.resolve_run_args(preset, seq, opts, device)
    row = {"preset": preset, "impl": impl, "layers": args.num_layers, "params": None, "step_ms": None}
    row["error"] = None
    try:
        trainer = train_step.build_trainer(args)
        try:
            row["params"] = sum(p.numel() for chunk in trainer.model for p in chunk.parameters())
            trainer.train_step()
            seconds = train_step.time_optimizer_step(trainer.optimizer, device, opts.warmup, opts.iters)
            row["step_ms"] = 1e3 * seconds
        finally:
            release_training_objects(trainer.model_config, trainer.model)
    except Exception as exc:  # noqa: BLE001 - every failure is a result here
        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
    return row


def main(argv: list[str] | None = None) -> None:
    from benchmarks import train_step

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", nargs="+", default=None, help="default: diff-3b (GPU), diff-tiny (CPU)")
    p.add_argument("--device", default=None, choices=["cuda", "cpu"], help="default: cuda when available")
    p.add_argument("--num-layers", type=int, default=None, help="default: 8 (GPU), the preset's (CPU)")
    p.add_argument("--seq", type=int, default=None, help="default: 4096 (GPU), 64 (CPU)")
    p.add_argument("--vocab-size", type=int, default=None, help="default: the preset's")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    a = p.parse_args(argv)
    train_step.hide_gpu_for_cpu_runs(a.device or "")
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device == "cuda"
    train_step.init_process()
    print(f"{'model':18s} {'impl':9s} {'layers':>6} {'params':>12} {'step ms':>9} {'vs megatron':>11}")
    for preset in a.model or (["diff-3b"] if gpu else ["diff-tiny"]):
        rows = []
        for impl in IMPLS:
            seq = a.seq or (4096 if gpu else 64)
            opts = train_step.StepOptions(
                tokens_per_microbatch=seq, microbatches=1, warmup=a.warmup, iters=a.iters,
                vocab_size=a.vocab_size, num_layers=a.num_layers or (8 if gpu else None),
            )  # fmt: skip
            rows.append(run_one(preset, impl, seq, opts, device))
        base = rows[0]["step_ms"]
        for r in rows:
            if r["error"]:
                print(f"{r['preset']:18s} {r['impl']:9s} {r['error']}")
                continue
            vs = f"{base / r['step_ms']:.2f}x" if base else "-"
            figures = f"{r['layers']:6d} {r['params']:12d} {r['step_ms']:9.2f} {vs:>11}"
            print(f"{r['preset']:18s} {r['impl']:9s} {figures}")
    train_step.close_process()


if __name__ == "__main__":
    main()
