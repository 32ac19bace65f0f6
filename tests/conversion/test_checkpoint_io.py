"""Streaming checkpoint reads and writes: any TP/PP layout reads back as the same model, in its own dtype."""

from __future__ import annotations

import json

import pytest
import torch

from diffmeg.checkpoints import build_single_rank_model
from diffmeg.conversion.checkpoint_io import McoreCheckpointReader, fill_model
from diffmeg.conversion.hf_config import layout_from_args
from diffmeg.conversion.mapping import HF_LAYER_PREFIX, mcore_globals_to_hf, mcore_layer_to_hf
from diffmeg.errors import DiffmegError
from tests.conversion.helpers import trained_tiny


def exported_tensors(root) -> dict[str, torch.Tensor]:
    """What mcore-to-hf writes for a checkpoint, computed in memory."""
    reader = McoreCheckpointReader(str(root))
    layout = layout_from_args(reader.args)
    reader.check(layout)
    out = mcore_globals_to_hf(reader.read_globals(layout), layout)
    for i in range(layout.num_layers):
        out.update(
            {
                HF_LAYER_PREFIX.format(i) + k: v
                for k, v in mcore_layer_to_hf(reader.read_layer(layout, i), layout).items()
            }
        )
    return out


@pytest.fixture(scope="module")
def tp1(tmp_path_factory):
    return trained_tiny(tmp_path_factory, "tp1")


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_parallel_checkpoints_export_the_same_weights(tmp_path_factory, tp1, layout):
    """Same seed, same init (layout-free), same data: the TP=2 / PP=2 runs trained the TP=1 model.

    Reduction order differs between layouts; Adam's normalisation turns that float rounding in near-zero
    gradients into weight differences of ~1e-5 after two steps (measured: 9e-6 for TP=2, 3e-7 for PP=2).
    A conversion error (a shard read twice, heads of the wrong rank, a missed permutation) moves weights
    by their own size, ~2e-2, and the two steps themselves by ~1e-3: 5e-5 separates them.
    """
    ours = exported_tensors(trained_tiny(tmp_path_factory, layout))
    ref = exported_tensors(tp1)
    assert ours.keys() == ref.keys()
    for key in ref:
        torch.testing.assert_close(ours[key], ref[key], rtol=1e-4, atol=5e-5, msg=key)
    # The runs trained: lambda vectors and head norms moved, so their (summed) TP gradients mattered.
    reader = McoreCheckpointReader(str(tp1))
    layer = reader.read_layer(layout_from_args(reader.args), 0)
    assert not torch.equal(layer["self_attention.core_attention.head_norm.weight"], torch.ones(64))


def test_reader_equals_load_model_weights(single_rank_parallel_state, tp1):
    """Reading one layer at a time through DCP gives exactly what megatron-core's own loader gives."""
    from diffmeg.checkpoints import load_model_weights

    model, args = load_model_weights(str(tp1))
    state = model.state_dict()
    reader = McoreCheckpointReader(str(tp1))
    layout = layout_from_args(reader.args)
    assert reader.dtype == torch.float32
    for key, value in reader.read_globals(layout).items():
        assert torch.equal(value, state[key]), key
    for i in range(layout.num_layers):
        for key, value in reader.read_layer(layout, i).items():
            assert torch.equal(value, state[f"decoder.layers.{i}.{key}"]), key


def test_write_in_bf16_reads_back_in_bf16(single_rank_parallel_state, tp1, tmp_path):
    """A trained model streamed into a bf16 checkpoint is read in bf16 (no fp32 copy of the model) and
    loads into pretrain_diff's model."""
    from diffmeg.checkpoints import load_model_weights, read_checkpoint_args
    from diffmeg.conversion.mcore_writer import StreamingCheckpointWriter, part_of

    args, _ = read_checkpoint_args(str(tp1))
    model, _ = load_model_weights(str(tp1))
    source = {k: v.clone() for k, v in model.state_dict().items() if "_extra_state" not in k}
    writer = StreamingCheckpointWriter(str(tmp_path / "bf16"), args, torch.bfloat16)
    for part in sorted(writer.parts, key=str):
        writer.write({k: v for k, v in source.items() if part_of(k) == part})
    writer.close()
    reader = McoreCheckpointReader(str(tmp_path / "bf16"))
    layout = layout_from_args(reader.args)
    reader.check(layout)
    assert reader.dtype == torch.bfloat16
    layer = reader.read_layer(layout, 3)
    for key, value in layer.items():
        assert value.dtype == torch.bfloat16
        assert torch.equal(value, source[f"decoder.layers.3.{key}"].to(torch.bfloat16)), key
    reloaded, _ = load_model_weights(str(tmp_path / "bf16"))
    common = json.loads((tmp_path / "bf16" / "iter_0000000" / "args.json").read_text())
    assert common["num_layers"] == args.num_layers
    for key, value in reloaded.state_dict().items():
        if "_extra_state" not in key:
            assert torch.equal(value, source[key].bfloat16().float()), key


def test_fill_model_refuses_missing_and_misshapen_tensors(single_rank_parallel_state, tp1):
    from diffmeg.checkpoints import read_checkpoint_args

    args, _ = read_checkpoint_args(str(tp1))
    model = build_single_rank_model(args)
    with pytest.raises(DiffmegError, match="no converted tensor for parameter"):
        fill_model(model, iter([{"output_layer.weight": torch.zeros(512, 256)}]))
    with pytest.raises(DiffmegError, match="shape mismatch for 'output_layer.weight'"):
        fill_model(model, iter([{"output_layer.weight": torch.zeros(256, 512)}]))
