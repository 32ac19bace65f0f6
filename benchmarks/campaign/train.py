"""Phase `train`: tokens/s and MFU of a 3B-wide model cut to what fits; levers; DIFF against the Transformer.

Each model variant is pretrain_diff.py's Trainer on mock data in a worker process of its own
(benchmarks/campaign/worker.py), built once and timed by its own `Trainer.train_step` in windows, with
megatron-core's fusions compiled by TorchDynamo on a GPU (the runner leaves it on for this phase there).
What runs, in what order, is the plan (benchmarks/campaign/train_plan.py): comparisons of two variants
whose windows are interleaved (benchmarks/campaign/interleave.py), each giving a `levers` row (the gain,
median over median, and both twins' windows) and each variant a `train` row (the median of its windows:
tokens/s, MFU against the GPU's dense bf16 peak, `mfu`, the field's definition, which the 45% goal uses;
against the matmul rate the env phase measured, `mfu_vs_matmul`; with attention counted as the full square,
`mfu_full_square`, Megatron-LM's convention). The layer count is the largest of `Plan.train_layers` at
which the two largest models of a comparison fit 85% of the GPU by the memory plan. A train phase
continued from an earlier file (`--continue`) skips the comparisons that file measured.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from benchmarks.campaign.estimate import Rate, device_time_line, rate_from, simulate
from benchmarks.campaign.interleave import Bench
from benchmarks.campaign.part import Part
from benchmarks.campaign.plan import LENT_CONTINUE_S, LENT_GPU_S, Plan, device_of
from benchmarks.campaign.procs import REPO
from benchmarks.campaign.resume import measured_comparisons
from benchmarks.campaign.train_plan import Comparison, Variant, comparisons
from benchmarks.campaign.worker import Worker

RESULTS = REPO / "benchmarks" / "results"
FIT_SHARE = 0.85
"""Of the GPU's memory, what two models' memory plans may take together."""


def phase_train(a: argparse.Namespace, part: Part, deadline: float, plan: Plan) -> None:
    device = device_of(a)
    gpu_gib = getattr(a, "gpu_gib", None)
    if device == "cuda" and not gpu_gib:  # the env phase did not say (it failed): ask CUDA here
        import torch

        gpu_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    layers = fit_layers(plan, gpu_gib if device == "cuda" else None)
    compiled = os.environ.get("TORCHDYNAMO_DISABLE", "0") != "1"
    print(
        f"train phase: {layers} layers; TorchDynamo (megatron-core's fusions compiled): {compiled}",
        flush=True,
    )
    todo = comparisons(plan)
    done: set[str] = set()
    if getattr(a, "continue_from", None):  # the runner passes it on only for the same GPU
        from benchmarks.campaign import schema

        earlier = Path(a.continue_from)
        done = measured_comparisons(schema.read(earlier)["levers"]) & {c.name for c in todo}
        print(
            f"--continue {earlier.name}: {len(done)} comparisons measured there are not timed again",
            flush=True,
        )
    part.set(_reused=len(done))
    env = dict(os.environ)

    def spec(v: Variant) -> dict:
        return {"preset": v.model, "seq": v.seq, "flags": list(v.flags), "layers": layers, "device": device,
                "tokens_per_microbatch": plan.train_tokens_per_microbatch,
                "microbatches": plan.train_microbatches, "vocab_size": plan.vocab_size}  # fmt: skip

    def row_of(v: Variant, facts: dict) -> dict:
        return variant_row(v, facts, layers, plan.train_microbatches, compiled)

    bench = Bench(
        lambda: Worker(env), spec, row_of, part, deadline, plan.train_window_steps, plan.train_windows,
        plan.train_warmup_steps, rate=rate_from(RESULTS) if device == "cuda" else None,
        mfu_of=(a.peak, a.roof) if device == "cuda" else (None, None),
    )  # fmt: skip
    bench.run(todo, done)


def variant_row(v: Variant, facts: dict, layers: int, microbatches: int, compiled: bool) -> dict:
    """A variant's `train` row before its windows (`interleave.update_row` fills in the figures)."""
    return {
        "model": v.model, "impl": v.label, "arch": v.arch, "seq": v.seq,
        "variant": None if v.label in ("defaults", "fast path") else v.label, "flags": list(v.flags),
        "layers": facts.get("layers", layers), "microbatches": facts.get("microbatches", microbatches),
        "micro_batch_size": facts.get("micro_batch_size"), "torch_compile": compiled,
        "backend": facts.get("backend"), "tokens_per_step": facts.get("tokens_per_step"),
        "flops_per_token": facts.get("flops_per_token"),
        "flops_per_token_full_square": facts.get("flops_per_token_full_square"),
        "estimated_gib": facts.get("estimated_gib"), "mem_gib": None, "windows": [], "warmup_windows": [],
        "window_steps": None, "build_s": None, "tokens_per_s": None, "step_s": None, "tflops": None,
        "mfu": None, "mfu_full_square": None, "mfu_vs_matmul": None, "profile": None, "profiled": False,
        "error": "unfinished: no timed window yet",
    }  # fmt: skip


