"""The GPU validation and benchmark campaign: every figure of docs/benchmarks.md from a few commands.

    python3 benchmarks/campaign.py --phase env,tests,kernels --out DIR --wheels .whl   # GPU, < 9 min
    python3 benchmarks/campaign.py --phase train --out DIR --wheels .whl               # GPU, < 9 min
    python3 benchmarks/campaign.py --phase memory --out DIR --wheels .whl              # GPU, < 9 min
    python3 benchmarks/campaign.py --smoke --device cpu --out /tmp/campaign            # CPU: all, tiny

Phases (docs/gpu.md says what each measures and how to read it):
  env      GPU, memory, versions, measured bf16 matmul TFLOP/s (the roof for MFU); always runs
  tests    `pytest -m gpu` on GPU_TEST_PATHS; failures are recorded, not fatal
  kernels  forward+backward time of every DIFF V1 attention backend and the baseline's flash attention
           (3B head layout), each Triton tile candidate checked against float64 first; best tiles kept
  train    tokens/s and MFU of a 3B-wide model cut to what fits, DIFF per backend vs the FLOP-matched
           Transformer on the same model code, at 4096 and 2048
  memory   the memory plan against torch.cuda.max_memory_allocated (recompute none/selective/full), and a
           50-iteration bf16 run per small preset with save, exact resume and generation (gpu_train_run)

Each phase runs in its own process (a CUDA fault in one cannot take the others down) under a time
budget; the whole command ends within --budget seconds. `--wheels DIR` first installs the wheels in DIR
whose package is missing (pip --no-index, nothing downloaded). Writes DIR/campaign-<device>-<time>.json
(schema: benchmarks/schema.py) and a log beside it, and prints a short table. benchmarks/report.py turns
the JSON files kept under benchmarks/results/ into docs/benchmarks.md's GPU tables.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import schema  # noqa: E402

PHASES = schema.PHASES
# Seconds per phase on a GPU, and in a CPU smoke run; --budget caps the sum of those selected.
PHASE_BUDGET_S = {"env": 60, "tests": 180, "kernels": 300, "train": 450, "memory": 450}
SMOKE_BUDGET_S = {"env": 20, "tests": 25, "kernels": 30, "train": 30, "memory": 75}
DEFAULT_TOTAL_S = 450  # 7.5 minutes: inside the 9 a GPU lease allows per command, wheels included
SMOKE_TOTAL_S = 180  # CI: about 2 minutes of work on 2 idle cores; a slower machine skips rows, never hangs
MIN_PHASE_S = 30  # kept back for each phase still to come
CHILD_MARGIN_S = 20  # a phase stops starting new work this long (at most 15%) before its budget ends
# Where the `gpu`-marked tests live (tests/benchmarks/test_campaign.py fails if one is added elsewhere).
GPU_TEST_PATHS = ("tests/kernels", "tests/test_gpu_readiness.py", "tests/distributed/test_te_cp.py")


# ----------------------------------------------------------------------------------------------------
# What each phase runs: GPU sizes, or tiny CPU ones


@dataclass(frozen=True)
class Plan:
    matmul_n: int
    attn_dtype: str
    attn_heads: int
    attn_kv_heads: int
    attn_head_dim: int
    attn_seqs: tuple[int, ...]
    attn_reference_max_seq: int
    attn_warmup: int
    attn_iters: int
    check_seq: int
    attn_extra: tuple[tuple[int, int, int, tuple[int, ...]], ...]
    """(heads, kv heads, head dim, seqs) of other layouts: the fused kernel's default tiles there."""
    train_diff: str
    train_layers: tuple[int, ...]
    """Layer counts to try, largest first: the first whose memory plan fits is used."""
    train_seqs: tuple[int, ...]
    train_backends: tuple[str, ...]
    train_tokens_per_microbatch: int
    train_microbatches: int
    train_warmup: int
    train_iters: int
    vocab_size: int | None
    memory_diff: str
    memory_layers: int
    memory_seq: int
    memory_mbs: int
    memory_recompute: tuple[str | None, ...]
    run_models: tuple[str, ...]
    run_iterations: int
    run_args: tuple[str, ...]
    gen_tokens: int
    ratio_seqs: dict[str, int] = field(default_factory=lambda: {"4k": 4096, "2k": 2048})


GPU_PLAN = Plan(
    matmul_n=8192,
    attn_dtype="bf16",
    attn_heads=12,  # DIFF-3B: 12 differential heads of d=128 against the Transformer's 24
    attn_kv_heads=12,
    attn_head_dim=128,
    attn_seqs=(4096, 2048, 8192, 16384),  # 4096 first: the headline figure survives a short budget
    attn_reference_max_seq=2048,
    attn_warmup=5,
    attn_iters=20,
    check_seq=1024,
    attn_extra=((8, 8, 96, (2048,)),),  # DIFF-830M's head dim
    train_diff="diff-3b",
    train_layers=(8, 6, 4, 2),
    train_seqs=(4096, 2048),
    train_backends=("sdpa", "triton"),
    train_tokens_per_microbatch=4096,
    train_microbatches=4,
    train_warmup=2,
    train_iters=5,
    vocab_size=None,
    memory_diff="diff-3b",
    memory_layers=4,
    memory_seq=4096,
    memory_mbs=2,
    memory_recompute=(None, "selective", "full"),
    run_models=("diff-tiny", "transformer-tiny"),
    run_iterations=50,
    run_args=("--mock-data", "--bf16", "--lr-warmup-iters", "5"),
    gen_tokens=16,
)

