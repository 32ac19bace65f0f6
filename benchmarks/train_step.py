"""Training-step throughput of diff-X vs transformer-X on one device: tokens/s, TFLOP/s, MFU.

    python benchmarks/train_step.py                                   # GPU: 830M and 1.4B at 2K and 4K, bf16
    python benchmarks/train_step.py --fp8                             # + FP8 (hybrid) linears, needs TE
    python benchmarks/train_step.py --model diff-tiny --device cpu    # CPU smoke run

Models, optimizer and the step come from diffmeg itself (resolve_args -> build_training_objects ->
megatron-core's forward/backward schedule -> optimizer.step), on mock tokens, as pretrain_diff.py runs
them. FLOPs are diffmeg.training.flops.train_flops_per_iteration (model FLOPs: DIFF's core counted at
1.5x the baseline's, no recompute), so MFU is comparable between the pair. For each DIFF model its
FLOP-matched baseline `transformer-X` is run too; `ratio` = DIFF tokens/s over the baseline's, next to
the equal-efficiency bound (baseline FLOPs / DIFF FLOPs per token). Prints a table; never a timed test.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

# Dense peak TFLOP/s (no sparsity) per device-name fragment: (bf16, fp8).
PEAK_TFLOPS = {
    "H100 SXM": (989.4, 1978.9),
    "H100 80GB HBM3": (989.4, 1978.9),
    "H100 NVL": (835.0, 1670.0),
    "H100 PCIe": (756.0, 1513.0),
    "H200": (989.4, 1978.9),
    "A100": (312.0, None),
}


def peak_tflops(fp8: bool, override: float | None) -> float | None:
    if override is not None:
        return override
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    for key, (bf16, f8) in PEAK_TFLOPS.items():
        if key in name:
            return f8 if fp8 else bf16
    return None


def _mock_batches(n: int, mbs: int, seq: int, vocab: int, device: str):
    gen = torch.Generator().manual_seed(0)
    for _ in range(n):
        tokens = torch.randint(0, vocab, (mbs, seq + 1), generator=gen)
        yield {
            "tokens": tokens[:, :-1].to(device),
            "labels": tokens[:, 1:].to(device),
            "loss_mask": torch.ones(mbs, seq, device=device),
            "position_ids": torch.arange(seq, device=device).expand(mbs, seq),
        }


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    out = model(
        input_ids=batch["tokens"],
        position_ids=batch["position_ids"],
        attention_mask=None,
        labels=batch["labels"],
    )

    def loss_func(per_token_loss: torch.Tensor):
        loss = (per_token_loss.float() * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
        return loss, {"lm loss": loss.detach().clone()}

    return out, loss_func


def run_one(preset: str, seq: int, a: argparse.Namespace, device: str) -> dict:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from diffmeg.training.arguments import resolve_args
    from diffmeg.training.builders import build_training_objects
    from diffmeg.training.flops import train_flops_per_iteration

    mbs = a.micro_batch_size or max(1, a.tokens_per_microbatch // seq)
    argv = ["--model", preset, "--mock-data", "--seq-length", str(seq), "--micro-batch-size", str(mbs)]
    argv += ["--global-batch-size", str(mbs * a.microbatches), "--train-iters", "100"]
    argv += ["--max-position-embeddings", str(seq)]
    if a.vocab_size:
        argv += ["--vocab-size", str(a.vocab_size)]
    if device == "cuda":
        argv += ["--bf16"]
    if a.fp8:
        argv += [
            "--fp8-format",
            "hybrid",
            "--fp8-recipe",
            a.fp8_recipe,
            "--transformer-impl",
            "transformer_engine",
        ]
    if a.recompute:
        argv += [
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "uniform",
            "--recompute-num-layers",
            "1",
        ]
    args = resolve_args(argv)
    if a.diff_attn_backend:
        args.diff_attn_backend = a.diff_attn_backend  # set after parsing: any backend the registry knows
    config, model, optimizer, _ = build_training_objects(args)
    backend = next((m.backend_name for m in model.modules() if hasattr(m, "backend_name")), "megatron-core")
    fwd_bwd = get_forward_backward_func()

    def step():
        model.zero_grad_buffer()
        optimizer.zero_grad()
        fwd_bwd(
            forward_step_func=_forward_step,
            data_iterator=_mock_batches(a.microbatches, mbs, seq, args.vocab_size, device),
            model=[model],
            num_microbatches=a.microbatches,
            seq_length=seq,
            micro_batch_size=mbs,
            forward_only=False,
        )
        optimizer.step()

    try:
        for _ in range(a.warmup):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(a.iters):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / a.iters
        mem = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    except torch.OutOfMemoryError:
        seconds, mem = float("inf"), float("inf")
    flops = train_flops_per_iteration(args)
    tokens = args.global_batch_size * seq
    result = {
        "preset": preset,
        "seq": seq,
        "mbs": mbs,
        "backend": backend if args.diff_attention else "megatron-core",
        "tokens_per_s": tokens / seconds,
        "tflops": flops / seconds / 1e12,
        "flops_per_token": flops / tokens,
        "mem_gib": mem,
        "step_s": seconds,
    }
    return result


def _mem(gib: float) -> str:
    return "-" if gib != gib else f"{gib:.1f}"  # nan on CPU


def _release(device: str) -> None:
    """Free the previous model's memory before the next one is built."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model", nargs="+", default=["diff-830m", "diff-1.4b"], help="DIFF presets (baseline added)"
    )
    p.add_argument("--seqs", type=int, nargs="+", default=None, help="default: 2048 4096 (GPU), 256 (CPU)")
    p.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"]
    )
    p.add_argument("--micro-batch-size", type=int, default=None)
    p.add_argument("--tokens-per-microbatch", type=int, default=None, help="default 8192 (GPU), 256 (CPU)")
    p.add_argument("--microbatches", type=int, default=None, help="per step; default 4 (GPU), 1 (CPU)")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--vocab-size", type=int, default=None, help="default: the preset's (100288)")
    p.add_argument("--diff-attn-backend", default=None, help="e.g. sdpa, flash, triton (default: auto)")
    p.add_argument("--fp8", action="store_true", help="FP8 hybrid linears via Transformer Engine (GPU)")
    p.add_argument("--fp8-recipe", default="delayed", choices=["delayed", "tensorwise"])
    p.add_argument("--recompute", action="store_true", help="full activation recompute (not counted in MFU)")
    p.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU (default: by name)")
    a = p.parse_args(argv)
    device = a.device
    gpu = device == "cuda"
    a.seqs = a.seqs or ([2048, 4096] if gpu else [256])
    a.tokens_per_microbatch = a.tokens_per_microbatch or (8192 if gpu else 256)
    a.microbatches = a.microbatches or (4 if gpu else 1)
    a.warmup = a.warmup if a.warmup is not None else (3 if gpu else 1)
    a.iters = a.iters if a.iters is not None else (10 if gpu else 3)
    if a.fp8 and not (gpu and importlib.util.find_spec("transformer_engine")):
        print("note: --fp8 needs a GPU and Transformer Engine; running bf16/fp32 only")
        a.fp8 = False
    if not gpu:
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

    from megatron.core import parallel_state

    from diffmeg.compat import apply_cpu_compat, model_parallel_manual_seed
    from diffmeg.training.distributed import initialize_distributed

    initialize_distributed("nccl" if gpu else "gloo")
    apply_cpu_compat()
    parallel_state.initialize_model_parallel()
    model_parallel_manual_seed(1234)

    import megatron.core

    name = torch.cuda.get_device_name() if gpu else f"CPU ({platform.processor() or 'x86_64'})"
    peak = peak_tflops(a.fp8, a.peak_tflops)
    print(
        f"device: {name}; torch {torch.__version__}; megatron-core {megatron.core.__version__}; "
        f"precision {'fp8-hybrid' if a.fp8 else ('bf16' if gpu else 'fp32')}; "
        f"threads {torch.get_num_threads()}"
    )
    print(
        f"peak for MFU: {peak if peak else 'unknown (MFU n/a)'} TFLOP/s; microbatches/step {a.microbatches}"
    )
    header = (
        f"{'model':18s} {'seq':>5} {'mbs':>3} {'attn backend':14s} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6}"
        f" {'GFLOP/tok':>9} {'mem GiB':>7} {'ratio':>6} {'bound':>6}"
    )
    print(header)
    print("-" * len(header))
    for diff_preset in a.model:
        pair = [diff_preset]
        if diff_preset.startswith("diff-"):
            pair.append("transformer-" + diff_preset[len("diff-") :])
        for seq in a.seqs:
            results = []
            for preset in pair:
                results.append(run_one(preset, seq, a, device))
                _release(device)
            for r in results:
                mfu = f"{100 * r['tflops'] / peak:5.1f}%" if peak else "  n/a"
                ratio = bound = ""
                if len(results) == 2 and r is results[0]:
                    ratio = f"{results[0]['tokens_per_s'] / results[1]['tokens_per_s']:.3f}"
                    bound = f"{results[1]['flops_per_token'] / results[0]['flops_per_token']:.3f}"
                print(
                    f"{r['preset']:18s} {r['seq']:5d} {r['mbs']:3d} {r['backend']:14s}"
                    f" {r['tokens_per_s']:10.1f} {r['tflops']:8.3f} {mfu:>6}"
                    f" {r['flops_per_token'] / 1e9:9.3f} {_mem(r['mem_gib']):>7} {ratio:>6} {bound:>6}"
                )
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
