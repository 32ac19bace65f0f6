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


def test_deterministic_mode_reaches_the_model_config_and_torch(monkeypatch):
    """--deterministic-mode: megatron-core's config (its deterministic embedding) and torch's kernels."""
    from diffmeg import runtime

    argv = ["--model", "diff-tiny", "--mock-data"]
    assert model.config_from_args(resolve_args(argv, world_size=1)).deterministic_mode is False
    args = resolve_args([*argv, "--deterministic-mode"], world_size=1)
    assert model.config_from_args(args).deterministic_mode is True
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        runtime.make_deterministic()
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
        assert runtime.os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(False)
