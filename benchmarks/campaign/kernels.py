"""Phase `kernels`: forward+backward time of every DIFF attention backend against the baseline's.

Rows are written as they are timed, a length at a time (4096 first: the headline lengths survive a short
budget): the baseline, the unfused DIFF paths and DIFF V2, each DIFF path checked against float64 once
before its rows. A fault that aborts the process therefore leaves every length timed before it. Checks
are keyed by backend and head dim, and none starts past the deadline.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from benchmarks.campaign.part import Part
from benchmarks.campaign.plan import Plan, device_of


def phase_kernels(a: argparse.Namespace, part: Part, deadline: float, plan: Plan) -> None:
    import torch

    from benchmarks import attention as bench

    device = device_of(a)
    dtype = bench.DTYPES[plan.attn_dtype]
    torch.manual_seed(0)
    d = plan.attn_head_dim
    backends = bench.make_backends()
    checks: dict[tuple[str, int], dict] = {}

    def check(name: str, fn: Callable, head_dim: int) -> None:
        """The backend's float64 check at this head dim, once, and only before the deadline (MHA at one
        length; ragged lengths, GQA and decode are the tests phase's: test_gpu_kernels)."""
        if (name, head_dim) not in checks and time.monotonic() < deadline:
            checks[name, head_dim] = bench.check_backend(
                fn, device, dtype, head_dim, heads=4, kv_heads=4, seq=plan.check_seq
            )
            print(f"check {name} d={head_dim}: {checks[name, head_dim]}", flush=True)

    def keep(rows: list[dict]) -> None:
        """Write the rows with their check's verdict."""
        for row in rows:
            verdict = checks.get((row["impl"], row["head_dim"]))
            row["correct"] = None if row["impl"] == bench.BASELINE else (verdict or {}).get("correct")
            part.add("attention", row)

    timing = {"dtype": dtype, "device": device, "warmup": plan.attn_warmup, "iters": plan.attn_iters,
              "deadline": deadline, "log": lambda line: print(line, flush=True)}  # fmt: skip
    layout = {"heads": plan.attn_heads, "kv_heads": plan.attn_kv_heads, "head_dim": d}
    print(bench.format_header(device), flush=True)
    for name, fn in backends.items():
        check(name, fn, d)
    for s in plan.attn_seqs:  # 4096 first: the headline figures survive a short budget
        keep(bench.run_rows([s], backends=backends, reference_max_seq=plan.attn_reference_max_seq,
                            **layout, **timing))  # fmt: skip
    for heads, kv_heads, hd, seqs in plan.attn_extra:  # other head dims: split-V against the baseline
        extra = {bench.SDPA_SPLIT_V: backends[bench.SDPA_SPLIT_V]}
        for name, fn in extra.items():
            check(name, fn, hd)
        keep(
            bench.run_rows(list(seqs), heads=heads, kv_heads=kv_heads, head_dim=hd, backends=extra, **timing)
        )
    if any(r["error"] == "skipped: time budget" for r in part.data.get("attention", [])):
        part.set(_status="partial", _error="some rows skipped: time budget")
