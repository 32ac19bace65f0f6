"""The streaming checkpoint writer produces what a training run's save of the same weights produces: the
same keys, shapes, dtypes and chunks in the metadata, the same extra states and common state, every tensor
bit for bit through the training-side loader; and it refuses incomplete or inconsistent input."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

from diffmeg.conversion.mcore_writer import StreamingCheckpointWriter, part_of
from diffmeg.errors import DiffmegError

SHAPES = {  # a few layers, a small vocabulary: every kind of tensor, quickly
    "diff": ["--model", "diff-tiny", "--num-layers", "3", "--vocab-size", "512"],
    "diff-gqa": [
        "--model", "diff-tiny", "--num-layers", "2", "--vocab-size", "512",
        "--group-query-attention", "--num-query-groups", "2",
    ],
    "transformer": ["--model", "transformer-tiny", "--num-layers", "3", "--vocab-size", "512"],
    "diff2-tied": [
        "--model", "diff2-tiny", "--num-layers", "2", "--vocab-size", "512",
        "--tie-embeddings-and-output-weights",
    ],
}  # fmt: skip


def tiny_args(name: str):
    from diffmeg.training.arguments import resolve_args

    return resolve_args(SHAPES[name], world_size=1)


def random_model(args, dtype: torch.dtype) -> torch.nn.Module:
    """pretrain_diff.py's single-rank model with its norms moved off 1 (an unfilled norm would show)."""
    from diffmeg.checkpoints import build_single_rank_model

    model = build_single_rank_model(args, dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return model


def training_save(root: Path, model: torch.nn.Module, args) -> None:
    """The checkpoint `pretrain_diff.py`'s writer makes of `model` (weights only, iteration 0)."""
    from diffmeg.checkpoints import WEIGHTS_ONLY_KEY
    from tests.saves import write_checkpoint

    state = {
        "model": model.sharded_state_dict(),
        "iteration": 0,
        "consumed_samples": 0,
        "layout": {"tp": args.tensor_model_parallel_size, "pp": args.pipeline_model_parallel_size, "dp": 1},
        "args": json.dumps(vars(args), default=str),
        WEIGHTS_ONLY_KEY: True,
    }
    write_checkpoint(str(root), 0, state, args)


def streamed_save(root: Path, model: torch.nn.Module, args, dtype: torch.dtype) -> None:
    """The same weights through the streaming writer, one part per call, layers in reverse order."""
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    parts: dict = {}
    for name, tensor in params.items():
        parts.setdefault(part_of(name), {})[name] = tensor
    writer = StreamingCheckpointWriter(str(root), args, dtype)
    for part in sorted(
        parts, key=lambda p: (isinstance(p, int), p if isinstance(p, int) else 0), reverse=True
    ):
        writer.write(parts.pop(part))
    writer.close()


def storage_metadata(path: Path) -> dict:
    from torch.distributed.checkpoint import FileSystemReader

    out = {}
    for key, meta in FileSystemReader(str(path)).read_metadata().state_dict_metadata.items():
        if hasattr(meta, "chunks"):
            chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in meta.chunks)
            out[key] = (tuple(meta.size), meta.properties.dtype, meta.properties.requires_grad, chunks)
        else:
            out[key] = "bytes"
    return out


def stored_objects(path: Path, keys) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    objects = {key: io.BytesIO() for key in keys}
    dcp.load(objects, storage_reader=FileSystemReader(str(path)), no_dist=True)
    return objects


@pytest.mark.parametrize(
    "name, dtype",
    [
        ("diff", torch.float32),
        ("diff-gqa", torch.bfloat16),
        ("transformer", torch.bfloat16),
        ("diff2-tied", torch.float32),  # no output layer: the embedding serves
    ],
)
def test_streamed_checkpoint_equals_a_training_save(single_rank_parallel_state, tmp_path, name, dtype):
    from megatron.core import dist_checkpointing

    from diffmeg.checkpoints import load_model_weights

    args = tiny_args(name)
    model = random_model(args, dtype)
    training_save(tmp_path / "trained", model, args)
    streamed_save(tmp_path / "streamed", model, args, dtype)
    ours, theirs = tmp_path / "streamed" / "iter_0000000", tmp_path / "trained" / "iter_0000000"

    meta = storage_metadata(theirs)
    assert storage_metadata(ours) == meta  # keys, global shapes, dtypes, chunks; extra states as objects
    byte_keys = [k for k, v in meta.items() if v == "bytes"]
    assert byte_keys and stored_objects(ours, byte_keys) == stored_objects(theirs, byte_keys)
    plain_ours, plain_theirs = (dist_checkpointing.load_plain_tensors(str(p)) for p in (ours, theirs))
    tensor_keys = [k for k, v in meta.items() if v != "bytes"]
    for key in tensor_keys:
        a, b = plain_ours[key], plain_theirs[key]
        assert a.dtype == b.dtype == dtype and torch.equal(
            a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)
        ), key
    common = {p: torch.load(p / "common.pt", weights_only=False) for p in (ours, theirs)}
    assert common[ours] == common[theirs] and common[ours]["weights_only"] is True
    for file in ("args.json", "metadata.json"):
        assert (ours / file).read_text() == (theirs / file).read_text(), file
    assert (tmp_path / "streamed" / "latest_checkpointed_iteration.txt").read_text() == "0"

    # The training-side loader (fp32 model, every key strict) gives the source weights back exactly.
    loaded, _ = load_model_weights(str(tmp_path / "streamed"))
    state = loaded.state_dict()
    for pname, param in model.named_parameters():
        assert torch.equal(state[pname], param.detach().float()), pname


def test_incomplete_or_inconsistent_parts_are_refused(single_rank_parallel_state, tmp_path):
    args = tiny_args("diff")
    model = random_model(args, torch.float32)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    layer0 = {n: t for n, t in params.items() if part_of(n) == 0}
    writer = StreamingCheckpointWriter(str(tmp_path / "ckpt"), args, torch.float32)
    incomplete = dict(layer0)
    incomplete.pop("decoder.layers.0.mlp.linear_fc2.weight")
    with pytest.raises(
        DiffmegError, match="no converted tensor for parameter 'decoder.layers.0.mlp.linear_fc2.weight'"
    ):
        writer.write(incomplete)
    with pytest.raises(DiffmegError, match="shape mismatch for 'output_layer.weight'"):
        writer.write({"output_layer.weight": torch.zeros(256, 512)})
    with pytest.raises(DiffmegError, match="has no parameter in the model"):
        writer.write({"decoder.layers.7.mlp.linear_fc2.weight": torch.zeros(1)})
    writer.write(layer0)
    with pytest.raises(DiffmegError, match="part 0 of the checkpoint was written already"):
        writer.write(layer0)
    with pytest.raises(DiffmegError, match="was never written"):
        writer.close()


def test_parts():
    assert part_of("decoder.layers.12.self_attention.linear_qkv.weight") == 12
    assert part_of("decoder.layers.0.mlp.linear_fc1._extra_state") == 0
    assert part_of("decoder.final_layernorm.weight") == "decoder.final_layernorm"
    assert part_of("embedding.word_embeddings.weight") == "embedding"
    assert part_of("output_layer.weight") == "output_layer"
