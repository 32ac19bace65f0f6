"""Training-step throughput of diff-X vs transformer-X on one device: tokens/s, TFLOP/s, MFU.

    python benchmarks/train_step.py                                   # GPU: 830M and 1.4B at 2K and 4K, bf16
    python benchmarks/train_step.py --fp8                             # + FP8 (hybrid) linears, needs TE
    python benchmarks/train_step.py --model diff-tiny --device cpu    # CPU smoke run
    python benchmarks/train_step.py --model diff-3b --num-layers 8 --seqs 4096 --profile  # + where time goes

Each model is pretrain_diff.py's `Trainer` on mock data (resolve_args -> RunConfig -> Trainer), and what
is timed is its own `train_step` (the optimizer step with the scheduler, the micro-batches read and
copied as in training), so whatever the Trainer's step does is what the GPU measures. FLOPs are
diffmeg.training.flops.train_flops_per_iteration (model FLOPs: DIFF's core counted at 1.5x the
baseline's, no recompute), so MFU is comparable between the pair; `MFU` counts causal attention as half
the square (ours), `MFU-full` as the full square (Megatron-LM's published convention); the denominator
is the dense peak of diffmeg.training.hardware, the table the training log quotes MFU against. For each
DIFF model its FLOP-matched baseline `transformer-X` is run too; `ratio` = DIFF tokens/s over the
baseline's, next to the equal-efficiency bound (baseline FLOPs / DIFF FLOPs per token). Each row also
carries the peak memory and the memory plan's estimate (diffmeg.training.memory) for the same run; the
peak is the run's own: what earlier runs of the process still hold is subtracted (`resident_gib`), and
`left_gib` is what the run leaves behind (0 when its model and optimizer were freed). On a GPU
megatron-core's fusions are compiled by TorchDynamo, as in pretrain_diff.py (on a CPU diffmeg.runtime
runs them eagerly). The campaign's workers (benchmarks/campaign/worker.py) build their model with
`init_process`, `run_facts` and `build_trainer` and time the Trainer's own step in windows.
Prints a table; never a timed test.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import io
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@dataclass
class StepOptions:
    """How one model is run: batch shape, timing, backend, precision extras, recompute, layer cut."""

    micro_batch_size: int | None = None
    """None: max(1, tokens_per_microbatch // seq)."""
    tokens_per_microbatch: int = 8192
    microbatches: int = 4
    warmup: int = 3
    iters: int = 10
    vocab_size: int | None = None
    """None: the preset's (100288)."""
    diff_attn_backend: str | None = None
    """None: auto. Ignored for Transformer presets."""
    fp8: bool = False
    fp8_recipe: str = "delayed"
    recompute: str | None = None
    """None, "selective" or "full" (full: uniform, one layer per checkpoint)."""
    num_layers: int | None = None
    """Cut the preset to this many layers (a 3B-wide model that fits one GPU)."""
    extra_args: list[str] = field(default_factory=list)
    profile: bool = False
    """After timing, one more step under torch.profiler: `profile` in the result (step_profile.py)."""


def hide_gpu_for_cpu_runs(device: str) -> None:
    """--device cpu: hide the GPUs. Must run before anything queries CUDA (torch caches the device count
    at the first query, so a later CUDA_VISIBLE_DEVICES has no effect)."""
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


def init_process(seed: int = 1234) -> None:
    """One-rank torch.distributed (nccl on GPU, gloo on CPU) and megatron-core's TP=PP=1 state."""
    from diffmeg import runtime

    runtime.single_process(seed)


def close_process() -> None:
    from diffmeg import runtime

    runtime.teardown()


def resolve_run_args(preset: str, seq: int, opts: StepOptions, device: str) -> argparse.Namespace:
    """pretrain_diff.py's resolved arguments for this benchmark run."""
    from diffmeg.training.arguments import resolve_args

    mbs = opts.micro_batch_size or max(1, opts.tokens_per_microbatch // seq)
    argv = ["--model", preset, "--mock-data", "--seq-length", str(seq), "--micro-batch-size", str(mbs)]
    steps = max(100, opts.warmup + opts.iters + 1)  # the schedule outlasts the timed and profiled steps
    argv += ["--global-batch-size", str(mbs * opts.microbatches), "--train-iters", str(steps)]
    argv += ["--max-position-embeddings", str(seq)]
    if opts.vocab_size:
        argv += ["--vocab-size", str(opts.vocab_size)]
    if opts.num_layers:
        argv += ["--num-layers", str(opts.num_layers)]
    if device == "cuda":
        argv += ["--bf16"]
    if opts.fp8:
        argv += ["--fp8-format", "hybrid", "--fp8-recipe", opts.fp8_recipe]
        argv += ["--transformer-impl", "transformer_engine"]
    if opts.recompute == "full":
        argv += ["--recompute-granularity", "full", "--recompute-method", "uniform"]
        argv += ["--recompute-num-layers", "1"]
    elif opts.recompute == "selective":
        argv += ["--recompute-granularity", "selective"]
    if opts.diff_attn_backend and preset.startswith("diff-"):
        argv += ["--diff-attn-backend", opts.diff_attn_backend]
    argv += opts.extra_args
    return resolve_args(argv, world_size=1)


def _reset_peak(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def attention_impl(model: torch.nn.Module) -> str:
    """What attends in the built model: DIFF V1's backend name, else the core attention module's class
    (SDPACoreAttention for the Transformer and DIFF V2 on the local spec, TE's on the TE spec)."""
    for m in model.modules():
        if hasattr(m, "diff_attn_backend"):
            return m.diff_attn_backend
    for m in model.modules():
        core = getattr(m, "core_attention", None)
        if isinstance(core, torch.nn.Module):
            return type(core).__name__
    return "unknown"


def build_trainer(args: argparse.Namespace):
    """pretrain_diff.py's Trainer for the run `args` describes, in training mode and without callbacks (the
    benchmark steps it itself); its start-up lines are not printed, they would break the table."""
    from diffmeg.run_config import RunConfig
    from diffmeg.training.trainer import Trainer

    with contextlib.redirect_stdout(io.StringIO()):
        trainer = Trainer(RunConfig.from_args(args), callbacks=[])
    for chunk in trainer.model:  # the DDP-wrapped model chunks, as Trainer.train sets them
        chunk.train()
    return trainer


def _time_steps(args: argparse.Namespace, opts: StepOptions, device: str) -> dict:
    """{seconds per optimizer step, attention backend, profile (None unless opts.profile)} of the run
    `args` describes."""
    from diffmeg.training.builders import release_training_objects

    trainer = build_trainer(args)
    try:
        return _timed_steps(trainer, opts, device)
    finally:  # the next run in this process must not find this one's weights and optimizer still held
        release_training_objects(trainer.model_config, trainer.model)


def _timed_steps(trainer, opts: StepOptions, device: str) -> dict:
    """Time `opts.iters` of the Trainer's own `train_step` after `opts.warmup`; profile one more."""
    from benchmarks import step_profile

    backend = attention_impl(trainer.model[0])

    def step() -> None:
        trainer.train_step()

    for _ in range(opts.warmup):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(opts.iters):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / max(1, opts.iters)
    profile = step_profile.profile_step(step, device) if opts.profile else None
    return {"seconds": seconds, "backend": backend, "profile": profile}


def time_optimizer_step(optimizer, device: str, warmup: int = 1, iters: int = 5) -> float:
    """Median seconds of one `optimizer.step()` on the gradients it holds (each call updates the weights
    again: the time, not the values, is what counts here)."""
    for _ in range(warmup):
        optimizer.step()
    times = []
    for _ in range(max(1, iters)):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        optimizer.step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def run_facts(preset: str, seq: int, opts: StepOptions, device: str) -> tuple[argparse.Namespace, dict]:
    """The run's resolved arguments and what is known of it before a step: tokens a step, model FLOPs a
    token (causal attention as half the square, and as the full square), the memory plan in GiB."""
    from diffmeg.run_config import RunConfig
    from diffmeg.training.flops import train_flops_per_iteration
    from diffmeg.training.memory import estimate_memory

    args = resolve_run_args(preset, seq, opts, device)
    run = RunConfig.from_args(args)
    tokens = args.global_batch_size * seq
    return args, {
        "tokens_per_step": tokens,
        "flops_per_token": train_flops_per_iteration(run) / tokens,
        "flops_per_token_full_square": train_flops_per_iteration(run, causal=False) / tokens,
        "estimated_gib": estimate_memory(run, on_gpu=device == "cuda").total / 2**30,
    }


def run_one(preset: str, seq: int, opts: StepOptions, device: str) -> dict:
    """Build, warm up, time `opts.iters` optimizer steps. Failures (OOM, a backend that cannot run) are
    returned in `error` with the timing figures None, so a sweep goes on."""
    args, facts = run_facts(preset, seq, opts, device)
    tokens = facts["tokens_per_step"]
    flops, flops_full = facts["flops_per_token"] * tokens, facts["flops_per_token_full_square"] * tokens
    result = {
        "preset": preset,
        "seq": seq,
        "layers": args.num_layers,
        "mbs": args.micro_batch_size,
        "microbatches": opts.microbatches,
        "recompute": opts.recompute,
        "backend": None,
        "tokens_per_s": None,
        "tflops": None,
        "tflops_full_square": None,
        "flops_per_token": facts["flops_per_token"],
        "flops_per_token_full_square": facts["flops_per_token_full_square"],
        "mem_gib": None,
        "estimated_gib": facts["estimated_gib"],
        "resident_gib": None,
        "left_gib": None,
        "profile": None,
        "step_s": None,
        "error": None,
    }
    _reset_peak(device)
    resident = _allocated(device)
    try:
        timed = _time_steps(args, opts, device)
        seconds = timed["seconds"]
        result.update(step_s=seconds, tokens_per_s=tokens / seconds, tflops=flops / seconds / 1e12)
        result["tflops_full_square"] = flops_full / seconds / 1e12
        result.update(backend=timed["backend"], profile=timed["profile"])
        if device == "cuda":
            result["mem_gib"] = (torch.cuda.max_memory_allocated() - resident) / 2**30
    except Exception as exc:  # noqa: BLE001 - every failure is a result here
        oom = isinstance(exc, torch.OutOfMemoryError)
        result["error"] = "OOM" if oom else f"{type(exc).__name__}: {exc}"[:300]
    _reset_peak(device)
    if device == "cuda":
        result["resident_gib"] = resident / 2**30
        result["left_gib"] = (_allocated(device) - resident) / 2**30
    return result


def _allocated(device: str) -> int:
    """Bytes the caching allocator holds for live tensors now. Measured before a run, it is what earlier
    runs of this process still hold, which the run's peak must not be charged with; after it, what the
    run left behind (0 unless something still references its model or optimizer)."""
    return torch.cuda.memory_allocated() if device == "cuda" else 0


def baseline_of(diff_preset: str) -> str | None:
    """The FLOP-matched Transformer of a DIFF (V1 or V2) preset: diff-X / diff2-X -> transformer-X."""
    for prefix in ("diff2-", "diff-"):
        if diff_preset.startswith(prefix):
            return "transformer-" + diff_preset[len(prefix) :]
    return None


def format_header() -> str:
    return (
        f"{'model':18s} {'seq':>5} {'mbs':>3} {'attention':17s} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6}"
        f" {'GFLOP/tok':>9} {'mem GiB':>7} {'est GiB':>7} {'ratio':>6} {'bound':>6}"
    )


def format_row(r: dict, peak: float | None, ratio: str = "", bound: str = "") -> str:
    if r["error"]:
        return f"{r['preset']:18s} {r['seq']:5d} {r['mbs']:3d} {str(r['backend']):17s} {r['error']}"
    mfu = f"{100 * r['tflops'] / peak:5.1f}%" if peak else "  n/a"
    full = f"{100 * r['tflops_full_square'] / peak:5.1f}%" if peak else "  n/a"
    mem = "-" if r["mem_gib"] is None else f"{r['mem_gib']:.1f}"
    return (
        f"{r['preset']:18s} {r['seq']:5d} {r['mbs']:3d} {str(r['backend']):17s}"
        f" {r['tokens_per_s']:10.1f} {r['tflops']:8.3f} {mfu:>6} {full:>8}"
        f" {r['flops_per_token'] / 1e9:9.3f} {mem:>7} {r['estimated_gib']:7.1f} {ratio:>6} {bound:>6}"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model", nargs="+", default=["diff-830m", "diff-1.4b"], help="DIFF presets (baseline added)"
    )
    p.add_argument("--seqs", type=int, nargs="+", default=None, help="default: 2048 4096 (GPU), 256 (CPU)")
    p.add_argument("--device", default=None, choices=["cuda", "cpu"], help="default: cuda when available")
    p.add_argument("--micro-batch-size", type=int, default=None)
    p.add_argument("--tokens-per-microbatch", type=int, default=None, help="default 8192 (GPU), 256 (CPU)")
    p.add_argument("--microbatches", type=int, default=None, help="per step; default 4 (GPU), 1 (CPU)")
    p.add_argument("--num-layers", type=int, default=None, help="cut every preset to this many layers")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--vocab-size", type=int, default=None, help="default: the preset's (100288)")
    p.add_argument("--diff-attn-backend", default=None, help="e.g. sdpa, sdpa_split_v (default: auto)")
    p.add_argument("--fp8", action="store_true", help="FP8 hybrid linears via Transformer Engine (GPU)")
    p.add_argument("--fp8-recipe", default="delayed", choices=["delayed", "tensorwise"])
    p.add_argument("--recompute", choices=["selective", "full"], default=None, help="not counted in MFU")
    p.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU (default: by name)")
    p.add_argument("--profile", action="store_true", help="also where one step's time goes, per row")
    p.add_argument(
        "--optimizer-impl", choices=["auto", "megatron", "fused"], default=None, help="default: auto"
    )
    a = p.parse_args(argv)
    if a.device == "cpu":
        hide_gpu_for_cpu_runs("cpu")  # before the first CUDA query below
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device == "cuda"
    opts = StepOptions(
        micro_batch_size=a.micro_batch_size,
        tokens_per_microbatch=a.tokens_per_microbatch or (8192 if gpu else 256),
        microbatches=a.microbatches or (4 if gpu else 1),
        warmup=a.warmup if a.warmup is not None else (3 if gpu else 1),
        iters=a.iters if a.iters is not None else (10 if gpu else 3),
        vocab_size=a.vocab_size,
        diff_attn_backend=a.diff_attn_backend,
        fp8=a.fp8,
        fp8_recipe=a.fp8_recipe,
        recompute=a.recompute,
        num_layers=a.num_layers,
        profile=a.profile,
        extra_args=["--optimizer-impl", a.optimizer_impl] if a.optimizer_impl else [],
    )
    seqs = a.seqs or ([2048, 4096] if gpu else [256])
    if opts.fp8 and not (gpu and importlib.util.find_spec("transformer_engine")):
        print("note: --fp8 needs a GPU and Transformer Engine; running bf16/fp32 only")
        opts.fp8 = False
    init_process()

    import megatron.core

    from benchmarks import step_profile
    from diffmeg.training import hardware

    name = torch.cuda.get_device_name() if gpu else f"CPU ({platform.processor() or 'x86_64'})"
    precision = "fp8" if opts.fp8 else ("bf16" if gpu else "fp32")
    peak = a.peak_tflops if a.peak_tflops is not None else hardware.peak_tflops(device, precision)
    print(
        f"device: {name}; torch {torch.__version__}; megatron-core {megatron.core.__version__}; "
        f"precision {'fp8-hybrid' if opts.fp8 else precision}; "
        f"threads {torch.get_num_threads()}"
    )
    print(f"peak for MFU: {peak or 'unknown (MFU n/a)'} TFLOP/s; microbatches/step {opts.microbatches}")
    print(format_header())
    print("-" * len(format_header()))
    for diff_preset in a.model:
        pair = [diff_preset] + [b for b in [baseline_of(diff_preset)] if b]
        for seq in seqs:
            results = [run_one(preset, seq, opts, device) for preset in pair]
            for r in results:
                ratio = bound = ""
                if len(results) == 2 and r is results[0] and not any(x["error"] for x in results):
                    ratio = f"{results[0]['tokens_per_s'] / results[1]['tokens_per_s']:.3f}"
                    bound = f"{results[1]['flops_per_token'] / results[0]['flops_per_token']:.3f}"
                print(format_row(r, peak, ratio, bound))
                if r["profile"]:
                    print(f"  {r['preset']} one step: {step_profile.format_share(r['profile'])}")
    close_process()


if __name__ == "__main__":
    main()
