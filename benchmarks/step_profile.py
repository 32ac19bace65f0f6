"""Where one training step's time goes: torch.profiler over a step, its kernels sorted into kinds.

The train benchmark reports tokens/s and MFU; when MFU is low (the first H100 run: 25-30% against a 45%
goal) the next question is which work takes the step: the matmuls (whose rate MFU is about), attention,
the loss, the optimizer, communication, or everything else (norms, RoPE, SwiGLU, casts and copies).
On a GPU the device kernels are counted (their self time, so nothing is counted twice); on a CPU, where
there are none, the operators' self CPU time (coarser: a CPU's unfused Adam is elementwise operators,
counted as `other`). `benchmarks/train_step.py` profiles one extra step of a
run when asked (the campaign's train phase does at its first length).
"""

from __future__ import annotations

import re
from collections.abc import Callable

KINDS = ("matmul", "attention", "loss", "optimizer", "communication", "other")
"""The kinds of a step's work. `attention` is the fused attention kernels (SDPA's: flash, cuDNN's,
memory-efficient); an unfused path's score and value products count as `matmul`, its softmax as `other`."""

_PATTERNS = {
    "communication": r"nccl|all_?reduce|reduce_?scatter|all_?gather|c10d|gloo|broadcast",
    "attention": r"flash|fmha|attention|sdpa|cudnn.*(sdp|mha)",
    "loss": r"cross_?entropy|log_softmax|nll_loss|vocab_?parallel",
    "optimizer": r"multi_tensor|adam|_foreach|l2norm",
    "matmul": r"gemm|nvjet|xmma|cutlass|cublas|aten::(mm|addmm|bmm|matmul|linear|_scaled_mm)\b",
}
_COMPILED = {kind: re.compile(pattern, re.IGNORECASE) for kind, pattern in _PATTERNS.items()}
TOP_KERNELS = 8


def kind_of(name: str) -> str:
    """The kind of a kernel or operator by its name (`other` when no pattern matches)."""
    for kind, pattern in _COMPILED.items():
        if pattern.search(name):
            return kind
    return "other"


def summarize(times_us: dict[str, float]) -> dict:
    """{total_ms, share per kind (all KINDS, summing to 1), the TOP_KERNELS longest as [name, ms, share]}
    from self times in microseconds per kernel name."""
    total = sum(times_us.values())
    by_kind = dict.fromkeys(KINDS, 0.0)
    for name, us in times_us.items():
        by_kind[kind_of(name)] += us
    top = sorted(times_us.items(), key=lambda item: item[1], reverse=True)[:TOP_KERNELS]
    return {
        "total_ms": total / 1e3,
        "share": {kind: (us / total if total else 0.0) for kind, us in by_kind.items()},
        "top": [[name[:120], us / 1e3, us / total if total else 0.0] for name, us in top],
    }


SDPA_OPS = {
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash (cpu)",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_attention_math": "math",
    "aten::_scaled_dot_product_fused_attention_overrideable": "overrideable",
}
"""The operator SDPA dispatches to, by the backend it names: what `scaled_dot_product_attention` actually
chose for a shape (its forward; the backward follows the forward's backend)."""


def profile_step(step: Callable[[], None], device: str) -> dict:
    """Run `step` once under torch.profiler: summarize its kernels (GPU) or operators (CPU), and add
    `busy` (that time over the step's wall time: well under 1 on a GPU means the step waits on the host,
    launch-bound), `busy_basis` (what was counted), `sdpa` (the backend SDPA chose per query shape) and
    `cudnn` (cuDNN's version, None where torch has none)."""
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities, record_shapes=True) as prof:
        start = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        wall_us = (time.perf_counter() - start) * 1e6
    times: dict[str, float] = {}
    for event in prof.key_averages():
        on_device = event.device_type != torch.autograd.DeviceType.CPU
        if device == "cuda" and on_device:
            us = event.self_device_time_total
        elif device != "cuda" and not on_device:
            us = event.self_cpu_time_total
        else:
            continue
        if us > 0:
            times[event.key] = times.get(event.key, 0.0) + us
    out = summarize(times)
    busy_us = _device_busy_us(prof) if device == "cuda" else sum(times.values())
    out["busy"] = busy_us / wall_us if wall_us > 0 else None
    gpu = device == "cuda"
    out["busy_basis"] = "gpu kernels (union of intervals)" if gpu else "cpu operators (self time)"
    out["sdpa"] = sdpa_choices(prof)
    out["cudnn"] = cudnn_version()
    return out


def _device_busy_us(prof) -> float:
    """Microseconds in which at least one kernel ran (overlapping streams counted once)."""
    import torch

    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type != torch.autograd.DeviceType.CPU and e.time_range.end > e.time_range.start
    )
    busy, end = 0.0, float("-inf")
    for lo, hi in spans:
        if hi <= end:
            continue
        busy += hi - max(lo, end)
        end = hi
    return busy


def sdpa_choices(prof) -> list[dict]:
    """[{backend, op, q_shape, calls}] per SDPA backend operator and query shape seen in the profile."""
    rows = []
    for event in prof.key_averages(group_by_input_shape=True):
        if event.key in SDPA_OPS:
            shapes = event.input_shapes or [[]]
            rows.append(
                {"backend": SDPA_OPS[event.key], "op": event.key, "q_shape": list(shapes[0]),
                 "calls": event.count}
            )  # fmt: skip
    return sorted(rows, key=lambda r: (r["backend"], r["q_shape"]))


def cudnn_version() -> int | None:
    """cuDNN's version as torch reports it (e.g. 91000), None without cuDNN."""
    import torch

    try:
        return torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    except Exception:  # noqa: BLE001 - a torch without cuDNN support says so differently by version
        return None


def format_share(profile: dict) -> str:
    """`matmul 61% attention 22% ...` (kinds with any time), then the longest kernel."""
    parts = [f"{kind} {share:.0%}" for kind, share in profile["share"].items() if share > 0.005]
    longest = profile["top"][0][0] if profile["top"] else "-"
    busy = f"busy {profile['busy']:.0%}; " if profile.get("busy") is not None else ""
    return f"{profile['total_ms']:.1f} ms ({busy}" + " ".join(parts) + f"); longest: {longest[:60]}"
