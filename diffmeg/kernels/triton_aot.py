"""Compile the differential-attention kernels for an NVIDIA architecture on a machine without a GPU.

Triton's wheel ships ptxas, so the full pipeline (TTIR -> TTGIR -> PTX -> cubin) runs on CPU. That
catches GPU-only compile errors the interpreter cannot see, and ptxas' resource usage (registers,
stack = spilled bytes, shared memory) is the best static proxy for tile choices when no GPU is at hand:

    python -m diffmeg.kernels.triton_aot --head-dim 128            # the default tiles
    python -m diffmeg.kernels.triton_aot --head-dim 128 --sweep    # candidate forward tiles

Must run with TRITON_INTERPRET unset (interpreted kernels cannot be compiled).
"""

from __future__ import annotations

import argparse
import itertools
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from diffmeg.errors import DiffmegError
from diffmeg.kernels.triton_diff import (
    TritonDiffConfig,
    _kernels,
    default_config,
    dkdv_meta,
    dq_meta,
    fwd_meta,
    preprocess_meta,
)

_LAUNCH_OPTIONS = ("num_warps", "num_stages")
_TORCH_TO_TRITON = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
# Tensor arguments of the kernels: in the input dtype, or float32 whatever it is (lambda, LSEs, deltas).
_POINTERS = {"Q1", "Q2", "K1", "K2", "V", "OUT", "O2", "DO", "DQ1", "DQ2", "DK1", "DK2", "DV_OUT"}
_FP32_POINTERS = {"LAM", "LSE1", "LSE2", "DELTA1", "DELTA2"}


@dataclass(frozen=True)
class KernelStats:
    kernel: str
    registers: int
    spill_bytes: int
    shared_bytes: int
    compile_s: float


def _signature(fn, constexprs: dict, dtype: str) -> dict[str, str]:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in _POINTERS:
            sig[name] = f"*{dtype}"
        elif name in _FP32_POINTERS:
            sig[name] = "*fp32"
        elif name.startswith("scale"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def _resource_usage(cubin: bytes) -> tuple[int, int]:
    import triton  # optional GPU dependency

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    regs = re.search(r"REG:(\d+)", text)
    stack = re.search(r"STACK:(\d+)", text)
    return int(regs.group(1)) if regs else -1, int(stack.group(1)) if stack else -1


def compile_kernel(name: str, meta: dict, dtype: torch.dtype = torch.bfloat16, arch: int = 90) -> KernelStats:
    """Compile one kernel for sm_<arch> with the given constexprs/launch options; ptxas' resource usage."""
    import triton  # optional GPU dependency, as are its compiler's modules
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kern = _kernels()
    if kern.INTERPRETED:
        raise DiffmegError("unset TRITON_INTERPRET: interpreted kernels cannot be compiled ahead of time")
    fn = getattr(kern, name)
    constexprs = {k: v for k, v in meta.items() if k not in _LAUNCH_OPTIONS}
    options = {k: meta[k] for k in _LAUNCH_OPTIONS if k in meta}
    src = ASTSource(
        fn=fn,
        signature=_signature(fn, constexprs, _TORCH_TO_TRITON[dtype]),
        constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()},
    )
    start = time.perf_counter()
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    seconds = time.perf_counter() - start
    regs, stack = _resource_usage(compiled.asm["cubin"])
    return KernelStats(name, regs, stack, compiled.metadata.shared, seconds)


def compile_all(
    head_dim: int, cfg: TritonDiffConfig, dtype: torch.dtype = torch.bfloat16, arch: int = 90
) -> list[KernelStats]:
    """The kernels of one training step (sequence lengths taken as multiples of every tile)."""
    seq = 1 << 16
    stats = [
        compile_kernel("diff_fwd_kernel", fwd_meta(head_dim, seq, dtype, cfg, store_o2=True), dtype, arch),
        compile_kernel("diff_bwd_preprocess_kernel", preprocess_meta(head_dim, seq, 32), dtype, arch),
    ]
    for passes in cfg.dkdv_passes():
        meta = dkdv_meta(head_dim, seq, seq, dtype, cfg, passes)
        stats.append(compile_kernel("diff_bwd_dkdv_kernel", meta, dtype, arch))
    stats.append(compile_kernel("diff_bwd_dq_kernel", dq_meta(head_dim, seq, dtype, cfg), dtype, arch))
    return stats


