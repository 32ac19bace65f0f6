"""The FP8 linear converter's spec rewrite (diffmeg.fusions.fp8): every local linear of a layer spec is
replaced at any depth, the input spec stays as it was, and everything else is left alone."""

from __future__ import annotations

import pytest
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from diffmeg.fusions.fp8 import TransformerEngineFp8, replace_modules
from diffmeg.layer_specs import get_diff_layer_local_spec
from tests.builders import make_config, make_v2_config


class _Column(ColumnParallelLinear):
    """Stands in for an FP8 column-parallel linear."""


class _Row(RowParallelLinear):
    """Stands in for an FP8 row-parallel linear."""


def _classes(node, found: list[type]) -> list[type]:
    import dataclasses

    if isinstance(node, type):
        found.append(node)
    elif hasattr(node, "module") and hasattr(node, "submodules"):
        _classes(node.module, found)
        _classes(node.submodules, found)
    elif isinstance(node, list):
        for item in node:
            _classes(item, found)
    elif dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            _classes(getattr(node, f.name), found)
    return found


@pytest.mark.parametrize("config", [make_config, make_v2_config], ids=["v1", "v2"])
def test_every_linear_is_replaced_at_any_depth_and_the_input_is_kept(config):
    spec = get_diff_layer_local_spec(config(2, 1, 8))
    before = _classes(spec, [])
    swapped = replace_modules(spec, {ColumnParallelLinear: _Column, RowParallelLinear: _Row})
    after = _classes(swapped, [])
    assert _classes(spec, []) == before  # a copy was converted
    assert ColumnParallelLinear not in after and RowParallelLinear not in after
    # QKV and fc1 (V2: and the lambda projection) are column-parallel; proj and fc2 row-parallel
    assert after.count(_Column) == before.count(ColumnParallelLinear) >= 2
    assert after.count(_Row) == before.count(RowParallelLinear) == 2
    others = [c for c in before if c not in (ColumnParallelLinear, RowParallelLinear)]
    assert [c for c in after if c not in (_Column, _Row)] == others


def test_the_converter_needs_an_fp8_format():
    from diffmeg.errors import DiffmegError

    with pytest.raises(DiffmegError, match="needs an FP8 format: set --fp8-format"):
        TransformerEngineFp8(make_config())