SMOKE_PLAN = Plan(
    matmul_n=256,
    attn_dtype="fp32",
    attn_heads=2,
    attn_kv_heads=1,
    attn_head_dim=32,
    attn_seqs=(128, 256),
    attn_reference_max_seq=256,
    attn_warmup=0,
    attn_iters=1,
    check_seq=64,
    attn_extra=(),
    train_diff="diff-tiny",
    train_layers=(2,),
    train_seqs=(64,),
    train_backends=("sdpa", "reference"),
    train_tokens_per_microbatch=64,
    train_microbatches=1,
    train_warmup=0,
    train_iters=1,
    vocab_size=256,
    memory_diff="diff-tiny",
    memory_layers=2,
    memory_seq=64,
    memory_mbs=1,
    memory_recompute=(None, "full"),
    run_models=("diff-tiny",),
    run_iterations=4,
    run_args=(
        "--mock-data",
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "2",
        "--seq-length",
        "64",
        "--max-position-embeddings",
        "64",
        "--vocab-size",
        "256",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "1",
        "--lr-warmup-iters",
        "1",
    ),
    gen_tokens=4,
)


# ----------------------------------------------------------------------------------------------------
# Figures from rows (pure functions, unit-tested)


def fused_speedup(rows: list[dict], seq: int, head_dim: int) -> float | None:
    """Best unfused DIFF fwd+bwd time / best correct fused Triton fwd+bwd time at this length."""
    from benchmarks.attention import TRITON, UNFUSED

    def best(pred: Callable[[dict], bool]) -> float | None:
        times = [
            r["fwd_bwd_ms"]
            for r in rows
            if r["seq"] == seq
            and r["head_dim"] == head_dim
            and pred(r)
            and r.get("fwd_bwd_ms")
            and not r["error"]
        ]
        return min(times) if times else None

    unfused = best(lambda r: r["impl"] in UNFUSED)
    fused = best(lambda r: r["impl"].startswith(TRITON) and r.get("correct") is not False)
    return unfused / fused if unfused and fused else None


def best_triton(rows: list[dict], seq: int, head_dim: int) -> dict | None:
    """The fastest correct fused-Triton row at this length and head dim."""
    from benchmarks.attention import TRITON

    ok = [
        r
        for r in rows
        if r["impl"].startswith(TRITON)
        and r["seq"] == seq
        and r["head_dim"] == head_dim
        and not r["error"]
        and r.get("correct") is not False
        and r.get("fwd_bwd_ms")
    ]
    return min(ok, key=lambda r: r["fwd_bwd_ms"]) if ok else None


def throughput_ratio(rows: list[dict], seq: int) -> tuple[float | None, float | None]:
    """(best DIFF V1 tokens/s / Transformer tokens/s, FLOP bound of the measured models) at this length."""
    diff = [
        r for r in rows if r["seq"] == seq and r["arch"] == "diff" and r["tokens_per_s"] and not r["error"]
    ]
    base = [
        r
        for r in rows
        if r["seq"] == seq and r["arch"] == "transformer" and r["tokens_per_s"] and not r["error"]
    ]
    if not diff or not base:
        return None, None
    best = max(diff, key=lambda r: r["tokens_per_s"])
    return best["tokens_per_s"] / base[0]["tokens_per_s"], base[0]["flops_per_token"] / best[
        "flops_per_token"
    ]


def flop_bound(diff_preset: str, seq: int) -> float:
    """Transformer FLOPs / DIFF FLOPs per token of the full presets (DESIGN.md: 0.956 at 4K for 3B)."""
    from benchmarks.train_step import baseline_of
    from diffmeg.presets import get_preset
    from diffmeg.training.flops import forward_flops_per_token

    def per_token(name: str) -> float:
        p = get_preset(name)
        return forward_flops_per_token(
            num_layers=p["num_layers"],
            hidden_size=p["hidden_size"],
            ffn_hidden_size=p["ffn_hidden_size"],
            num_attention_heads=p["num_attention_heads"],
            num_query_groups=p.get("num_query_groups") or p["num_attention_heads"],
            kv_channels=p["kv_channels"],
            seq_length=seq,
            vocab_size=p["vocab_size"],
            diff_attention=p["diff_attention"],
        ).total

    return per_token(baseline_of(diff_preset)) / per_token(diff_preset)


def kept_triton_best(results_dir: Path, device: str) -> dict | None:
    """triton_best of the newest results file from this GPU model (a kernels phase of an earlier command)."""
    found = []
    for path in results_dir.glob("*.json"):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and data.get("device") == device and data.get("triton_best"):
            found.append((data.get("date", ""), data["triton_best"]))
    return max(found, key=lambda x: x[0])[1] if found else None


