"""What each campaign phase runs (GPU sizes, or tiny CPU ones for the smoke run) and its time budget."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from benchmarks.campaign import schema
from diffmeg import registry

PHASES = schema.PHASES
# Seconds per phase on a GPU, and in a CPU smoke run; --budget caps the sum of those selected.
PHASE_BUDGET_S = {"env": 60, "tests": 180, "kernels": 300, "train": 420, "memory": 420}
SMOKE_BUDGET_S = {"env": 20, "tests": 25, "kernels": 30, "train": 90, "memory": 90}
DEFAULT_TOTAL_S = 420
SMOKE_TOTAL_S = 255  # CI: about 2 minutes of work on 2 idle cores; a slower machine skips rows, never hangs
# One lent GPU (docs/gpu.md, "The two commands"): 15 minutes of device time a session, the machine's start
# included. `--lent-gpu` runs the env and train phases in one command of LENT_GPU_S, and with --continue
# the runs that command did not reach in one of LENT_CONTINUE_S; `--plan` estimates both and must stay
# within DEVICE_PLAN_MAX_S (what is left of the 900 s covers the copies between the calls and giving back).
LENT_GPU_S = 510
LENT_CONTINUE_S = 180
DEVICE_START_S = 120  # a machine's start, counted against the session
DEVICE_PLAN_MAX_S = 780
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


# The fast path: the GPU candidates of the implementation table (`diffmeg.registry.levers`,
# docs/implementations.md: a row marked as a lever joins here by itself) and megatron-core's own switches, in
# the order their leave-one-out runs are timed (tests/test_registry.py checks every lever row is timed).
FAST_PATH = (
    *registry.levers("sdpa_kernel"),
    ("compiled layers", ("--compile-layers",)),
    ("fused loss", ("--cross-entropy-loss-fusion",)),
    *registry.levers("norm"),
    *registry.levers("optimizer"),
    ("grad-accum fusion", ("--gradient-accumulation-fusion",)),
)
ATTENTION_CANDIDATES = tuple(flags[1] for _, flags in registry.levers("diff_attention"))
"""DIFF V1's attention backends timed on the fast path against its own `sdpa`."""


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
    train_models: tuple[str, ...]
    """The Transformer, DIFF V1 and (where given) DIFF V2 presets, cut to the layers that fit."""
    train_layers: tuple[int, ...]
    """Layer counts to try, largest first: the first at which two models (the pair being timed) fit 85% of
    the GPU by the memory plan is used."""
    train_seqs: tuple[int, ...]
    train_fast: tuple[tuple[str, tuple[str, ...]], ...]
    """The fast path: every lever expected to win, (name, pretrain_diff.py flags), in the order its
    leave-one-out runs are timed."""
    train_fp8: tuple[str, ...] | None
    """FP8 flags tried on the fast path (GPU only: None in the smoke run)."""
    train_backends: tuple[str, ...]
    """DIFF V1 attention backends timed on the fast path against its own (`sdpa`)."""
    train_graphs: tuple[str, ...] | None
    """Flags that take the compiled layers' place in a comparison (CUDA graphs; they exclude each other)."""
    train_leave_out: tuple[tuple[str, str], ...] | None
    """(arch, fast lever) pairs timed as leave-one-out runs; None: every lever of the fast path, DIFF V1's
    first, then the Transformer's (the grad-accum fusion's runs with FP8 already)."""
    train_profile: bool
    """One more step of each model's fast path at the first length under torch.profiler: where the step's
    time goes (benchmarks/step_profile.py), the question a low MFU raises."""
    train_tokens_per_microbatch: int
    train_microbatches: int
    train_window_steps: int
    """Optimizer steps in one timed window."""
    train_windows: int
    """Timed windows of each twin in a comparison (at least two), alternated off, on, off, on, ..."""
    train_warmup_steps: int
    """Steps of a model's first window after its build (compilation, cuDNN's heuristics, the allocator,
    CUDA graphs' capture): recorded, never in a gain."""
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
    train_models=("transformer-3b", "diff-3b", "diff2-3b", "gda-3b"),
    train_layers=(8, 6, 4, 2),
    train_seqs=(4096, 2048),
    train_fast=FAST_PATH,
    train_fp8=("--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"),
    train_backends=ATTENTION_CANDIDATES,
    train_graphs=("--cuda-graph-impl", "local"),
    train_leave_out=None,
    train_profile=True,
    train_tokens_per_microbatch=4096,
    train_microbatches=4,
    train_window_steps=2,
    train_windows=3,
    train_warmup_steps=4,  # past megatron-core's 3 CUDA-graph warm-up steps: the graphs are captured in it
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
    train_models=("transformer-tiny", "diff-tiny"),
    train_layers=(2,),
    train_seqs=(64,),
    train_fast=(("torch norm", ("--norm-impl", "torch")), ("fused optimizer", ("--optimizer-impl", "fused"))),
    train_fp8=None,
    train_backends=(),
    train_graphs=None,
    train_leave_out=(),  # the anchor and its partners are the models' own comparisons here
    train_profile=True,
    train_tokens_per_microbatch=64,
    train_microbatches=1,
    train_window_steps=1,
    train_windows=2,
    train_warmup_steps=1,
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
