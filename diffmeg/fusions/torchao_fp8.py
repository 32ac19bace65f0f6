"""FP8 linears without Transformer Engine: torchao's float8 training on megatron-core's parallel linears.

A converter (torchtitan's idea): the local layer spec is rewritten before the model is built, so nothing is
swapped inside a built model and checkpoints keep their keys. The Transformer Engine spec needs none: its
linears are TE's already, and megatron-core runs them in FP8 from the model config (`fp8`, `fp8_recipe`).

torchao scales each operand per tensor from its current amax and multiplies in FP8 through
`torch._scaled_mm` (Ada/Hopper and newer); with `emulate` the same casts run and the product is taken in
high precision, which is how the CPU tests check the numerics. megatron-core's `ColumnParallelLinear` and
`RowParallelLinear` keep their parameters, communication and checkpoint keys here: only the matmul on the
local shard changes. The column layer's input is gathered over the sequence (SP) or copied into the
tensor-parallel region (its gradient all-reduced) by megatron-core's own mappings before torchao's
matmul; the row layer's output reduction stays in megatron-core's `forward`.

Which linears convert: the layer's QKV, output projection and MLP (`FP8_LINEARS`); DIFF V2's lambda
projection (a few outputs per token, a sigmoid gate) and the vocabulary projection stay in bf16. Its rules
(where it runs, the recipe, recomputation, the grad-accum fusion) are `check_fp8`'s, read by the flags'
validation and by the converter.
"""

from __future__ import annotations

import copy
import dataclasses
from functools import cache

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from diffmeg.errors import DiffmegError