def phase_budgets(
    selected: list[str], total_s: float, smoke: bool, overrides: dict[str, float] | None = None
) -> dict[str, float]:
    """Seconds for each selected phase: its own budget, shrunk so the sum stays within total_s."""
    table = {**(SMOKE_BUDGET_S if smoke else PHASE_BUDGET_S), **(overrides or {})}
    out, left = {}, total_s
    for i, phase in enumerate(selected):
        later = len(selected) - i - 1
        out[phase] = max(0.0, min(table[phase], left - later * MIN_PHASE_S))
        left -= out[phase]
    return out


def slug(text: str) -> str:
    """File-name-safe lower-case form of a device name (letters, digits, '-')."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


# ----------------------------------------------------------------------------------------------------
# Phases (each runs in a child process: `campaign.py --child PHASE ...`)


class Part:
    """A phase's results, written to disk after every row so a killed child loses nothing kept."""

    def __init__(self, path: Path) -> None:
        self.path, self.data = path, {"_status": "ok", "_error": None}

    def set(self, **kw) -> None:
        self.data.update(kw)
        self.save()

    def add(self, table: str, row: dict) -> None:
        self.data.setdefault(table, []).append(row)
        self.save()

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, default=_json_default))
        os.replace(tmp, self.path)


def _json_default(o):
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return str(o)


