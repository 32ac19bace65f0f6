"""CPU workarounds for megatron-core 0.16.1, in one place and only when CUDA is absent.

Each patch names the megatron-core call sites it exists for; `tests/compat/test_cpu.py` checks that
those call sites are still there, so an upgrade that moves them fails loudly instead of silently.
Nothing here runs on a machine with CUDA.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator

import torch
import torch.utils._device

_APPLIED = False

# torch factories megatron-core calls with device="cuda" / torch.cuda.current_device():
# pipeline schedules (total_num_tokens), optimizer (found_inf, grad scale), clip_grads, dist-ckpt,
# param_and_grad_buffer, utils.GlobalMemoryBuffer, p2p recv buffers.
_FACTORIES = (
    "zeros",
    "ones",
    "empty",
    "full",
    "tensor",
    "arange",
    "empty_like",
    "zeros_like",
    "ones_like",
    "full_like",
)


def cpu_compat_active() -> bool:
    """True once the CPU patches are installed in this process."""
    return _APPLIED


def _names_cuda(device: object) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)  # a CUDA ordinal


def _redirect_cuda(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(factory)
    def wrapper(*args, **kwargs):
        if _names_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        kwargs.pop("pin_memory", None)  # pinning needs CUDA (RoPE's CP slicing pins a CPU index)
        return factory(*args, **kwargs)

    wrapper.__diffmeg_cpu_patch__ = True  # type: ignore[attr-defined]
    return wrapper


def _cpu_causal_mask(sq: int) -> torch.Tensor:
    """megatron-core's default causal mask ([sq, sq], True = masked), built on CPU."""
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def apply_cpu_compat() -> bool:
    """Install the CPU patches if CUDA is unavailable; returns whether they are active. Idempotent."""
    global _APPLIED
    if _APPLIED or torch.cuda.is_available():
        return _APPLIED
    # megatron-core's fusions are compiled at their first call (diffmeg/__init__.py); on CPU each would
    # cost ~20 s to compile, so torch.compile is off for the process.
    if "torch._dynamo" in sys.modules:
        torch._dynamo.config.disable = True
    else:  # read by torch._dynamo.config when something imports it (the import alone costs ~2 s)
        os.environ["TORCH_COMPILE_DISABLE"] = "1"
    # ~50 call sites use torch.cuda.current_device() as a device (RoPE, attention buffers, TP mappings).
    torch.cuda.current_device = lambda: torch.device("cpu")
    # `with torch.device(...)` recognises factories by identity from a cached set: fill that cache with
    # the real functions first, or meta-device construction (transformers' from_pretrained) breaks.
    torch.utils._device._device_constructors()
    for name in _FACTORIES:
        setattr(torch, name, _redirect_cuda(getattr(torch, name)))
    torch.Tensor.cuda = lambda self, *a, **k: self
    # p2p communication and the async dist-ckpt writer synchronise the CUDA stream.
    torch.cuda.synchronize = lambda *a, **k: None
    # optimizer.py, distrib_optimizer.py and clip_grads.py compare Tensor.type() to 'torch.cuda.*Tensor'.
    original_type = torch.Tensor.type

    def tensor_type(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = original_type(self)
            if self.device.type == "cpu" and name.startswith("torch.") and not name.startswith("torch.cuda."):
                return "torch.cuda." + name[len("torch.") :]
            return name
        return original_type(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = tensor_type
    # Activation recompute snapshots and restores the CUDA RNG state.
    # megatron-core's modules load only when patched (after setup() set TORCHDYNAMO_DISABLE)
    import megatron.core.tensor_parallel.random as mpu_random

    mpu_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mpu_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    # The default causal mask is created with device="cuda" (imported by name into fused_softmax);
    # loaded here, as above, after TORCHDYNAMO_DISABLE.
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.transformer.utils as transformer_utils

    transformer_utils.get_default_causal_mask = _cpu_causal_mask
    fused_softmax.get_default_causal_mask = _cpu_causal_mask
    _APPLIED = True
    return True


class CpuRNGStatesTracker:
    """Named RNG streams on the CPU generator, API-compatible with megatron-core's CUDA tracker."""

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._is_initialized = False

    def is_initialized(self) -> bool:
        return self._is_initialized

    def reset(self) -> None:
        self.states_, self.seeds_, self._is_initialized = {}, set(), False

    def get_states(self) -> dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self.states_.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_ or name in self.states_:
            raise RuntimeError(f"RNG stream {name!r} or seed {seed} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        saved = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str | None = None) -> Iterator[None]:
        # megatron-core loads only where used (after setup() set TORCHDYNAMO_DISABLE)
        import megatron.core.tensor_parallel.random as mpu_random

        name = name or mpu_random._MODEL_PARALLEL_RNG_TRACKER_NAME
        if name not in self.states_:
            raise RuntimeError(f"RNG stream {name!r} is not added")
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)


def graph_safe_rng_is_te() -> bool:
    """The graph-safe RNG tracker CUDA graphs need is Transformer Engine's where TE is installed (as
    Megatron-LM chooses), else megatron-core's own tracker in its graph-safe mode."""
    return importlib.util.find_spec("transformer_engine") is not None


def model_parallel_manual_seed(seed: int, cuda_graphs: bool = False) -> None:
    """Seed the default and model-parallel RNG streams (megatron-core's function needs CUDA RNG).

    `cuda_graphs`: megatron-core's local CUDA graphs capture dropout's RNG, so its tracker must be a
    graph-safe one (`graph_safe_rng_is_te`), made anew: a tracker made earlier (another run in this
    process) may not be one. CUDA only: a CPU has no CUDA graphs (the arguments refuse them there)."""
    # megatron-core's modules load only when used (after setup() set TORCHDYNAMO_DISABLE)
    import megatron.core.tensor_parallel.random as mpu_random
    from megatron.core import parallel_state
    from megatron.core import tensor_parallel as mpu_tp

    if torch.cuda.is_available():
        mpu_tp.model_parallel_cuda_manual_seed(
            seed,
            te_rng_tracker=cuda_graphs and graph_safe_rng_is_te(),
            use_cudagraphable_rng=cuda_graphs,
            force_reset_rng=cuda_graphs,
        )
        return
    tracker = CpuRNGStatesTracker()
    mpu_random._CUDA_RNG_STATE_TRACKER = tracker
    mpu_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    torch.manual_seed(seed)
    # Same offsets as megatron-core's model_parallel_cuda_manual_seed.
    tracker.add(mpu_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(
        mpu_random._MODEL_PARALLEL_RNG_TRACKER_NAME,
        seed + 2718 + parallel_state.get_tensor_model_parallel_rank(),
    )
    tracker.add(
        mpu_random._EXPERT_PARALLEL_RNG_TRACKER_NAME,
        seed
        + 1024
        + 100 * parallel_state.get_expert_model_parallel_rank()
        + parallel_state.get_expert_tensor_parallel_rank(),
    )
