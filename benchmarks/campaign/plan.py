"""What each campaign phase runs (GPU sizes, or tiny CPU ones for the smoke run) and its time budget."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from benchmarks.campaign import schema

PHASES = schema.PHASES
# Seconds per phase on a GPU, and in a CPU smoke run; --budget caps the sum of those selected.
PHASE_BUDGET_S = {"env": 60, "tests": 180, "kernels": 300, "train": 420, "memory": 420}
SMOKE_BUDGET_S = {"env": 20, "tests": 25, "kernels": 30, "train": 60, "memory": 90}  # train: + the levers
# 7 minutes: three commands, each with its own 1-2 minute machine start (and 30 s warm unless handed
# back), fit the 30 minutes of device time a session gets (docs/gpu.md, "GPU time").
DEFAULT_TOTAL_S = 420
SMOKE_TOTAL_S = 225  # CI: about 2 minutes of work on 2 idle cores; a slower machine skips rows, never hangs
MIN_PHASE_S = 30  # kept back for each phase still to come
CHILD_MARGIN_S = 20  # a phase stops starting new work this long (at most 15%) before its budget ends
# Where the `gpu`-marked tests live (tests/benchmarks/campaign/test_plan.py fails if one is added elsewhere),
# in the order pytest runs them: the CUDA-path confirmations first, the ~70 kernel compilations last.
GPU_TEST_PATHS = (
    "tests/test_gpu_readiness.py",
    "tests/fusions/test_grad_accum.py",
    "tests/distributed/test_te_cp.py",
    "tests/kernels",
)
# pytest-xdist workers on a GPU machine (where xdist is installed): kernels compile in parallel, and a
# test that crashes its worker is one failure instead of the end of the run.
GPU_TEST_WORKERS = 4


@dataclass(frozen=True)
class Lever:
    """One speed lever of the train phase's matrix: the same model timed with `off` then `on` flags, side by
    side in one process; its gain is tokens/s on over off. A new fused path is one more entry."""

    name: str
    arch: str
    """Which model of the plan runs it: "diff" (Plan.train_diff) or "transformer" (its baseline)."""
    on: tuple[str, ...]
    """pretrain_diff.py flags with the lever pulled."""
    off: tuple[str, ...]
    """Its twin's flags: everything else the same."""
    note: str = ""


DIST_OPT = ("--use-distributed-optimizer",)
OVERLAP = ("--overlap-grad-reduce", "--overlap-param-gather")


FUSED_OPS = (
    ("torch norm", ("--norm-impl", "torch")),
    ("fused loss", ("--cross-entropy-loss-fusion",)),
)
"""The fused-op candidates of the registry (docs/implementations.md) that both models take: name, flags."""
GRAPH_OPS = (
    ("compiled layers", ("--compile-layers",)),
    ("local CUDA graphs", ("--cuda-graph-impl", "local")),
    ("cuDNN attention first", ("--sdpa-backend", "cudnn")),
)
"""Whole-layer options (`diffmeg.training.graphs`, `diffmeg.kernels.sdpa_backends`), each alone on both
models: not in the fast path until measured (CUDA graphs and compiled layers exclude each other)."""
GRAD_ACCUM = ("grad-accum fusion", ("--gradient-accumulation-fusion",))
"""Weight gradients added into DDP's fp32 main_grad inside their GEMM (`diffmeg.fusions.grad_accum`);
torchao's FP8 refuses it, so the FP8 lever runs the fast path without it."""
FP8 = ("--fp8-format", "hybrid", "--fp8-recipe", "tensorwise")
"""torchao's float8 training on the local spec (no Transformer Engine on the GPU machine)."""