def _clean(value):
    """NaN/inf to None (JSON has neither), recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def _device(a: argparse.Namespace) -> str:
    import torch

    return a.device or ("cuda" if torch.cuda.is_available() else "cpu")


def phase_env(a: argparse.Namespace, part: Part, deadline: float, plan: Plan) -> None:
    import importlib.metadata
    import importlib.util

    import torch

    device = _device(a)
    versions = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for dist in ("triton", "megatron-core", "transformer-engine", "flash-attn", "apex"):
        try:
            versions[dist.replace("-", "_")] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist.replace("-", "_")] = None
    # diffmeg.training.builders.FUSED_SOFTMAX_MODULES, without importing megatron-core here (env stays light)
    softmax = ("scaled_upper_triang_masked_softmax_cuda", "scaled_masked_softmax_cuda", "scaled_softmax_cuda")
    machine = {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "fused_softmax_kernels": all(importlib.util.find_spec(m) is not None for m in softmax),
        "triton_importable": importlib.util.find_spec("triton") is not None,
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        name = torch.cuda.get_device_name(0)
        machine.update(
            gpu=name,
            gpu_memory_gib=round(props.total_memory / 2**30, 2),
            multiprocessors=props.multi_processor_count,
            capability=f"{props.major}.{props.minor}",
        )
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


_TEST_LINE = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)")


def phase_tests(a: argparse.Namespace, part: Part, deadline: float, plan: Plan) -> None:
    """`pytest -m gpu -v`, counted from its per-test lines as they come (a run cut short by the budget
    still reports what it got through)."""
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-p", "no:cacheprovider", "-rfE"]
    cmd += ["--continue-on-collection-errors", *GPU_TEST_PATHS]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=_child_env(a), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": [], "timed_out": False}
    outcome = {"PASSED": "passed", "XPASS": "passed", "FAILED": "failed", "ERROR": "errors"}
    tail: list[str] = []
    try:
        for line in _lines_until(proc, deadline):
            print(line.rstrip("\n"), flush=True)
            tail = (tail + [line])[-50:]
            m = _TEST_LINE.match(line)
            if m:
                key = outcome.get(m.group(2), "skipped")
                counts[key] += 1
                if key in ("failed", "errors"):
                    counts["failures"].append(m.group(1))
            part.set(tests=counts)
        if proc.poll() is None:
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                counts["timed_out"] = True
    finally:
        if proc.poll() is None:
            _kill_group(proc)
            proc.wait()
    if proc.returncode not in (0, 1, 5) and not counts["timed_out"]:  # 5: nothing collected
        counts["errors"] += 1
        counts["failures"].append(f"pytest exited with {proc.returncode}")
    part.set(tests=counts)
    if counts["timed_out"]:
        part.set(_status="partial", _error="pytest ran past the phase budget")


def phase_kernels(a: argparse.Namespace, part: Part, deadline: float, plan: Plan) -> None:
    import torch

    from benchmarks import attention as bench

    device = _device(a)
    dtype = bench.DTYPES[plan.attn_dtype]
    torch.manual_seed(0)
    backends = bench.make_backends(sweep=False, device=device, head_dim=plan.attn_head_dim)
    candidates = {}
    if bench.TRITON in backends:  # one row per tile candidate; the default tiles come first
        del backends[bench.TRITON]
        candidates = bench.triton_candidates(plan.attn_head_dim)
        for label, cfg in candidates.items():
            backends[f"{bench.TRITON} {label}"] = bench.triton_with(cfg)

    def check(fn, head_dim: int) -> dict:
        # At the timed rows' Triton specialisations (MHA, lengths a multiple of 16, batch 1), so each tile
        # candidate compiles once; ragged lengths, GQA and decode are the tests phase's (test_gpu_kernels).
        return bench.check_backend(fn, device, dtype, head_dim, heads=4, kv_heads=4, seq=plan.check_seq)

    # Correctness first (float64 reference): a fast wrong kernel is not a result.
    checks = {}
    for name, fn in backends.items():
        if time.monotonic() > deadline:
            break
        checks[name] = check(fn, plan.attn_head_dim)
        print(f"check {name}: {checks[name]}", flush=True)
        label = name[len(bench.TRITON) + 1 :] if name.startswith(bench.TRITON + " ") else None
        if label is not None:
            part.add(
                "triton_candidates", {"label": label, "config": asdict(candidates[label]), **checks[name]}
            )
    print(bench.format_header(device), flush=True)

    def keep(row: dict) -> None:
        row["correct"] = checks.get(row["impl"], {}).get("correct") if row["impl"] != bench.BASELINE else None
        part.add("attention", row)

    def log_and_keep(line: str) -> None:
        print(line, flush=True)

    timing = {  # every run_rows call below times the same way
        "dtype": dtype,
        "device": device,
        "warmup": plan.attn_warmup,
        "iters": plan.attn_iters,
        "deadline": deadline,
        "log": log_and_keep,
    }
    for s in plan.attn_seqs:
        rows = bench.run_rows(
            [s],
            heads=plan.attn_heads,
            kv_heads=plan.attn_kv_heads,
            head_dim=plan.attn_head_dim,
            backends=backends,
            reference_max_seq=plan.attn_reference_max_seq,
            **timing,
        )
        for row in rows:
            keep(row)
    rows = part.data.get("attention", [])
    best = best_triton(rows, 4096, plan.attn_head_dim)
    if best is not None:
        label = best["impl"][len(bench.TRITON) + 1 :]
        part.set(
            triton_best={"label": label, "head_dim": plan.attn_head_dim, "config": asdict(candidates[label])}
        )
    part.set(fused_speedup_vs_best_unfused_4k=fused_speedup(rows, 4096, plan.attn_head_dim))
    for heads, kv_heads, d, seqs in plan.attn_extra:  # other head dims: the default tiles vs SDPA
        extra = {bench.SDPA_SPLIT_V: bench.make_backends(False, device)[bench.SDPA_SPLIT_V]}
        if device == "cuda" and bench.triton_available():
            extra[bench.TRITON] = bench.diff_attention_triton
            checks[bench.TRITON] = check(bench.diff_attention_triton, d)
        for row in bench.run_rows(
            list(seqs), heads=heads, kv_heads=kv_heads, head_dim=d, backends=extra, **timing
        ):
            keep(row)
    if any(r["error"] == "skipped: time budget" for r in part.data.get("attention", [])):
        part.set(_status="partial", _error="some rows skipped: time budget")


def phase_train(a: argparse.Namespace, part: Part, deadline: float, plan: Plan) -> None:
    import torch

    from benchmarks import train_step
    from diffmeg.presets import PRESETS

    device = _device(a)
    train_step.init_process()
    layers = fit_layers(plan, device)
    backends = list(plan.train_backends)
    tiles = a.triton_tiles if a.triton_tiles not in (None, "auto", "none") else None
    if device == "cuda" and "triton" in backends and tiles and not _is_default_tiles(tiles):
        backends.append("triton-tuned")
    base = train_step.baseline_of(plan.train_diff)
    v2 = plan.train_diff.replace("diff-", "diff2-", 1)
    runs: list[tuple[str, str | None]] = [(base, None)] + [(plan.train_diff, b) for b in backends]
    if v2 in PRESETS:  # DIFF V2 (attention by megatron-core's own core): its presets are diff2-*
        runs.append((v2, None))
    roof = a.roof
    print(train_step.format_header(), flush=True)
    for seq in plan.train_seqs:
        for preset, backend in runs:
            row = {"model": preset, "impl": backend or ("baseline" if preset == base else "auto"), "seq": seq}
            if time.monotonic() > deadline:
                part.add(
                    "train",
                    {
                        **row,
                        "arch": _arch(preset),
                        "tokens_per_s": None,
                        "mfu": None,
                        "error": "skipped: time budget",
                    },
                )
                part.set(_status="partial", _error="some runs skipped: time budget")
                continue
            opts = train_step.StepOptions(
                tokens_per_microbatch=plan.train_tokens_per_microbatch,
                microbatches=plan.train_microbatches,
                warmup=plan.train_warmup,
                iters=plan.train_iters,
                vocab_size=plan.vocab_size,
                diff_attn_backend="triton" if backend == "triton-tuned" else backend,
                num_layers=layers,
            )
            with tuned_triton_tiles(tiles if backend == "triton-tuned" else None):
                r = train_step.run_one(preset, seq, opts, device)
            print(train_step.format_row(r, roof if device == "cuda" else None), flush=True)
            part.add(
                "train",
                {
                    **row,
                    "arch": _arch(preset),
                    "backend": r["backend"],
                    "layers": r["layers"],
                    "micro_batch_size": r["mbs"],
                    "microbatches": r["microbatches"],
                    "tokens_per_s": r["tokens_per_s"],
                    "tflops": r["tflops"],
                    # MFU against this GPU's measured bf16 roof (none on a CPU: fp32 steps there)
                    "mfu": r["tflops"] / roof if (r["tflops"] and roof and device == "cuda") else None,
                    "flops_per_token": r["flops_per_token"],
                    "mem_gib": r["mem_gib"],
                    "estimated_gib": r["estimated_gib"],
                    "error": r["error"],
                },
            )
            if device == "cuda":
                torch.cuda.empty_cache()
    rows = part.data.get("train", [])
    for key, seq in plan.ratio_seqs.items():
        ratio, bound = throughput_ratio(rows, seq)
        part.set(**{f"diff_vs_transformer_ratio_{key}": ratio, f"flop_bound_{key}": bound})
    part.set(flop_bound_3b_4k=flop_bound("diff-3b", 4096))
    train_step.close_process()


def _is_default_tiles(path: str) -> bool:
    """Whether a tuned-tiles file holds its head dim's default configuration (no extra run needed)."""
    from diffmeg.kernels.triton_diff import TritonDiffConfig, default_config

    info = json.loads(Path(path).read_text())
    return TritonDiffConfig(**info["config"]) == default_config(info["head_dim"], interpreted=False)