def duplicated_rows(rows: int, num_warps: int) -> bool:
    """Hopper MMA gives each warp 16 rows of a dot's M dim; Triton stacks the warps along M for the
    score tiles, so M < 16 * num_warps means warps compute the same rows (wasted work, hidden by a
    low register count)."""
    return rows < 16 * num_warps


def _row(stats: KernelStats, label: str = "") -> str:
    return (
        f"{stats.kernel:28s} {label:34s} regs {stats.registers:3d}  spill {stats.spill_bytes:5d} B"
        f"  smem {stats.shared_bytes // 1024:4d} KiB  ({stats.compile_s:.1f}s)"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--arch", type=int, default=90, help="sm_XX (90 = H100/H200)")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    parser.add_argument("--sweep", action="store_true", help="forward and backward tile candidates")
    args = parser.parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    cfg = default_config(args.head_dim, interpreted=False, dtype=dtype)
    print(f"sm_{args.arch}, head dim {args.head_dim}, {args.dtype}, default tiles {cfg}")
    for stats in compile_all(args.head_dim, cfg, dtype, args.arch):
        print(_row(stats, "default"))
    rows = {
        "forward": (cfg.block_m, cfg.num_warps),
        "dK/dV": (cfg.dkdv_block_n, cfg.bwd_num_warps),
        "dQ": (cfg.dq_block_m, cfg.bwd_num_warps),
    }
    for kernel, (m, w) in rows.items():
        if duplicated_rows(m, w):
            print(f"warning: {kernel} tile has {m} rows for {w} warps: warps duplicate each other's rows")
    if not args.sweep:
        return
    seq = 1 << 16
    tilings = [(64, 4), (128, 4), (128, 8)]  # (M rows, warps) with no duplicated rows
    splits_options = [v for v in (1, 2, 3) if (2 * args.head_dim) % v == 0]
    for (bm, warps), bn, splits in itertools.product(tilings, (16, 32, 64), splits_options):
        c = replace(cfg, block_m=bm, block_n=bn, v_splits=splits, num_warps=warps)
        meta = fwd_meta(args.head_dim, seq, dtype, c, store_o2=True)
        label = f"BM{bm} BN{bn} split{splits} w{warps}"
        print(_row(compile_kernel("diff_fwd_kernel", meta, dtype, args.arch), label))
    names = {(True, True, True): "dV+dK", (True, False, False): "dV", (False, True, True): "dK",
             (False, True, False): "dK1 (dK2 alike)"}  # fmt: skip
    for (bn, warps), bm, passes in itertools.product(tilings, (16, 32, 64), names):
        c = replace(cfg, dkdv_block_m=bm, dkdv_block_n=bn, bwd_num_warps=warps)
        meta = dkdv_meta(args.head_dim, seq, seq, dtype, c, passes)
        label = f"BM{bm} BN{bn} w{warps} {names[passes]}"
        print(_row(compile_kernel("diff_bwd_dkdv_kernel", meta, dtype, args.arch), label))
    for (bm, warps), bn in itertools.product(tilings, (16, 32, 64)):
        c = replace(cfg, dq_block_m=bm, dq_block_n=bn, bwd_num_warps=warps)
        meta = dq_meta(args.head_dim, seq, dtype, c)
        print(_row(compile_kernel("diff_bwd_dq_kernel", meta, dtype, args.arch), f"BM{bm} BN{bn} w{warps}"))


if __name__ == "__main__":
    main()
