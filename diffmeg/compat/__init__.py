"""The few places megatron-core 0.16.1 assumes CUDA, handled for CPU runs (`cpu`, inactive when CUDA exists),
and where it assumes apex's gradient-accumulation-fusion extension (`grad_accum`, patched on request)."""

from diffmeg.compat.cpu import (
    apply_cpu_compat,
    cpu_compat_active,
    graph_safe_rng_is_te,
    model_parallel_manual_seed,
)

__all__ = ["apply_cpu_compat", "cpu_compat_active", "graph_safe_rng_is_te", "model_parallel_manual_seed"]