def _arch(preset: str) -> str:
    return (
        "transformer"
        if preset.startswith("transformer-")
        else "diff2"
        if preset.startswith("diff2-")
        else "diff"
    )


def fit_layers(plan: Plan, device: str) -> int:
    """The most layers (of plan.train_layers) whose memory plan fits 85% of this GPU (DIFF and baseline)."""
    if device != "cuda":
        return plan.train_layers[-1]
    import torch

    from benchmarks import train_step
    from diffmeg.training.memory import estimate_memory

    free = 0.85 * torch.cuda.get_device_properties(0).total_memory
    for layers in plan.train_layers:
        opts = train_step.StepOptions(
            tokens_per_microbatch=plan.train_tokens_per_microbatch,
            microbatches=plan.train_microbatches,
            num_layers=layers,
        )
        need = max(
            estimate_memory(
                train_step.resolve_run_args(p, max(plan.train_seqs), opts, device), on_gpu=True
            ).total
            for p in (plan.train_diff, train_step.baseline_of(plan.train_diff))
        )
        if need <= free:
            return layers
    return plan.train_layers[-1]


class tuned_triton_tiles:
    """Within the block, the fused kernel uses the tiles the kernels phase found fastest (a JSON file)."""

    def __init__(self, path: str | None) -> None:
        self.path = path

    def __enter__(self):
        if self.path:
            from diffmeg.kernels import triton_diff

            info = json.loads(Path(self.path).read_text())
            triton_diff.set_tuned_config(info["head_dim"], triton_diff.TritonDiffConfig(**info["config"]))
        return self

    def __exit__(self, *exc) -> None:
        if self.path:
            from diffmeg.kernels import triton_diff

            triton_diff.set_tuned_config(None, None)


def phase_memory(a: argparse.Namespace, part: Part, deadline: float, plan: Plan) -> None:
    import torch

    from benchmarks import train_step

    device = _device(a)
    work = Path(tempfile.mkdtemp(prefix="campaign-runs-"))
    try:
        for model in plan.run_models:
            if time.monotonic() > deadline:
                part.add("gpu_train_run", _skipped_run(model, plan.run_iterations))
                continue
            env = _child_env(a)
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


def _skipped_run(model: str, iterations: int) -> dict:
    return {
        "model": model,
        "iterations": iterations,
        "loss_first": None,
        "loss_last": None,
        "resume_exact": None,
        "generation_ok": None,
        "error": "skipped: time budget",
    }


def _losses(path: Path) -> dict[int, float]:
    out = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if "lm_loss" in rec:
                out[rec["iteration"]] = rec["lm_loss"]
    return out


def train_and_resume(model: str, plan: Plan, work: Path, deadline: float, env: dict) -> dict:
    """pretrain_diff.py three times: N iterations straight; N/2 then exit (saving); resume to N (no save).

    resume_exact: the first resumed iteration's loss equals the uninterrupted run's bit for bit (its
    forward uses the restored weights and data position; later steps may differ by non-deterministic
    GPU reductions, reported as resume_max_abs_diff)."""
    n, half = plan.run_iterations, plan.run_iterations // 2
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / "ckpt"
    base = [sys.executable, str(REPO / "pretrain_diff.py"), "--model", model, *plan.run_args]
    base += ["--train-iters", str(n), "--log-interval", "1", "--eval-iters", "0"]
    runs = {
        "full": base + ["--metrics-file", str(work / "full.jsonl")],
        "first": base
        + ["--save", str(ckpt), "--exit-interval", str(half), "--metrics-file", str(work / "first.jsonl")],
        "resume": base + ["--load", str(ckpt), "--metrics-file", str(work / "resume.jsonl")],
    }
    row = {
        "model": model,
        "iterations": n,
        "loss_first": None,
        "loss_last": None,
        "loss_falls": None,
        "resume_exact": None,
        "resume_max_abs_diff": None,
        "generation_ok": None,
        "error": None,
    }
    for name, cmd in runs.items():
        left = deadline - time.monotonic()
        if left < 5:
            row["error"] = f"skipped: time budget (before the {name} run)"
            return row
        start = time.monotonic()
        proc = subprocess.Popen(
            cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,  # the checkpoint writer's spawned processes end with it
        )  # fmt: skip
        try:
            stdout, stderr = proc.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            proc.communicate()
            row["error"] = f"skipped: time budget (the {name} run did not finish)"
            return row
        proc.stdout, proc.stderr = stdout, stderr
        print(f"  {model} {name}: exit {proc.returncode} in {time.monotonic() - start:.0f}s", flush=True)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
            row["error"] = f"{name} run failed: {tail[0][:300]}"
            print(proc.stderr[-4000:], flush=True)
            return row
    full, first, resumed = (_losses(work / f"{k}.jsonl") for k in ("full", "first", "resume"))
    if len(full) < n or half + 1 not in resumed:
        row["error"] = f"missing losses (full: {len(full)}, resumed: {sorted(resumed)[:3]}...)"
        return row
    row["loss_first"], row["loss_last"] = full[1], full[n]
    row["loss_falls"] = full[n] < full[1] and all(math.isfinite(v) for v in full.values())
    row["resume_exact"] = resumed[half + 1] == full[half + 1] and all(first[i] == full[i] for i in first)
    row["resume_max_abs_diff"] = max(abs(resumed[i] - full[i]) for i in resumed)
    return row