def fit_layers(plan: Plan, gpu_gib: float | None) -> int:
    """The most layers (of `plan.train_layers`) at which two of the plan's largest models, by the memory plan
    at its longest length, fit 85% of a GPU of `gpu_gib`; on a CPU (None) the plan's last."""
    if gpu_gib is None:
        return plan.train_layers[-1]
    from benchmarks import train_step

    for layers in plan.train_layers:
        opts = train_step.StepOptions(
            tokens_per_microbatch=plan.train_tokens_per_microbatch,
            microbatches=plan.train_microbatches,
            num_layers=layers,
        )
        need = max(
            train_step.run_facts(p, max(plan.train_seqs), opts, "cuda")[1]["estimated_gib"]
            for p in plan.train_models
        )
        if 2 * need <= FIT_SHARE * gpu_gib:
            return layers
    return plan.train_layers[-1]


def plan_lines(plan: Plan, results: Path, smoke: bool) -> list[str]:
    """`--plan`: the train phase's comparisons in order, and on the GPU plan where each runs in docs/gpu.md's
    two commands and the device time they take, at the rate of the newest GPU results file (last line)."""
    todo = comparisons(plan)
    rate = None if smoke else rate_from(results)
    gpu_gib = _newest_gpu_gib(results) if not smoke else None
    layers = fit_layers(plan, gpu_gib)
    where = f"two fit 85% of {gpu_gib:.1f} GiB, the newest GPU file's" if gpu_gib else "the plan's"
    out = [
        f"train phase, {'smoke' if smoke else 'GPU'} plan: {len(todo)} comparisons, {layers} layers ({where})"
    ]
    if rate is None:
        out += [f"  {i:3d} {_describe(c)}" for i, c in enumerate(todo, start=1)]
        return out + ([] if smoke else ["no finished GPU train phase under benchmarks/results/: no estimate"])
    placed, totals = simulate(
        todo, rate, (LENT_GPU_S, LENT_CONTINUE_S), plan.train_window_steps, plan.train_windows
    )
    for i, p in enumerate(placed, start=1):
        where = f"cmd {p.command}" if p.command else "later"
        cost = f"{p.seconds:5.0f} s, {p.builds} built" if p.command else "             "
        out.append(f"  {i:3d} {where:6s} {cost}  {_describe(p.comparison)}")
    later = sum(1 for p in placed if p.command is None)
    out += _rate_lines(rate, plan, totals, later)
    return [*out, device_time_line(totals)]


def _describe(c: Comparison) -> str:
    return c.name if c.kind == "ratio" else f"{c.name}: {c.on.label} against {c.off.label}"


def _rate_lines(rate: Rate, plan: Plan, totals: list[float], later: int) -> list[str]:
    steps = ", ".join(f"{rate.step_s[s]:.2f} s at {s}" for s in sorted(rate.step_s, reverse=True))
    commands = " + ".join(f"{t:.0f}" for t in totals)
    return [
        f"rate: benchmarks/results/{rate.source}: {rate.how}; a step {steps} (slowest model)",
        f"a comparison: its builds at {rate.build_s:.1f} s + {2 * plan.train_windows} windows of "
        f"{plan.train_window_steps} steps; each command {rate.command_s:.0f} s of install and env phase",
        f"commands (--lent-gpu, then --lent-gpu --continue): {LENT_GPU_S} and {LENT_CONTINUE_S} s at most, "
        f"estimated {commands} s; {later} comparisons left for a later --continue",
    ]


def _newest_gpu_gib(results: Path) -> float | None:
    """The GPU memory (GiB) the newest GPU results file's env phase read."""
    from benchmarks.campaign import schema

    for path in sorted(results.glob("campaign-*.json"), reverse=True):
        try:
            r = schema.read(path)
        except ValueError:
            continue
        if r["device_type"] == "cuda" and (r.get("machine") or {}).get("gpu_memory_gib"):
            return r["machine"]["gpu_memory_gib"]
    return None