FP8_LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""The spec fields whose linears compute in FP8 (megatron-core's names for QKV, out-proj, fc1, fc2)."""

MIN_CAPABILITY = (8, 9)
"""`torch._scaled_mm`'s FP8 needs compute capability 8.9 (Ada) or newer (Hopper: 9.0)."""


def torchao_available() -> bool:
    """True when torchao's float8 training imports here."""
    try:
        import torchao.float8  # noqa: F401  (optional dependency)
    except ImportError:
        return False
    return True


def fp8_unsupported_reason(emulate: bool) -> str | None:
    """Why torchao's FP8 cannot run on this machine, in one line with the fix; None when it can."""
    if not torchao_available():
        return "FP8 on the local spec needs torchao (pip install torchao); leave out --fp8-format"
    if torch.cuda.is_available():
        capability = torch.cuda.get_device_capability()
        if capability < MIN_CAPABILITY and not emulate:
            name = torch.cuda.get_device_name()
            return (
                f"FP8 matmuls need a GPU of compute capability 8.9+ (Ada, Hopper); {name} is "
                f"{capability[0]}.{capability[1]}: leave out --fp8-format"
            )
        return None
    if not emulate:
        return (
            "FP8 needs a CUDA GPU (Ada/Hopper or newer; Transformer Engine's FP8 on its spec, torchao's on "
            "the local spec); on CPU only emulation runs (DiffTransformerConfig.fp8_emulate, tests): leave "
            "out --fp8-format"
        )
    return None


def check_fp8(
    recipe: object,
    recompute_granularity: str | None,
    recompute_modules: list[str] | None,
    gradient_accumulation_fusion: bool,
    emulate: bool,
) -> None:
    """Every rule of torchao's FP8 on the local spec, one line each: read by the flags' validation (before a
    GPU is held) and by `TorchaoFp8` (configs built in code). The machine first (`fp8_unsupported_reason`),
    then the recipe: torchao scales per tensor; recomputation: megatron-core recomputes FP8 layers through
    TE's checkpoint; the grad-accum fusion: torchao's linears write `weight.grad`, out of its reach, so the
    flag is refused rather than silently applied to the few linears left in bf16."""
    reason = fp8_unsupported_reason(emulate)
    if reason is not None:
        raise DiffmegError(reason)
    if str(recipe) not in ("tensorwise", "Fp8Recipe.tensorwise"):
        raise DiffmegError(
            "--fp8-format on the local spec is torchao's FP8, which scales per tensor: add --fp8-recipe "
            "tensorwise"
        )
    if recompute_granularity == "full" or (
        recompute_granularity == "selective" and "mlp" in (recompute_modules or ())
    ):
        raise DiffmegError(
            "megatron-core recomputes FP8 layers through Transformer Engine's checkpoint: with torchao's "
            "FP8 use --recompute-granularity selective (attention core) or none"
        )
    if gradient_accumulation_fusion:
        raise DiffmegError(
            "torchao's FP8 linears (--fp8-format on the local spec) write weight.grad, not main_grad: leave "
            "out --gradient-accumulation-fusion, or use Transformer Engine's FP8 (--transformer-impl "
            "transformer_engine)"
        )


@cache
def float8_settings(fp8_format: str, emulate: bool) -> tuple[object, object]:
    """torchao's (Float8LinearConfig, LinearMMConfig) for megatron-core's `fp8` format: `e4m3` casts every
    operand to e4m3; `hybrid` keeps e4m3 forward and casts the output gradient to e5m2 (wider range)."""
    from torchao.float8.config import CastConfig, Float8LinearConfig  # optional dependency
    from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

    if fp8_format not in ("e4m3", "hybrid"):
        raise DiffmegError(f"unknown FP8 format {fp8_format!r}; choose --fp8-format e4m3 or hybrid")
    grad = CastConfig(target_dtype=torch.float8_e5m2 if fp8_format == "hybrid" else torch.float8_e4m3fn)
    config = Float8LinearConfig(emulate=emulate, cast_config_grad_output=grad)
    gemms = (config.gemm_config_output, config.gemm_config_grad_input, config.gemm_config_grad_weight)
    pad = config.pad_inner_dim
    mm = LinearMMConfig(*(ScaledMMConfig(emulate, g.use_fast_accum, False, pad) for g in gemms))
    return config, mm


def float8_linear(x: torch.Tensor, weight: torch.Tensor, fp8_format: str, emulate: bool) -> torch.Tensor:
    """`x @ weight.t()` with both operands (and, backward, the output gradient) cast to FP8 per tensor.
    x: [s, b, in]; weight: [out, in]; returns [s, b, out] in x's dtype."""
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args  # optional dependency

    config, mm = float8_settings(fp8_format, emulate)
    return matmul_with_hp_or_float8_args.apply(x, weight.t(), mm, config)


def _float8_forward(
    layer: ColumnParallelLinear | RowParallelLinear,
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    allreduce_dgrad: bool = False,
    sequence_parallel: bool = False,
    tp_group: torch.distributed.ProcessGroup | None = None,
    **_: object,
) -> torch.Tensor:
    """megatron-core's `_forward_impl` contract (the local shard's product, with the column layer's
    input communication) over torchao's FP8 matmul. The weight's gradient reaches `weight.grad`, which
    megatron-core's DDP hook adds to `main_grad`."""
    if sequence_parallel:  # [s/tp, b, h] -> [s, b, h]; backward: reduce-scatter
        input = gather_from_sequence_parallel_region(input, group=tp_group)
    elif allreduce_dgrad:  # identity; backward: all-reduce the input gradient over TP
        input = copy_to_tensor_model_parallel_region(input, group=tp_group)
    emulate = bool(getattr(layer.config, "fp8_emulate", False))
    output = float8_linear(input, weight, layer.config.fp8, emulate)  # [s, b, out / tp]
    return output if bias is None else output + bias


class Float8ColumnParallelLinear(ColumnParallelLinear):
    """megatron-core's column-parallel linear whose local product is torchao's FP8 matmul."""

    def _forward_impl(self, input: torch.Tensor, weight: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if not weight.requires_grad:  # frozen: megatron-core's own path
            return super()._forward_impl(input, weight, *args, **kwargs)
        return _float8_forward(self, input, weight, *args, **kwargs)


class Float8RowParallelLinear(RowParallelLinear):
    """megatron-core's row-parallel linear whose local product is torchao's FP8 matmul (the output's
    reduction over TP, or reduce-scatter under SP, stays megatron-core's)."""

    def _forward_impl(self, input: torch.Tensor, weight: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if not weight.requires_grad:
            return super()._forward_impl(input, weight, *args, **kwargs)
        return _float8_forward(self, input, weight, *args, **kwargs)


def replace_modules(spec: ModuleSpec, swap: dict[type, type]) -> ModuleSpec:
    """A deep copy of `spec` with every module class that is a key of `swap` replaced by its value, at any
    depth of the spec's submodules."""
    spec = copy.deepcopy(spec)

    def visit(node: object) -> object:
        if isinstance(node, type):
            return swap.get(node, node)
        if isinstance(node, ModuleSpec):
            node.module = visit(node.module)
            node.submodules = visit(node.submodules)
            return node
        if isinstance(node, list):
            return [visit(item) for item in node]
        if dataclasses.is_dataclass(node):
            for f in dataclasses.fields(node):
                setattr(node, f.name, visit(getattr(node, f.name)))
        return node

    return visit(spec)


class TorchaoFp8:
    """The local spec's FP8 converter: the layer's QKV, output projection and MLP linears become the
    `Float8*ParallelLinear`s above (tensorwise scaling, `config.fp8` e4m3 or hybrid)."""

    def __init__(self, config: TransformerConfig) -> None:
        if config.fp8 is None:
            raise DiffmegError("the FP8 converter needs an FP8 format: set --fp8-format e4m3 or hybrid")
        check_fp8(
            config.fp8_recipe,
            config.recompute_granularity,
            config.recompute_modules,
            config.gradient_accumulation_fusion,
            emulate=bool(getattr(config, "fp8_emulate", False)),
        )
        self.config = config

    def convert(self, spec: ModuleSpec) -> ModuleSpec:
        swap = {ColumnParallelLinear: Float8ColumnParallelLinear, RowParallelLinear: Float8RowParallelLinear}

        def visit(node: object) -> object:
            if isinstance(node, ModuleSpec):
                node.submodules = visit(node.submodules)
            elif isinstance(node, list):
                return [visit(item) for item in node]
            elif dataclasses.is_dataclass(node) and not isinstance(node, type):
                for f in dataclasses.fields(node):
                    value = getattr(node, f.name)
                    if f.name in FP8_LINEARS:
                        setattr(node, f.name, replace_modules(value, swap))
                    else:
                        setattr(node, f.name, visit(value))
            return node

        return visit(copy.deepcopy(spec))  # the input spec stays as it was