def generation_check(ckpt: Path, device: str, tokens: int) -> dict:
    """Greedy decoding with the KV cache equals recomputation; seeded sampling repeats; ids in the vocab."""
    import torch

    from diffmeg.generation import SamplingConfig, generate, load_model

    try:
        model, _ = load_model(str(ckpt), dtype=torch.bfloat16 if device == "cuda" else torch.float32)
        prompt = [1, 2, 3, 4, 5]
        cached = generate(model, prompt, tokens, use_cache=True)
        full = generate(model, prompt, tokens, use_cache=False)
        s1 = generate(model, prompt, tokens, SamplingConfig(temperature=1.0, top_p=0.9, seed=3))
        s2 = generate(model, prompt, tokens, SamplingConfig(temperature=1.0, top_p=0.9, seed=3))
        vocab = model.vocab_size
        ids = cached.output_ids + s1.output_ids
        checks = {
            "cache_equals_recompute": cached.output_ids == full.output_ids,
            "seeded_sampling_repeats": s1.output_ids == s2.output_ids,
            "ids_in_vocab": all(0 <= i < vocab for i in ids),
            "lengths": len(cached.output_ids) == tokens and len(s1.output_ids) == tokens,
            "device": str(next(model.parameters()).device),
        }
        ok = all(v for k, v in checks.items() if k != "device")
        del model
        return {"ok": ok, **checks, "error": None}
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}


PHASE_FUNCS = {
    "env": phase_env,
    "tests": phase_tests,
    "kernels": phase_kernels,
    "train": phase_train,
    "memory": phase_memory,
}


def child_main(a: argparse.Namespace) -> int:
    part = Part(Path(a.part))
    deadline = time.monotonic() + a.budget_s - min(CHILD_MARGIN_S, 0.15 * a.budget_s)
    plan = SMOKE_PLAN if a.smoke else GPU_PLAN
    try:
        PHASE_FUNCS[a.child](a, part, deadline, plan)
    except Exception as exc:  # noqa: BLE001 - recorded for the parent
        traceback.print_exc()
        part.set(_status="failed", _error=f"{type(exc).__name__}: {exc}"[:500])
    part.save()
    return 0


# ----------------------------------------------------------------------------------------------------
# The parent: wheels, children, the results file, the table


def _child_env(a: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), env.get("PYTHONPATH", "")] if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("TRITON_INTERPRET", None)
    for key in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "SLURM_PROCID",
        "SLURM_NTASKS",
    ):
        env.pop(key, None)  # every run here is one process: never join an outer launcher's job
    if a.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def install_wheels(wheel_dir: Path, log: Callable[[str], None]) -> list[str]:
    """Install (no index, no dependencies resolved) each wheel whose distribution/version is missing."""
    import importlib.metadata

    todo = []
    for wheel in sorted(wheel_dir.glob("*.whl")):
        name, version = wheel.name.split("-")[:2]
        try:
            if importlib.metadata.version(name) == version:
                continue
        except importlib.metadata.PackageNotFoundError:
            pass
        todo.append(wheel)
    if not todo:
        log(f"wheels: everything in {wheel_dir} is installed")
        return []
    cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile", "-q"]
    proc = subprocess.run(cmd + [str(w) for w in todo], capture_output=True, text=True)
    if proc.returncode != 0:  # a read-only environment: a private target on the path instead
        target = Path(tempfile.gettempdir()) / "diffmeg-site"
        proc = subprocess.run(
            cmd + ["--target", str(target)] + [str(w) for w in todo], capture_output=True, text=True
        )
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in [str(target), os.environ.get("PYTHONPATH", "")] if p
        )
    log(f"wheels: installed {', '.join(w.name for w in todo)} (exit {proc.returncode})")
    if proc.returncode != 0:
        log(proc.stderr[-2000:])
    return [w.name for w in todo]


