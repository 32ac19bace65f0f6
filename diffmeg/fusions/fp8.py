"""FP8 linears as a converter: a rewrite of the layer spec before the model is built (torchtitan's idea).

A converter takes the model config (its `fp8` format and recipe, megatron-core's fields) and turns a layer
spec into one whose linears compute in FP8; the model is then built from the converted spec, so nothing
is swapped inside a built model and checkpoints keep their keys. Two converters exist, one per spec:
Transformer Engine's (here), whose linears run in FP8 inside megatron-core's FP8 context when `config.fp8`
is set, and torchao's on the local spec (`diffmeg.fusions.torchao_fp8`). Where one cannot run, it refuses
in one line. A new FP8 implementation (a Triton GEMM) is a class with this interface and one entry in
`diffmeg.registry`'s `fp8_linear` slot.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Protocol

from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from diffmeg.errors import DiffmegError
from diffmeg.runtime import transformer_engine_available


class LinearConverter(Protocol):
    """Rewrites a layer spec so its linears compute in a lower precision; built once per model."""

    def __init__(self, config: TransformerConfig) -> None: ...

    def convert(self, spec: ModuleSpec) -> ModuleSpec:
        """A converted copy of `spec` (the input stays as it was)."""
        ...


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


class TransformerEngineFp8:
    """Transformer Engine's FP8 linears: megatron-core's local column/row-parallel linears become TE's (the
    Transformer Engine spec has them already), which megatron-core runs in `config.fp8` (e4m3 / hybrid)
    with `config.fp8_recipe`."""

    def __init__(self, config: TransformerConfig) -> None:
        if config.fp8 is None:
            raise DiffmegError("the FP8 converter needs an FP8 format: set --fp8-format e4m3 or hybrid")
        if not transformer_engine_available():
            raise DiffmegError(
                "FP8 linears need Transformer Engine on a CUDA GPU (pip install transformer-engine); "
                "leave out --fp8-format here"
            )
        self.config = config

    def convert(self, spec: ModuleSpec) -> ModuleSpec:
        from megatron.core.extensions.transformer_engine import (  # optional GPU dependency
            TEColumnParallelLinear,
            TERowParallelLinear,
        )

        return replace_modules(
            spec, {ColumnParallelLinear: TEColumnParallelLinear, RowParallelLinear: TERowParallelLinear}
        )
