"""The two whole-layer graph options of a training run, applied to a built model from outside its code.

- `--compile-layers`: every megatron-core `TransformerLayer` of the model chunks goes through
  `torch.compile` (static shapes), torchtitan's way: the model code stays eager single-device code and
  the option wraps its blocks once built (`compile_layers`, called by `build_training_objects`).
  `nn.Module.compile` keeps each layer the same module (parameter names, checkpoints, DDP hooks unchanged).
- `--cuda-graph-impl local`: megatron-core's own per-layer CUDA graphs. They are the model config's
  fields (`diffmeg.model.transformer_config` sets `cuda_graph_impl`) and a graph-safe RNG tracker
  (`diffmeg.compat.model_parallel_manual_seed`); what this module holds is the check of where they can
  run (`cuda_graphs_unsupported_reason`), which the arguments call.

Both are GPU options measured by the campaign's lever matrix; the combinations that cannot work are
refused in `diffmeg.training.arguments`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from megatron.core.tensor_parallel.layers import RowParallelLinear
from megatron.core.transformer.transformer_layer import TransformerLayer

RECOMPILE_HEADROOM = 8
"""Recompilations allowed beyond one per layer (a training and an evaluation mode, a shape change)."""


def transformer_layers(chunks: list[torch.nn.Module]) -> list[TransformerLayer]:
    """The megatron-core transformer layers of these model chunks, in order."""
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, TransformerLayer)]


def _pass_own_tp_group(linear: RowParallelLinear) -> None:
    """megatron-core 0.16.1's `RowParallelLinear.forward` hands its matmul `tp_group=None`, which looks the
    group up again and, on rank 0, calls `warnings.warn` every forward: a graph break dynamo cannot
    reorder, twice a layer (attention's and the MLP's output projections). The layer's own group is the
    group that lookup returns, so passing it changes nothing but the break."""
    impl: Callable[..., torch.Tensor] = linear._forward_impl

    def forward_impl(*args, **kwargs) -> torch.Tensor:
        if kwargs.get("tp_group") is None:
            kwargs["tp_group"] = linear.tp_group
        return impl(*args, **kwargs)

    linear._forward_impl = forward_impl


def compile_layers(chunks: list[torch.nn.Module], backend: str = "inductor") -> int:
    """Wrap every transformer layer of `chunks` in `torch.compile(dynamic=False)`; returns how many.
    `backend`: torch.compile's (the tests trace with `aot_eager`, the same graphs without code generation).

    Each layer is compiled for its own constants (its layer number, DIFF's layer-wise lambda_init), so
    dynamo compiles once per layer: its recompile limit is raised to the layer count (plus
    `RECOMPILE_HEADROOM`), else layers past the default limit (8) would silently run eager. One graph
    a layer, no graph break (DIFF V1, DIFF V2 and the baseline on the local spec, measured on CPU with
    `torch._dynamo.explain`: tests/training/test_graphs.py keeps the count).
    """
    layers = transformer_layers(chunks)
    limit = 2 * len(layers) + RECOMPILE_HEADROOM  # training and no-grad evaluation of each layer
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
    for layer in layers:
        for linear in layer.modules():
            if isinstance(linear, RowParallelLinear):
                _pass_own_tp_group(linear)
        layer.compile(dynamic=False, backend=backend)
    return len(layers)


def compile_no_effect_reason() -> str | None:
    """Why `compile_layers` would leave the layers eager here, or None: without CUDA `diffmeg.runtime.setup`
    disables torch.compile for the whole process (megatron-core's own compiled fusions cost ~20 s each
    on a CPU), and a disabled torch.compile runs the wrapped layers as they are."""
    if not torch.cuda.is_available():
        return "diffmeg disables torch.compile on a machine without CUDA (diffmeg.runtime.setup)"
    return None


def cuda_graphs_unsupported_reason() -> str | None:
    """Why megatron-core's local CUDA graphs cannot run on this machine, or None."""
    if not torch.cuda.is_available():
        return "CUDA graphs need a GPU and this machine has no CUDA"
    return None
