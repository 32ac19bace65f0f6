"""Peak memory of the training loss (output projection + cross entropy, forward and backward) on the CPU:
megatron-core's loss over the whole logits against diffmeg's chunked loss (`--cross-entropy-chunk-size`).

    python benchmarks/loss_memory.py                              # 8192 tokens x 100288 vocabulary, bf16
    python benchmarks/loss_memory.py --dtype fp32 --chunk-size 512 2048

Each variant runs in a fresh process that builds the hidden states, the output weight and the labels,
resets the kernel's peak-RSS mark (/proc/self/clear_refs), runs forward and backward once and reads the
peak (VmHWM) back: the figure is what the loss added on top of its inputs, gradients included, as the
operating system saw it (torch's CPU allocations are invisible to tracemalloc). glibc's mmap threshold
is pinned (MALLOC_MMAP_THRESHOLD_) so that freed tensors leave the process at once. "whole" is what
GPTModel does at TP 1: the output GEMM, then megatron-core's vocab_parallel_cross_entropy; "chunked"
is diffmeg.fusions.cross_entropy.linear_cross_entropy. Each row also shows the memory plan's figure for
the same shape (diffmeg.training.memory.loss_peak_bytes). Prints a table; never a timed test.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

MIB = 2**20


def _status(field: str) -> int:
    """VmRSS / VmHWM of this process in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status (this benchmark needs Linux)")


def _loss_step(variant: str, hidden, weight, labels, chunk_size: int | None) -> float:
    """One forward and backward of the loss; returns the summed loss."""
    import torch
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from diffmeg.fusions.cross_entropy import linear_cross_entropy

    if variant == "whole":
        logits = torch.matmul(hidden, weight.t())  # [s, b, V]: GPTModel's output layer at TP 1
        loss = vocab_parallel_cross_entropy(logits, labels.t().contiguous()).t()  # [b, s]
        del logits
    else:
        loss = linear_cross_entropy(hidden, weight, labels, chunk_size)
    loss.sum().backward()
    return loss.detach().sum().item()


def child(args: argparse.Namespace) -> dict:
    """Measure one variant in this (fresh) process."""
    import torch

    from diffmeg import runtime

    runtime.single_process()
    torch.manual_seed(0)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    vocab, h = args.vocab_size, args.hidden_size
    small = torch.randn(64, 1, h, dtype=dtype, requires_grad=True)  # warm-up: libraries, thread pools
    _loss_step(
        args.variant,
        small,
        torch.randn(vocab, h, dtype=dtype, requires_grad=True),
        torch.randint(0, vocab, (1, 64)),
        args.chunk_size,
    )
    del small
    hidden = (0.5 * torch.randn(args.tokens, 1, h)).to(dtype).requires_grad_(True)  # [s, b, H]
    weight = (0.05 * torch.randn(vocab, h)).to(dtype).requires_grad_(True)  # [V, H]
    labels = torch.randint(0, vocab, (1, args.tokens))  # [b, s]
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = _status("VmRSS")
    start = time.perf_counter()
    total = _loss_step(args.variant, hidden, weight, labels, args.chunk_size)
    seconds = time.perf_counter() - start
    peak = _status("VmHWM") - before
    return {
        "variant": args.variant,
        "chunk_size": args.chunk_size,
        "peak_mib": peak / MIB,
        "loss_sum": total,
        "seconds": seconds,
    }


def planned_mib(args: argparse.Namespace, chunk_size: int | None) -> float:
    from diffmeg.run_config import RunConfig
    from diffmeg.training.memory import loss_peak_bytes

    shape = argparse.Namespace(
        micro_batch_size=1,
        seq_length=args.tokens,
        context_parallel_size=1,
        tensor_model_parallel_size=1,
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        sequence_parallel=False,
        bf16=args.dtype == "bf16",
        fp16=False,
    )
    # partial: only the loss's shape is known, the run's other fields are None
    return loss_peak_bytes(RunConfig.from_args(shape, partial=True), chunk_size) / MIB


def run_variant(args: argparse.Namespace, variant: str, chunk_size: int | None) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        variant,
        "--tokens",
        str(args.tokens),
        "--vocab-size",
        str(args.vocab_size),
        "--hidden-size",
        str(args.hidden_size),
        "--dtype",
        args.dtype,
    ]
    if chunk_size:
        cmd += ["--chunk-size", str(chunk_size)]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{variant} failed:\n{proc.stderr[-3000:]}")
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    row["planned_mib"] = planned_mib(args, chunk_size)
    return row


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192, help="tokens of one micro-batch on one rank")
    p.add_argument("--vocab-size", type=int, default=100288)
    p.add_argument("--hidden-size", type=int, default=256, help="memory barely depends on it; time does")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--chunk-size", type=int, nargs="+", default=[1024], help="chunked variants to measure")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--child", choices=["whole", "chunked"], default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        args.variant, args.chunk_size = args.child, (args.chunk_size[0] if args.child == "chunked" else None)
        print(json.dumps(child(args)), flush=True)
        return {}
    rows = [run_variant(args, "whole", None)] + [run_variant(args, "chunked", c) for c in args.chunk_size]
    whole = rows[0]
    print(
        f"loss peak memory on the CPU: {args.tokens} tokens x {args.vocab_size} vocabulary, hidden "
        f"{args.hidden_size}, {args.dtype} (forward + backward, peak RSS above the inputs)"
    )
    print(f"{'variant':<16}{'peak MiB':>10}{'planned MiB':>13}{'vs whole':>10}{'seconds':>9}{'loss sum':>16}")
    for r in rows:
        name = "whole logits" if r["variant"] == "whole" else f"chunks of {r['chunk_size']}"
        ratio = r["peak_mib"] / whole["peak_mib"]
        print(
            f"{name:<16}{r['peak_mib']:>10.1f}{r['planned_mib']:>13.1f}{ratio:>10.3f}{r['seconds']:>9.1f}"
            f"{r['loss_sum']:>16.6g}"
        )
    result = {
        "tokens": args.tokens,
        "vocab_size": args.vocab_size,
        "hidden_size": args.hidden_size,
        "dtype": args.dtype,
        "rows": rows,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
