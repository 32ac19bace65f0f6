"""The gradient-accumulation-fusion patch (`diffmeg/compat/grad_accum.py`): every megatron-core name and call
site it exists for is still there, so an upgrade that moves one fails here, not as a dead patch."""

from __future__ import annotations

import importlib
import inspect
import types

import pytest

from diffmeg.compat import grad_accum

CALL_SITES = {
    grad_accum.LAYERS: (
        f"import {grad_accum.EXTENSION}",
        f"{grad_accum.AVAILABLE_FLAG} = False",
        f"config.gradient_accumulation_fusion and not {grad_accum.AVAILABLE_FLAG}",
        *(f"{grad_accum.EXTENSION}.{name}(" for name in grad_accum.FUNCTIONS),
    ),
    grad_accum.UTILS: (
        f"    import {grad_accum.EXTENSION}\n",  # in a function: sys.modules reaches it
        *(f"{grad_accum.EXTENSION}.{name}(" for name in grad_accum.FUNCTIONS),
    ),
}


@pytest.mark.parametrize("module", sorted(CALL_SITES))
def test_call_sites_still_exist(module):
    source = inspect.getsource(importlib.import_module(module))
    for needle in CALL_SITES[module]:
        assert needle in source, (
            f"{module} no longer contains {needle!r}: revisit diffmeg/compat/grad_accum.py"
        )


def test_the_flag_the_patch_sets_exists():
    layers = importlib.import_module(grad_accum.LAYERS)
    assert isinstance(getattr(layers, grad_accum.AVAILABLE_FLAG), bool)


def test_an_extension_without_the_functions_is_refused():
    with pytest.raises(TypeError, match="lacks wgrad_gemm_accum_fp16"):
        grad_accum.patch_grad_accum_fusion(types.SimpleNamespace(wgrad_gemm_accum_fp32=print))
