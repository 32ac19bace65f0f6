"""Where megatron-core 0.16.1 looks for apex's gradient-accumulation-fusion extension, and the patch.

With `config.gradient_accumulation_fusion`, megatron-core's linears add each weight gradient into
`weight.main_grad` (megatron-core DDP's gradient buffer) through apex's CUDA extension
`fused_weight_gradient_mlp_cuda` (`wgrad_gemm_accum_fp32`, `wgrad_gemm_accum_fp16`). It looks for it in two
places, and `patch_grad_accum_fusion` points both at another implementation (`diffmeg.fusions.grad_accum`,
which stands above this floor and passes itself in):
- `tensor_parallel/layers.py` imports it at import time into the module attribute
  `fused_weight_gradient_mlp_cuda` and records `_grad_accum_fusion_available`, which `ColumnParallelLinear`
  and `RowParallelLinear` check at init and whose functions `LinearWithGradAccumulationAndAsyncCommunication`
  calls in backward;
- `utils.py`'s `drain_embedding_wgrad_compute` (the output layer's deferred weight gradients under pipeline
  parallelism) imports it by name inside the function, which only an entry in `sys.modules` reaches.

`tests/compat/test_grad_accum.py` checks that these names and call sites are still there, so a megatron-core
upgrade that moves them fails loudly instead of leaving the patch dead. Where apex's extension is installed,
nothing is patched: megatron-core already uses it.
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from diffmeg.errors import DiffmegError

EXTENSION = "fused_weight_gradient_mlp_cuda"
"""apex's extension module, as megatron-core imports it."""
FUNCTIONS = ("wgrad_gemm_accum_fp32", "wgrad_gemm_accum_fp16")
"""The functions megatron-core calls on it: (total_input, grad_output, main_grad) -> None."""
LAYERS = "megatron.core.tensor_parallel.layers"
AVAILABLE_FLAG = "_grad_accum_fusion_available"
"""The module flag of `LAYERS` that the parallel linears check at init."""
UTILS = "megatron.core.utils"


def apex_grad_accum_available() -> bool:
    """apex's extension is importable here (then megatron-core uses it as it is)."""
    module = sys.modules.get(EXTENSION)
    if module is not None:
        return getattr(module, "__diffmeg_grad_accum__", False) is False
    return importlib.util.find_spec(EXTENSION) is not None


def grad_accum_patched() -> bool:
    """megatron-core's linears use an implementation passed to `patch_grad_accum_fusion`."""
    layers = sys.modules.get(LAYERS)
    extension = getattr(layers, EXTENSION, None) if layers is not None else None
    return bool(getattr(extension, "__diffmeg_grad_accum__", False))


def patch_grad_accum_fusion(extension: ModuleType) -> bool:
    """Make megatron-core's gradient-accumulation fusion call `extension`'s `FUNCTIONS` where apex's
    extension is absent; returns whether it patched (False: apex's is there and stays). Idempotent."""
    missing = [name for name in FUNCTIONS if not callable(getattr(extension, name, None))]
    if missing:
        raise TypeError(f"{extension!r} lacks {', '.join(missing)}")
    if apex_grad_accum_available():
        return False
    # megatron-core loads only when patched (after runtime.setup() set TORCHDYNAMO_DISABLE on CPU)
    import megatron.core.tensor_parallel.layers as layers

    if not hasattr(layers, AVAILABLE_FLAG):
        raise DiffmegError(
            f"megatron-core's {LAYERS} no longer has {AVAILABLE_FLAG}: diffmeg/compat/grad_accum.py needs "
            "revisiting for this megatron-core; leave out --gradient-accumulation-fusion meanwhile"
        )
    extension.__diffmeg_grad_accum__ = True  # type: ignore[attr-defined]  (ours, not apex's)
    setattr(layers, EXTENSION, extension)
    setattr(layers, AVAILABLE_FLAG, True)
    sys.modules[EXTENSION] = extension  # utils.drain_embedding_wgrad_compute's import inside the function
    return True
