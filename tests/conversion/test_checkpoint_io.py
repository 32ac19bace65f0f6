"""Streaming checkpoint reads and writes: any TP/PP layout reads back as the same model, in its own dtype."""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

import pytest
import torch

from diffmeg.checkpoints import build_single_rank_model
from diffmeg.conversion.checkpoint_io import McoreCheckpointReader, atomic_output_dir, fill_model
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


def test_atomic_output_dir_keeps_the_old_output_on_failure(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(RuntimeError), atomic_output_dir(str(out)) as tmp:
        (tmp_path / "marker").write_text(tmp)
        raise RuntimeError("conversion failed")
    assert (out / "old.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["marker", "out"]
    with atomic_output_dir(str(out)) as tmp:
        with open(f"{tmp}/new.txt", "w") as f:
            f.write("new")
    assert sorted(p.name for p in out.iterdir()) == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["marker", "out"]


def test_atomic_output_dir_never_replaces_a_folder_a_run_holds(tmp_path, folder_holder):
    """--overwrite of a run folder while a run trains into it: one line naming the run, nothing touched."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "iter_0000001").mkdir()
    run = folder_holder(out)
    with pytest.raises(DiffmegError, match=rf"^--save {out} is in use by another run: pid {run.pid} on "):
        with atomic_output_dir(str(out)):
            raise AssertionError("never reached")
    assert sorted(os.listdir(out)) == ["iter_0000001", "run.lock"] and os.listdir(tmp_path) == ["out"]
    run.stdin.close()
    run.wait(timeout=60)
    with atomic_output_dir(str(out)) as tmp:  # once it ended: replaced, its lock with it
        Path(tmp, "new.txt").write_text("new")
    assert os.listdir(out) == ["new.txt"]


def test_atomic_output_dir_follows_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        with atomic_output_dir(str(tmp_path / "out")) as tmp:
            with open(f"{tmp}/file", "w") as f:
                f.write("x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o750
    assert stat.S_IMODE((tmp_path / "out" / "file").stat().st_mode) == 0o640


def test_a_full_disk_is_named_and_the_partial_output_removed(tmp_path):
    """Refused up front when the free space is short; a write failing with ENOSPC (here as DCP reports it,
    wrapped in its CheckpointException) is one line naming the directory, and nothing is left behind."""
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    out = tmp_path / "out"
    with pytest.raises(DiffmegError, match=r"free but the conversion writes about 1000000000.00 GB"):
        with atomic_output_dir(str(out), needed_bytes=10**18):
            pass
    full = OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(DiffmegError) as info:
        with atomic_output_dir(str(out), needed_bytes=1000) as tmp:
            (Path(tmp) / "partial.distcp").write_bytes(b"x" * 100)
            raise CheckpointException("write", {0: (full, traceback.StackSummary())})
    message = str(info.value)
    assert message.startswith(f"disk full writing {out}: partial output removed, {tmp_path} has ")
    assert "free space there or choose another --save" in message and "\n" not in message
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RuntimeError, match="not a disk problem"):  # anything else passes through
        with atomic_output_dir(str(out)):
            raise RuntimeError("not a disk problem")
