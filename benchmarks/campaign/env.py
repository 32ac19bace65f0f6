"""Phase `env`: the machine, the versions, the GPU's dense bf16 peak (the MFU denominator) and the
measured bf16 matmul rate (the roof the machine reaches, reported beside it)."""

from __future__ import annotations

import argparse
import os
import platform
import socket

from benchmarks.campaign.part import Part
from benchmarks.campaign.plan import Plan, device_of


def phase_env(a: argparse.Namespace, part: Part, deadline: float, plan: Plan) -> None:
    import importlib.metadata
    import importlib.util

    import torch

    device = device_of(a)
    from benchmarks.step_profile import cudnn_version

    versions = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    versions["cudnn"] = cudnn_version()  # SDPA's cuDNN backend depends on it
    for dist in ("triton", "megatron-core", "transformer-engine", "flash-attn", "apex"):
        try:
            versions[dist.replace("-", "_")] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist.replace("-", "_")] = None
    # diffmeg.model.FUSED_SOFTMAX_MODULES, without importing megatron-core here (env stays light)
    softmax = ("scaled_upper_triang_masked_softmax_cuda", "scaled_masked_softmax_cuda", "scaled_softmax_cuda")
    machine = {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "fused_softmax_kernels": all(importlib.util.find_spec(m) is not None for m in softmax),
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        name = torch.cuda.get_device_name(0)
        machine.update(
            gpu=name,
            gpu_memory_gib=round(props.total_memory / 2**30, 2),
            multiprocessors=props.multi_processor_count,
            capability=f"{props.major}.{props.minor}",
            shared_memory_per_block_optin=getattr(props, "shared_memory_per_block_optin", None),
        )
        from diffmeg.training.hardware import dense_peak_tflops

        part.set(peak_bf16_tflops=dense_peak_tflops(name))  # MFU as the field quotes it (issue 24, item 9)
    else:
        name = f"cpu ({platform.processor() or platform.machine()})"
    part.set(device=name, device_type=device, versions=versions, machine=machine)
    part.set(bf16_matmul_tflops=matmul_tflops(plan.matmul_n, device))


def matmul_tflops(n: int, device: str, reps: int = 20) -> float:
    """Median bf16 n x n x n matrix-product rate on random data (the MFU roof of this machine)."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(0)
    mats = [torch.randn(n, n, generator=gen).to(device=device, dtype=torch.bfloat16) for _ in range(4)]
    from benchmarks.attention import time_it

    pairs = [(mats[0], mats[1]), (mats[2], mats[3])]
    i = [0]

    def mm():
        x, y = pairs[i[0] % 2]
        i[0] += 1
        return x @ y

    seconds = time_it(mm, device, warmup=3, iters=reps if device == "cuda" else 3)
    return 2 * n**3 / seconds / 1e12
