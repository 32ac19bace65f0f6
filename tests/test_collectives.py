"""Small collectives go through diffmeg.collectives, which puts their tensors on the backend's
device (issue 17, item 1: a CPU tensor all-reduced under NCCL stops every GPU run after its first step)."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest
import torch

from diffmeg import collectives
from diffmeg.errors import DiffmegError
from tests.conftest import REPO_ROOT


@pytest.mark.parametrize(
    "backend,device",
    [("nccl", "cuda"), ("gloo", "cpu"), ("mpi", "cpu"), ("cpu:gloo,cuda:nccl", "cuda")],
)
def test_device_follows_the_backend(monkeypatch, backend, device):
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: backend)
    assert collectives.collective_device().type == device


def test_small_collectives_make_their_tensor_on_the_backend_device(monkeypatch, single_rank_parallel_state):
    """Under NCCL the reduced tensor is made on the accelerator (the meta device stands in for CUDA here)."""
    seen = []
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(collectives, "_cuda", lambda: torch.device("meta"))
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, op=None, group=None: seen.append(t.device))
    collectives.all_reduce([1.0, 2.0])
    collectives.all_reduce(torch.ones(2))  # a CPU tensor is moved to the backend's device first
    assert seen == [torch.device("meta")] * 2


def test_small_collectives_reduce_under_gloo(single_rank_parallel_state):
    assert collectives.all_reduce([1.5, 2.0]).tolist() == [1.5, 2.0]
    assert collectives.any_rank(True) and not collectives.any_rank(False)


def test_rank0_verdict_reaches_every_rank(single_rank_parallel_state):
    collectives.on_rank0(lambda: None)

    def bad():
        raise DiffmegError("--save /x is not writable")

    with pytest.raises(DiffmegError, match="not writable"):
        collectives.on_rank0(bad)


# --------------------------------------------------------------------------------------------------
# No module reduces a freshly made tensor itself.

COLLECTIVES = {
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "send",
    "recv",
    "isend",
    "irecv",
}
FACTORIES = {"tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "from_numpy"}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


def _is_factory(node: ast.AST) -> bool:
    """`torch.tensor(...)`, `torch.zeros(...)`, ... (also with a trailing `.cuda()`/`.to(...)`: the
    device is then whatever the code guessed, not the backend's)."""
    if not isinstance(node, ast.Call):
        return False
    name = _dotted(node.func)
    if name.startswith("torch.") and name.split(".")[-1] in FACTORIES:
        return True
    return isinstance(node.func, ast.Attribute) and _is_factory(node.func.value)


def fresh_tensor_collectives(source: str) -> list[str]:
    """Calls of torch.distributed collectives (any alias of the module) on a tensor made in the same
    function by a torch factory: `function:line` for each."""
    tree = ast.parse(source)
    aliases = {"torch.distributed"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch" and node.level == 0:
            aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
    found = []
    for func in ast.walk(tree):
        if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        fresh = {
            target.id
            for node in ast.walk(func)
            if isinstance(node, ast.Assign) and _is_factory(node.value)
            for target in node.targets
            if isinstance(target, ast.Name)
        }
        for node in ast.walk(func):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            if node.func.attr not in COLLECTIVES or _dotted(node.func.value) not in aliases:
                continue
            args = list(node.args) + [k.value for k in node.keywords if k.arg in ("tensor", "tensor_list")]
            if any(_is_factory(a) or (isinstance(a, ast.Name) and a.id in fresh) for a in args):
                found.append(f"{func.name}:{node.lineno}")
    return found


# The defect the rule exists for (diffmeg/training/loop.py before the Trainer): the scan must flag it.
OLD_SIGNAL_FLAG = """
import torch
import torch.distributed as dist

class _SignalFlag:
    def any_rank(self) -> bool:
        t = torch.tensor([1.0 if self.received else 0.0])
        torch.distributed.all_reduce(t)
        return bool(t.item() > 0)

def share(value):
    t = torch.tensor([value, 1.0], dtype=torch.float64)
    if torch.cuda.is_available():
        t = t.cuda()
    dist.all_reduce(t)

def fine(grads, group):
    flat = torch.cat(grads)
    torch.distributed.all_reduce(flat, group=group)
"""


def test_the_scan_flags_a_fresh_cpu_tensor():
    assert sorted(fresh_tensor_collectives(textwrap.dedent(OLD_SIGNAL_FLAG))) == ["any_rank:8", "share:15"]


def test_no_module_reduces_a_fresh_tensor_directly():
    helper = Path(collectives.__file__).resolve()
    offenders = []
    for path in sorted((REPO_ROOT / "diffmeg").rglob("*.py")):
        if path.resolve() == helper:
            continue
        offenders += [
            f"{path.relative_to(REPO_ROOT)}:{hit}" for hit in fresh_tensor_collectives(path.read_text())
        ]
    assert not offenders, f"use diffmeg.collectives for these small collectives: {offenders}"