def _git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=20
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def run_child(
    phase: str,
    budget: float,
    a: argparse.Namespace,
    roof: float | None,
    tiles: Path | None,
    log: Callable[[str], None],
) -> tuple[dict, float]:
    """Run one phase in a child process; its results (what it kept before any crash) and seconds."""
    part_file = Path(tempfile.mkdtemp(prefix="campaign-part-")) / f"{phase}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", phase, "--part", str(part_file)]
    cmd += ["--budget-s", str(budget)]
    if a.device:
        cmd += ["--device", a.device]
    if a.smoke:
        cmd.append("--smoke")
    if roof:
        cmd += ["--roof", str(roof)]
    if tiles is not None:
        cmd += ["--triton-tiles", str(tiles)]
    start = time.monotonic()
    log(f"=== phase {phase} (budget {budget:.0f}s)")
    env = _child_env(a)
    env["TORCHDYNAMO_DISABLE"] = "1"  # as benchmarks/train_step.py: megatron-core's fusions run eagerly
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: a timeout ends the phase's subprocesses too
    )
    status_override = None
    try:
        for line in _lines_until(proc, start + budget):
            log(line.rstrip("\n"))
        try:
            proc.wait(timeout=max(1.0, start + budget - time.monotonic()))
        except subprocess.TimeoutExpired:
            status_override = "timeout"
    finally:
        if proc.poll() is None:
            _kill_group(proc)
        proc.wait()
    seconds = time.monotonic() - start
    part = json.loads(part_file.read_text()) if part_file.is_file() else {}
    shutil.rmtree(part_file.parent, ignore_errors=True)
    if status_override:
        part["_status"], part["_error"] = "timeout", f"killed after {budget:.0f}s"
    elif proc.returncode != 0 or not part:
        part["_status"] = "failed"
        part["_error"] = part.get("_error") or f"phase process exited with {proc.returncode}"
    return part, seconds