def levers(backends: tuple[str, ...], loss_chunk: int, fused_ops: bool = True) -> tuple[Lever, ...]:
    """The lever matrix: each DIFF attention backend against the first of `backends`, the chunked loss
    (`loss_chunk` tokens a chunk), the fused optimizer, the distributed optimizer and its overlap; with
    `fused_ops` (a GPU: bf16, so the fused loss and FP8 can run) each fused-op candidate, the grad-accum
    fusion and each graph option (compiled layers, local CUDA graphs, cuDNN attention first) on both
    models, the fused ops together (the headline: the fast path against today's) and FP8."""
    base = ("--diff-attn-backend", backends[0])
    out = [Lever(f"attention {b} vs {backends[0]}", "diff", (base[0], b), base) for b in backends[1:]]
    out += [
        Lever("chunked loss", "diff", (*base, "--cross-entropy-chunk-size", str(loss_chunk)), base,
              "a memory option: its gain is below 1"),
        Lever("fused optimizer", "diff", (*base, "--optimizer-impl", "fused"),
              (*base, "--optimizer-impl", "megatron")),
        Lever("distributed optimizer", "diff", (*base, *DIST_OPT), base),
        Lever("overlapped communication", "diff", (*base, *DIST_OPT, *OVERLAP), (*base, *DIST_OPT),
              "one GPU: DP=1, so overlap can only show its overhead here, not its gain"),
    ]  # fmt: skip
    if not fused_ops:
        return (*out, Lever("torch norm", "diff", (*base, *FUSED_OPS[0][1]), base))  # the mechanism, cheaply
    every = (*(flag for _, flags in FUSED_OPS for flag in flags), "--optimizer-impl", "fused")
    for arch, extra in (("diff", base), ("transformer", ())):
        out += [Lever(f"{name} ({arch})", arch, (*extra, *flags), extra)
                for name, flags in (*FUSED_OPS, GRAD_ACCUM)]  # fmt: skip
        out += [Lever(f"{name} ({arch})", arch, (*extra, *flags), extra, "GPU graph option, measured alone")
                for name, flags in GRAPH_OPS]  # fmt: skip
        fast = (*extra, *every)
        every_op = (*fast, *GRAD_ACCUM[1])
        out.append(Lever(f"every fused op ({arch})", arch, every_op, extra, "the fast path against today's"))
        fp8_note = "torchao, tensorwise; without the grad-accum fusion, which torchao's FP8 refuses"
        out.append(Lever(f"FP8 on the fast path ({arch})", arch, (*fast, *FP8), fast, fp8_note))
    return tuple(sorted(out, key=lever_priority))  # stable: the rest keep their order


HEADLINE_LEVERS = ("every fused op (diff)", "every fused op (transformer)")
"""Timed first: the fast path against today's is what the issue's goals are judged on (the Transformer's
MFU, DIFF V1's tokens/s ratio), so a command cut by its budget has measured them."""


def lever_priority(lever: Lever) -> int:
    """Run order of the lever matrix: the headline levers, then FP8 (its gain is a goal too), the rest."""
    if lever.name in HEADLINE_LEVERS:
        return HEADLINE_LEVERS.index(lever.name)
    return len(HEADLINE_LEVERS) + (0 if lever.name.startswith("FP8") else 1)


@dataclass(frozen=True)
class FullDepth:
    """The full-depth 3B rows (GPU only): the whole model where its memory plan fits, else the largest cut
    of `fallback_layers` that does; many micro-batches a step so the optimizer step is amortized."""

    models: tuple[str, ...]
    seq: int
    microbatches: int
    fallback_layers: tuple[int, ...]
    amortize_dp: int
    """The optimizer step is also reported as a data-parallel run of this many ranks sees it: the
    distributed optimizer's shard is 1/amortize_dp of it (`tokens_per_s_amortized`)."""


@dataclass(frozen=True)
class Plan:
    """Sizes and repetitions of every phase (GPU_PLAN on a GPU, SMOKE_PLAN for the CPU smoke run)."""

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
    """(heads, kv heads, head dim, seqs) of other layouts: SDPA's split-V path against the baseline there."""
    train_diff: str
    train_layers: tuple[int, ...]
    """Layer counts to try, largest first: the first whose memory plan fits is used."""
    train_seqs: tuple[int, ...]
    train_backends: tuple[str, ...]
    train_levers: tuple[Lever, ...]
    """The lever matrix, timed at the first length after the rows above (off twin, then on)."""
    train_full_depth: FullDepth | None
    """The full 28-layer 3B where it fits (GPU only; None in the smoke run)."""
    train_profile: bool
    """One more step of each row at the first length (not the variants) under torch.profiler: where the
    step's time goes (benchmarks/step_profile.py), the question a low MFU raises."""
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
    """pretrain_diff.py flags of the save/resume runs: --deterministic-mode, since resume_exact compares
    losses bit for bit (cuBLAS workspace, deterministic embedding and reductions)."""
    run_data: str
    """The runs' data: "builtin" (the embedded English corpus, where a cl100k_base file is found: its loss
    falls within 50 iterations, which uniform random ids never let it do) or "mock" (no tokenizer)."""
    gen_tokens: int


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
    train_backends=("sdpa",),
    train_levers=levers(("sdpa", "sdpa_split_v_batched"), loss_chunk=1024),
    train_full_depth=FullDepth(
        models=("transformer-3b", "diff-3b"),
        seq=4096,
        microbatches=16,
        fallback_layers=(4, 8),
        amortize_dp=64,
    ),
    train_profile=True,
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
    run_args=("--bf16", "--lr-warmup-iters", "5", "--deterministic-mode"),
    run_data="builtin",
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
    train_levers=levers(("sdpa", "reference"), loss_chunk=16, fused_ops=False),
    train_full_depth=None,
    train_profile=True,
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
        "--deterministic-mode",
    ),
    run_data="mock",  # vocabulary 256: the smoke checks the plumbing, not learning
    gen_tokens=4,
)


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


def device_of(a: argparse.Namespace) -> str:
    """The device the phases run on: --device, else cuda when available."""
    import torch

    return a.device or ("cuda" if torch.cuda.is_available() else "cpu")
