"""--use-checkpoint-args (diffmeg.training.checkpoint_args): the model's shape and tokenizer from the
checkpoint a run starts from (--load's latest, else --pretrained-checkpoint's); typed flags win."""

from __future__ import annotations

import json

import pytest

from diffmeg.errors import DiffmegError
from diffmeg.training.arguments import resolve_args

SHAPE = {
    "num_layers": 3, "hidden_size": 64, "ffn_hidden_size": 96, "num_attention_heads": 4,
    "num_query_groups": 2, "group_query_attention": True, "kv_channels": 16, "seq_length": 48,
    "max_position_embeddings": 96, "vocab_size": 320, "rotary_base": 5000.0, "norm_epsilon": 1e-6,
    "diff_attention": True, "diff_version": 2, "lambda_init": "exp", "tokenizer_type": "null",
    "tokenizer_model": None,
}  # fmt: skip


def _checkpoint(root, iteration: int, **values) -> str:
    (root / f"iter_{iteration:07d}").mkdir(parents=True)
    (root / f"iter_{iteration:07d}" / "args.json").write_text(json.dumps({**SHAPE, "lr": 9.0, **values}))
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