def _kill_group(proc: subprocess.Popen) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _lines_until(proc: subprocess.Popen, end: float):
    """The child's output lines until it exits or the time is up."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    while True:
        left = end - time.monotonic()
        if left <= 0:
            return
        if not sel.select(timeout=min(left, 5.0)):
            if proc.poll() is not None:
                return
            continue
        line = proc.stdout.readline()
        if not line:
            return
        yield line


def summary_lines(result: dict) -> list[str]:
    """The short table printed at the end of a run."""
    out = [
        f"campaign {result['date']}: {result['device']} "
        f"({result['device_type']}{', smoke' if result['smoke'] else ''}),"
        f" git {result['git_revision'][:12]}{' (dirty)' if result['git_dirty'] else ''}"
    ]
    for phase, info in result["phases"].items():
        if info["status"] != "not run":
            secs = f"{info['seconds']:.0f}s" if info.get("seconds") is not None else ""
            out.append(f"  {phase:8s} {info['status']:8s} {secs:>6}  {info.get('error') or ''}")
    fmt = lambda v, f="{:.3g}": "-" if v is None else f.format(v)  # noqa: E731
    out.append(f"bf16 matmul TFLOP/s: {fmt(result['bf16_matmul_tflops'])}")
    if result["tests"]:
        t = result["tests"]
        out.append(
            f"gpu tests: {t['passed']} passed, {t['failed']} failed, {t['errors']} errors, "
            f"{t['skipped']} skipped"
        )
        out.extend(f"  FAILED {name}" for name in t["failures"][:10])
    at4k = [r for r in result["attention"] if r["seq"] == 4096 and r["head_dim"] == 128]
    for r in at4k:
        out.append(
            f"attention 4K {r['impl']:44s} fwd+bwd {fmt(r.get('fwd_bwd_ms'), '{:.2f}')} ms "
            f"{fmt(r['tflops'], '{:.0f}')} TF/s {r['error'] or ''}"
        )
    out.append(
        f"fused speedup vs best unfused at 4K: {fmt(result['fused_speedup_vs_best_unfused_4k'])} "
        "(goal >= 1.3)"
    )
    for r in result["train"]:
        out.append(
            f"train {r['model']:16s} {r['impl']:14s} s{r['seq']:<5d} "
            f"tokens/s {fmt(r['tokens_per_s'], '{:.0f}')}"
            f"  MFU {fmt(r['mfu'], '{:.1%}')} {r['error'] or ''}"
        )
    for key in ("4k", "2k"):
        ratio, bound = result[f"diff_vs_transformer_ratio_{key}"], result[f"flop_bound_{key}"]
        if ratio is not None:
            out.append(f"DIFF/Transformer tokens/s at {key}: {ratio:.3f} (FLOP bound {fmt(bound)})")
    for r in result["memory"]:
        out.append(
            f"memory {r['layout']}: estimated {fmt(r['estimated_gib'])} GiB, measured "
            f"{fmt(r['measured_gib'])} GiB {r['error'] or ''}"
        )
    for r in result["gpu_train_run"]:
        out.append(
            f"run {r['model']}: {r['iterations']} it, loss {fmt(r['loss_first'])} -> {fmt(r['loss_last'])},"
            f" resume exact {r['resume_exact']}, generation ok {r['generation_ok']} {r['error'] or ''}"
        )
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--phase", default=",".join(PHASES), help=f"comma-separated, of {', '.join(PHASES)} (env always runs)"
    )
    p.add_argument("--out", required=False, help="folder for the results JSON and the log")
    p.add_argument(
        "--wheels", default=None, help="install the missing packages from these wheels first (offline)"
    )
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when available")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: checks every phase runs (CI, CPU)")
    p.add_argument(
        "--phase-budget",
        action="append",
        default=[],
        metavar="PHASE=SECONDS",
        help="override one phase's budget (repeatable); --budget still caps the command",
    )
    p.add_argument(
        "--budget",
        type=float,
        default=None,
        help=f"seconds for the whole command (default {DEFAULT_TOTAL_S}, smoke {SMOKE_TOTAL_S})",
    )
    p.add_argument(
        "--triton-tiles",
        default="auto",
        help="(train) tuned fused-kernel tiles: a JSON file, 'auto' (this command's kernels phase, else the "
        "newest results file of this GPU under benchmarks/results/ that has them) or 'none'",
    )
    p.add_argument("--child", choices=PHASES, default=None, help=argparse.SUPPRESS)
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)
    p.add_argument("--budget-s", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--roof", type=float, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child is None and not a.out:
        p.error("--out DIR is required")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before anything here or in a child queries CUDA
    if a.child:
        return child_main(a)
    selected = [p.strip() for p in a.phase.split(",") if p.strip()]
    unknown = [p for p in selected if p not in PHASES]
    if unknown:
        print(
            f"campaign: unknown phase(s) {', '.join(unknown)}; choose from {', '.join(PHASES)}",
            file=sys.stderr,
        )
        return 2
    phases = ["env"] + [p for p in PHASES[1:] if p in selected]
    try:
        overrides = {k: float(v) for k, v in (item.split("=", 1) for item in a.phase_budget)}
    except ValueError:
        overrides = {"?": 0.0}
    if not set(overrides) <= set(PHASES):
        print(
            f"campaign: --phase-budget takes PHASE=SECONDS, PHASE among {', '.join(PHASES)}", file=sys.stderr
        )
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    stamp = now.strftime("%Y%m%dT%H%M%SZ")
    log_path = out / f"campaign-{stamp}.log"
    log_file = log_path.open("a")

    def log(line: str) -> None:
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    started = time.monotonic()
    if a.wheels:
        install_wheels(Path(a.wheels), log)
    total = a.budget if a.budget is not None else (SMOKE_TOTAL_S if a.smoke else DEFAULT_TOTAL_S)
    result = schema.empty_result()
    result.update(
        date=now.isoformat(timespec="seconds"),
        git_revision=_git("rev-parse", "HEAD") or "unknown",
        git_dirty=bool(_git("status", "--porcelain", "--untracked-files=no")),
        smoke=bool(a.smoke),
    )
    tiles_file = Path(a.triton_tiles) if a.triton_tiles not in ("auto", "none") else None
    failed = False
    for i, phase in enumerate(phases):
        left = total - (time.monotonic() - started)
        budget = phase_budgets(phases[i:], left, a.smoke, overrides)[phase]
        if budget < MIN_PHASE_S / 2:
            result["phases"][phase] = {
                "status": "not run",
                "seconds": None,
                "error": "no time left in --budget",
            }
            continue
        part, seconds = run_child(phase, budget, a, result["bf16_matmul_tflops"], tiles_file, log)
        status, error = part.pop("_status", "failed"), part.pop("_error", None)
        result["phases"][phase] = {"status": status, "seconds": round(seconds, 1), "error": error}
        # A phase that raised fails the command; one cut short by its budget (partial, or killed as a
        # timeout on a slow machine) is reported, not fatal: the budget is what keeps CI bounded.
        failed |= status == "failed"
        for key, value in part.items():
            if key in result:
                result[key] = value
        if phase == "env" and result["device_type"] not in ("cuda", "cpu"):  # env failed: what we know
            import torch

            result["device_type"] = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
            result["device"] = result["device"] or f"unknown {result['device_type']} (env phase failed)"
        if phase == "env" and result["device_type"] == "cpu" and not a.smoke:
            log("campaign: no CUDA GPU here; a CPU run is a smoke test: add --smoke (and --device cpu)")
            break
        best = result["triton_best"] if phase == "kernels" else None
        if phase == "env" and a.triton_tiles == "auto" and "kernels" not in phases:
            best = kept_triton_best(REPO / "benchmarks" / "results", result["device"])
        if best and a.triton_tiles == "auto":
            tiles_file = out / f"triton-tiles-{stamp}.json"  # for the train phase of this command
            tiles_file.write_text(json.dumps(best))
    result = _clean(result)
    name = f"campaign-{slug(result['device'] or 'unknown')}-{stamp}.json"
    problems = schema.validate(result)
    (out / name).write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")
    for line in summary_lines(result):
        log(line)
    if problems:
        log("results do not follow the schema: " + "; ".join(problems[:5]))
    log(f"results: {out / name}  (log: {log_path}; {time.monotonic() - started:.0f}s)")
    log_file.close()
    row_errors = [
        r["error"]
        for t in ("attention", "train", "memory", "gpu_train_run")
        for r in result[t]
        if r.get("error") and not str(r["error"]).startswith("skipped")
    ]
    if a.smoke and (row_errors or (result["tests"] or {}).get("failed")):
        failed = True  # on a CPU every smoke row must work; on a GPU a failing row is a result
        for e in row_errors[:10]:
            print(f"smoke: row error: {e}", file=sys.stderr)
    return 1 if (failed or problems) else 0


if __name__ == "__main__":
    sys.exit(main())
