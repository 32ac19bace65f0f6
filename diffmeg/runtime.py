"""Process setup, done explicitly by every entry point (pretrain_diff.py, tools, benchmarks, tests).

Building a model never changes the process behind the caller's back: `setup()` installs the CPU
workarounds for megatron-core (only where CUDA is absent) once, and `single_process()` gives a tool the
one-rank torch.distributed group and megatron-core parallel state that its checkpoint and model code
need. `diffmeg.model.build_model` refuses to run before `setup()`.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from diffmeg.compat import apply_cpu_compat, model_parallel_manual_seed

_SETUP_DONE = False


def setup() -> None:
    """Prepare this process for megatron-core: on a machine without CUDA, install the CPU patches
    (`diffmeg.compat`) and disable torch.compile of megatron-core's fusions. Idempotent."""
    global _SETUP_DONE
    if _SETUP_DONE:
        return

    if not torch.cuda.is_available():
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    apply_cpu_compat()
    _SETUP_DONE = True


def is_setup() -> bool:
    """True once `setup()` ran in this process."""
    return _SETUP_DONE


def single_process(seed: int = 1234) -> None:
    """`setup()`, then torch.distributed (world size 1) and megatron-core's TP=PP=1 state, seeded.

    For tools that run as one process (conversion, generation, evaluation): an in-process store, not
    the environment, so a tool started inside a torchrun or Slurm job never tries to join it. Reuses a
    group that already exists (tests share one per session).
    """
    # megatron-core loads only once a caller needs it: its import compiles fusions, so setup()'s
    # TORCHDYNAMO_DISABLE must come first on CPU
    from megatron.core import parallel_state

    setup()
    if not torch.distributed.is_initialized():
        if parallel_state.model_parallel_is_initialized():  # groups of a process group since destroyed
            parallel_state.destroy_model_parallel()
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        torch.distributed.init_process_group(
            backend, store=torch.distributed.HashStore(), rank=0, world_size=1
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
        model_parallel_manual_seed(seed)


def make_deterministic() -> None:
    """--deterministic-mode: cuBLAS's fixed-size workspace (set before its first handle; the variable
    wins if already set) and torch's deterministic kernels, warning where an op has none. The model's
    config carries `deterministic_mode` for megatron-core's own choices (transformer_config)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)


def teardown() -> None:
    """Destroy megatron-core's parallel state and the process group (tests run several jobs per process)."""
    # megatron-core loads only once a caller needs it: its import compiles fusions, so setup()'s
    # TORCHDYNAMO_DISABLE must come first on CPU
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def transformer_engine_available() -> bool:
    """Transformer Engine is usable here: it imports and CUDA exists (its modules refuse to build on CPU)."""
    return importlib.util.find_spec("transformer_engine") is not None and torch.cuda.is_available()
