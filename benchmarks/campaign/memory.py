"""Phase `memory`: the pretrain_diff.py save/resume runs (runs.py) and generation from their checkpoints
(generation.py), then the memory plan against torch.cuda.max_memory_allocated."""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from benchmarks.campaign.generation import generation_check
from benchmarks.campaign.part import Part
from benchmarks.campaign.plan import Plan, device_of
from benchmarks.campaign.procs import child_env
from benchmarks.campaign.runs import skipped_run, train_and_resume


def phase_memory(a: argparse.Namespace, part: Part, deadline: float, plan: Plan) -> None:
    import torch

    from benchmarks import train_step

    device = device_of(a)
    work = Path(tempfile.mkdtemp(prefix="campaign-runs-"))
    try:
        for model in plan.run_models:
            if time.monotonic() > deadline:
                part.add("gpu_train_run", skipped_run(model, plan.run_iterations))
                continue
            env = child_env(a)
            env.pop("TORCHDYNAMO_DISABLE", None)  # pretrain_diff.py as users run it
            row = train_and_resume(model, plan, work / model, deadline, env)
            part.add("gpu_train_run", row)
            print(f"gpu_train_run {model}: {row}", flush=True)
        if time.monotonic() < deadline:
            train_step.init_process()
        for i, row in enumerate(part.data.get("gpu_train_run", [])):
            ckpt = work / row["model"] / "ckpt"
            if row["error"] is None and time.monotonic() < deadline:
                gen = generation_check(ckpt, device, plan.gen_tokens)
                row.update(generation_ok=gen["ok"], generation=gen)
                part.data["gpu_train_run"][i] = row
                part.save()
                print(f"generation {row['model']}: {gen}", flush=True)
        layouts = [(plan.memory_diff, r) for r in plan.memory_recompute]
        layouts.append((train_step.baseline_of(plan.memory_diff), None))
        for preset, recompute in layouts:
            size = f"{plan.memory_layers}L s{plan.memory_seq} mbs{plan.memory_mbs}"
            layout = f"{preset} {size} recompute={recompute or 'none'}"
            row = {
                "layout": layout,
                "model": preset,
                "seq": plan.memory_seq,
                "layers": plan.memory_layers,
                "micro_batch_size": plan.memory_mbs,
                "recompute": recompute,
            }
            if time.monotonic() > deadline:
                part.add(
                    "memory",
                    {**row, "estimated_gib": None, "measured_gib": None, "error": "skipped: time budget"},
                )
                continue
            opts = train_step.StepOptions(
                micro_batch_size=plan.memory_mbs,
                microbatches=1,
                warmup=1,
                iters=1,
                vocab_size=plan.vocab_size,
                recompute=recompute,
                num_layers=plan.memory_layers,
            )
            r = train_step.run_one(preset, plan.memory_seq, opts, device)
            part.add(
                "memory",
                {
                    **row,
                    "estimated_gib": r["estimated_gib"],
                    "measured_gib": r["mem_gib"],
                    "resident_gib": r["resident_gib"],
                    "left_gib": r["left_gib"],
                    "error": r["error"],
                },
            )
            print(
                f"memory {layout}: estimated {r['estimated_gib']:.2f} GiB, measured {r['mem_gib']}",
                flush=True,
            )
            if device == "cuda":
                torch.cuda.empty_cache()
        if torch.distributed.is_initialized():
            train_step.close_process()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    skipped = [
        r
        for t in ("memory", "gpu_train_run")
        for r in part.data.get(t, [])
        if r.get("error", "") and str(r["error"]).startswith("skipped")
    ]
    if skipped:
        part.set(_status="partial", _error="some runs skipped: time budget")
