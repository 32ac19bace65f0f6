"""config_from_args: megatron-core's fused softmax only where its CUDA extension can be imported."""

from __future__ import annotations

import importlib.util

import torch

from diffmeg import model
from diffmeg.training.arguments import resolve_args


def _config(monkeypatch, cuda: bool, modules: bool):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name in model.FUSED_SOFTMAX_MODULES:
            return object() if modules else None
        return real_find_spec(name, *args, **kwargs)

    monkeypatch.setenv("WORLD_SIZE", "1")
    args = resolve_args(["--model", "transformer-tiny", "--mock-data", "--bf16"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(model.importlib.util, "find_spec", find_spec)
    return model.config_from_args(args)


def test_fused_softmax_off_on_a_gpu_without_the_extension(monkeypatch):
    """A GPU without Megatron-LM's/apex's softmax kernels (the campaign's H100): the unfused softmax."""
    assert _config(monkeypatch, cuda=True, modules=False).masked_softmax_fusion is False


def test_fused_softmax_on_where_the_extension_imports(monkeypatch):
    assert _config(monkeypatch, cuda=True, modules=True).masked_softmax_fusion is True
    assert _config(monkeypatch, cuda=False, modules=True).masked_softmax_fusion is False
