"""diffmeg/__init__.py: what importing diffmeg sets up for every entry point (the import-time noise of
megatron-core and torchao that says nothing about a run is dropped, and only that)."""

from __future__ import annotations

import importlib.util
import logging
import subprocess
import sys

import pytest
import torch

import diffmeg
from tests.conftest import REPO_ROOT


def _record(name: str, msg: str, args: tuple = ()) -> logging.LogRecord:
    return logging.LogRecord(name, logging.WARNING, __file__, 1, msg, args, None)


def _kept(record: logging.LogRecord) -> bool:
    return all(f.filter(record) for f in logging.getLogger(record.name).filters)


def test_torchao_import_lines_are_dropped_and_nothing_else(monkeypatch):
    so = "Failed to load /site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: Could not load"
    monkeypatch.setattr(torch.version, "cuda", None)  # a CPU build of torch: torchao's CUDA .so cannot load
    assert not _kept(_record("torchao", so))
    assert _kept(_record("torchao", "Skipping import of cpp extensions due to incompatible torch version"))
    monkeypatch.setattr(torch.version, "cuda", "12.8")  # a CUDA torch: a .so that fails is a real mismatch
    assert _kept(_record("torchao", so))

    deprecation = "%s is an Enum subclass and is now natively supported ... Calling register_constant() on"
    torchao_enum = type("KernelPreference", (), {"__module__": "torchao.quantization.quantize_.common"})
    other_enum = type("Mode", (), {"__module__": "somewhere_else"})
    assert not _kept(_record("torch.utils._pytree", deprecation, (torchao_enum,)))
    assert _kept(_record("torch.utils._pytree", deprecation, (other_enum,)))
    assert _kept(_record("torch.utils._pytree", "something else %s", (torchao_enum,)))
    assert diffmeg.__version__


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao is not installed")
def test_importing_transformers_models_after_diffmeg_is_silent():
    """transformers imports torchao with its model classes; in setup.sh's environment (PyPI's torchao, a
    CPU torch) that printed two "Failed to load ....so" lines and two torch deprecation lines."""
    code = "import diffmeg, transformers.modeling_utils, torchao; print('imported')"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and proc.stdout == "imported\n", proc.stderr[-3000:]
    assert "register_constant" not in proc.stderr, proc.stderr
    if torch.version.cuda is None:
        assert "Failed to load" not in proc.stderr, proc.stderr


def test_megatron_fusions_compile_at_their_first_call_not_at_import():
    """Importing the model code imports neither TorchDynamo nor Inductor (megatron-core's `jit_fuser` is
    torch.compile at a function's first call); that call compiles it and computes what the function does,
    and an enclosing torch.compile traces it inline, as it does a function torch.compile wrapped."""
    code = """
import sys
import diffmeg.model
import torch
import torch.nn.functional as F
from megatron.core import jit
from megatron.core.fusions.fused_bias_swiglu import bias_swiglu

print(sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules))
x, b = torch.randn(4, 8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
a, c = torch.chunk(x + b, 2, -1)
torch._dynamo.config.recompile_limit = 8
outer = torch.compile(lambda t: bias_swiglu(t, b) * 2, backend="eager", fullgraph=True)
print(torch.equal(outer(x), 2 * F.silu(a) * c))  # fullgraph: no break where bias_swiglu is called
print(torch.allclose(bias_swiglu(x, b), F.silu(a) * c), "torch._inductor" in sys.modules)
print(bias_swiglu.__name__, jit.jit_fuser.__name__)
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["[]", "True", "True True", "bias_swiglu _compile_on_first_call"]
