"""transformer_config: megatron-core's fused softmax only where its CUDA extension can be imported; the
offline readers' RunConfig (from an args.json) builds the config the training run's does."""

from __future__ import annotations

import importlib.util

import torch

from diffmeg import model
from diffmeg.run_config import RunConfig
from diffmeg.training.arguments import resolve_args


def _config_of(args):
    """The model config of flat arguments, as the offline readers build it (a RunConfig first)."""
    return model.transformer_config(RunConfig.from_args(args, partial=True))


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
    return _config_of(args)


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
    assert _config_of(resolve_args(argv, world_size=1)).deterministic_mode is False
    args = resolve_args([*argv, "--deterministic-mode"], world_size=1)
    assert _config_of(args).deterministic_mode is True
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        runtime.make_deterministic()
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
        assert runtime.os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(False)


def _comparable(config) -> dict:
    """A model config's plain fields (megatron-core makes callables such as `init_method` anew)."""
    import dataclasses

    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return {name: value for name, value in values.items() if not callable(value)}


def test_a_run_and_its_args_json_build_the_same_config(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    argv = ["--model", "diff2-tiny", "--mock-data", "--bf16", "--cross-entropy-chunk-size", "64"]
    argv += ["--tie-embeddings-and-output-weights", "--deterministic-mode"]
    run = RunConfig.from_args(resolve_args(argv))
    typed = model.transformer_config(run)
    assert typed.diff_version == 2 and typed.cross_entropy_chunk_size == 64 and typed.deterministic_mode
    assert _comparable(typed) == _comparable(_config_of(run.to_args()))


def test_saved_arguments_older_than_a_flag_build_what_those_runs_built(monkeypatch):
    """An args.json written before --diff-version, --cp-comm-type, --tie-..., --deterministic-mode,
    --cross-entropy-chunk-size and interleaving existed: upgrade_saved_args gives it what those runs did."""
    import argparse

    from diffmeg.checkpoints import SAVED_ARGS_DEFAULTS, single_rank_args, upgrade_saved_args

    monkeypatch.setenv("WORLD_SIZE", "1")
    args = resolve_args(["--model", "diff-tiny", "--mock-data"])
    old = argparse.Namespace(**{k: v for k, v in vars(args).items() if k not in SAVED_ARGS_DEFAULTS})
    upgraded = upgrade_saved_args(old)
    assert {name: getattr(upgraded, name) for name in SAVED_ARGS_DEFAULTS} == SAVED_ARGS_DEFAULTS
    assert not hasattr(old, "diff_version")  # a copy: the saved arguments stay as read
    built = _config_of(single_rank_args(old))
    spelled = argparse.Namespace(**{**vars(args), **SAVED_ARGS_DEFAULTS})  # today's run, flags as then
    assert _comparable(built) == _comparable(_config_of(single_rank_args(spelled)))
    assert built.cp_comm_type is None and args.cp_comm_type is not None  # megatron-core's default then
    # a value the checkpoint did save wins over the default
    assert upgrade_saved_args({**vars(old), "diff_version": 2}).diff_version == 2


def test_saved_arguments_of_flags_that_left_build_the_eager_model(monkeypatch):
    """An args.json of a run with --rope-impl compiled / --diff-epilogue-impl compiled (flags that left:
    `--compile-layers` is the one compile strategy) reads as today's run: the keys are dropped."""
    from diffmeg.checkpoints import RETIRED_SAVED_ARGS, single_rank_args, upgrade_saved_args

    monkeypatch.setenv("WORLD_SIZE", "1")
    args = resolve_args(["--model", "diff-tiny", "--mock-data"])
    saved = {**vars(args), "rope_impl": "compiled", "diff_epilogue_impl": "compiled"}
    upgraded = upgrade_saved_args(saved)
    assert not any(hasattr(upgraded, name) for name in RETIRED_SAVED_ARGS)
    assert _comparable(_config_of(single_rank_args(upgraded))) == _comparable(
        _config_of(single_rank_args(args))
    )
