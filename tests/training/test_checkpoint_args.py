"""--use-checkpoint-args (diffmeg.training.checkpoint_args): the model's shape and tokenizer from the
checkpoint a run starts from (--load's latest, else --pretrained-checkpoint's); typed flags win."""

from __future__ import annotations

import pytest

from diffmeg.errors import DiffmegError
from diffmeg.training.arguments import resolve_args
from tests.training.helpers import fake_checkpoint

SHAPE = {
    "num_layers": 3, "hidden_size": 64, "ffn_hidden_size": 96, "num_attention_heads": 4,
    "num_query_groups": 2, "group_query_attention": True, "kv_channels": 16, "seq_length": 48,
    "max_position_embeddings": 96, "vocab_size": 320, "rotary_base": 5000.0, "norm_epsilon": 1e-6,
    "diff_attention": True, "diff_version": 2, "lambda_init": "exp", "tokenizer_type": "null",
    "tokenizer_model": None,
}  # fmt: skip


def _checkpoint(root, iteration: int, **values) -> str:
    fake_checkpoint(root, iteration, {**SHAPE, "lr": 9.0, **values})
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return str(root)


def test_shape_from_the_pretrained_checkpoint_then_from_load(tmp_path):
    pretrained = _checkpoint(tmp_path / "up", 0)
    run = ["--use-checkpoint-args", "--mock-data", "--lr", "1e-3", "--train-iters", "1"]
    args = resolve_args([*run, "--pretrained-checkpoint", pretrained, "--load", str(tmp_path / "run")])
    assert {k: getattr(args, k) for k in SHAPE if k != "tokenizer_model"} == {
        k: v for k, v in SHAPE.items() if k != "tokenizer_model"
    }
    assert args.lr == 1e-3  # training values are the run's own
    args = resolve_args(
        [*run, "--pretrained-checkpoint", pretrained, "--seq-length", "32", "--num-layers", "3"]
    )
    assert args.seq_length == 32  # typed flags win
    resumed = _checkpoint(tmp_path / "run", 7, seq_length=64)  # a resumed run reads its own checkpoint
    assert resolve_args([*run, "--pretrained-checkpoint", pretrained, "--load", resumed]).seq_length == 64
    with pytest.raises(DiffmegError, match="--use-checkpoint-args needs a checkpoint to read"):
        resolve_args([*run, "--load", str(tmp_path / "empty")])


def test_tied_output_layer_is_carried_and_a_typed_untie_wins(tmp_path):
    """A tied checkpoint's tie comes with its shape (an args.json without the field means untied); a typed
    --untie-embeddings-and-output-weights wins (the run then refuses that checkpoint, naming the fix)."""
    from diffmeg.run_config import RunConfig
    from diffmeg.training.checkpointing import CheckpointManager

    run = ["--use-checkpoint-args", "--mock-data", "--lr", "1e-3", "--train-iters", "1"]
    tied = _checkpoint(tmp_path / "tied", 0, tie_embeddings_and_output_weights=True)
    untied = _checkpoint(tmp_path / "untied", 0)  # saved before the flag existed
    assert resolve_args([*run, "--pretrained-checkpoint", tied]).tie_embeddings_and_output_weights is True
    assert resolve_args([*run, "--pretrained-checkpoint", untied]).tie_embeddings_and_output_weights is False
    for given, source, fix in (
        (["--untie-embeddings-and-output-weights"], tied, "add --tie-embeddings-and-output-weights"),
        (["--tie-embeddings-and-output-weights"], untied, "drop --tie-embeddings-and-output-weights"),
    ):
        args = resolve_args([*run, "--pretrained-checkpoint", source, *given], world_size=1)
        manager = CheckpointManager(RunConfig.from_args(args), log=lambda line: None)
        with pytest.raises(DiffmegError, match=fix) as error:
            manager.resolve()
        assert str(error.value).startswith(f"checkpoint {source}/iter_0000000 holds a model")
    manager = CheckpointManager(
        RunConfig.from_args(resolve_args([*run, "--pretrained-checkpoint", tied], world_size=1)), log=print
    )
    manager.resolve()  # the same tying: nothing to say


def test_a_checkpoint_of_another_shape_names_the_flags_never_another_iteration(tmp_path):
    """--load a run of 3 layers with --num-layers 2: every iteration has 3 layers, so the fix is the
    checkpoint's values or --use-checkpoint-args, never --ckpt-step."""
    from diffmeg.run_config import RunConfig
    from diffmeg.training.checkpointing import CheckpointManager

    _checkpoint(tmp_path / "run", 3)  # an earlier iteration beside the latest
    root = _checkpoint(tmp_path / "run", 5)
    flags = ["--mock-data", "--lr", "1e-3", "--train-iters", "9", "--load", root, "--use-checkpoint-args"]
    args = resolve_args([*flags, "--num-layers", "2", "--hidden-size", "128"], world_size=1)
    manager = CheckpointManager(RunConfig.from_args(args), log=lambda line: None)
    with pytest.raises(DiffmegError) as error:
        manager.resolve()
    assert str(error.value) == (
        f"checkpoint {root}/iter_0000005 holds a model of another shape: --num-layers 3 (this run: 2), "
        "--hidden-size 64 (this run: 128); pass the checkpoint's values, or --use-checkpoint-args to take "
        "its shape from its args.json"
    )
    manager = CheckpointManager(RunConfig.from_args(resolve_args(flags, world_size=1)), log=lambda line: None)
    assert manager.resolve().iteration == 5  # its own shape: nothing to say


def test_a_checkpoint_of_another_mlp_names_its_activation(tmp_path):
    """A Motif import (PolyNorm) loaded by a SwiGLU run: its weights would be dropped without a word."""
    from diffmeg.run_config import RunConfig
    from diffmeg.training.checkpointing import CheckpointManager

    root = _checkpoint(tmp_path / "run", 5, mlp_activation="poly_norm")
    flags = ["--mock-data", "--lr", "1e-3", "--train-iters", "9", "--load", root]
    shape = ["--num-layers", "3", "--hidden-size", "64"]
    args = resolve_args([*flags, "--use-checkpoint-args", *shape, "--mlp-activation", "swiglu"], world_size=1)
    with pytest.raises(DiffmegError) as error:
        CheckpointManager(RunConfig.from_args(args), log=lambda line: None).resolve()
    assert "--mlp-activation poly_norm (this run: swiglu)" in str(error.value)
    args = resolve_args([*flags, "--use-checkpoint-args"], world_size=1)
    assert args.mlp_activation == "poly_norm"
    assert CheckpointManager(RunConfig.from_args(args), log=lambda line: None).resolve().iteration == 5
