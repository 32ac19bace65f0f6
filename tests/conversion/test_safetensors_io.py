"""safetensors read and written one tensor at a time: the `safetensors` package reads what we write and we
read what it writes, bit for bit; shards follow the plan; files follow the umask; bad input is refused."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch

from diffmeg.conversion.safetensors_io import INDEX_FILE, SafetensorsFile, SafetensorsShardWriter
from diffmeg.errors import DiffmegError


def tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(40, 8, generator=gen).to(torch.bfloat16),  # 640 bytes
        "b.weight": torch.randn(30, generator=gen),  # fp32, 120 bytes
        "c.weight": torch.randn(50, 8, generator=gen).to(torch.bfloat16),  # 800 bytes
        "d.lambda": torch.randn(3, generator=gen).double(),
        "e.ids": torch.arange(7, dtype=torch.int64),
    }


def bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))
    )


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    yield 0o027
    os.umask(old)


def test_shards_follow_the_plan_and_the_package_reads_them(tmp_path, umask_027):
    from safetensors import safe_open

    data = tensors()
    plan = [(name, tuple(t.shape), t.dtype) for name, t in data.items()]
    writer = SafetensorsShardWriter(str(tmp_path), max_shard_bytes=1000, plan=plan)
    for name in reversed(list(data)):  # any arrival order
        writer.add({name: data[name]})
    names = writer.close()
    # 640 | 120 (760) | 800 would pass 1000 -> new shard | 24 + 56 (880)
    assert names == [f"model-0000{i}-of-00002.safetensors" for i in (1, 2)]
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert index["weight_map"] == {
        "a.weight": names[0],
        "b.weight": names[0],
        "c.weight": names[1],
        "d.lambda": names[1],
        "e.ids": names[1],
    }
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in data.values())
    for name, file in index["weight_map"].items():
        with safe_open(str(tmp_path / file), "pt") as f:
            assert f.metadata() == {"format": "pt"}
            assert bytes_equal(f.get_tensor(name), data[name]), name
        assert bytes_equal(SafetensorsFile(str(tmp_path / file)).read(name), data[name]), name
    for path in tmp_path.iterdir():  # created as open() creates files: the umask applies
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o666 & ~umask_027, path.name


def test_reader_reads_what_the_package_writes(tmp_path):
    from safetensors.torch import save_file

    data = tensors()
    save_file(data, str(tmp_path / "model.safetensors"), metadata={"format": "pt", "note": "x"})
    file = SafetensorsFile(str(tmp_path / "model.safetensors"))
    assert file.metadata == {"format": "pt", "note": "x"}
    assert set(file.tensors) == set(data)
    for name, tensor in data.items():
        assert file.tensors[name].shape == tuple(tensor.shape)
        assert bytes_equal(file.read(name), tensor), name


def test_bad_files_and_bad_writes_are_refused(tmp_path):
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1000)}, str(tmp_path / "full.safetensors"))
    raw = (tmp_path / "full.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(raw[:-100])
    with pytest.raises(DiffmegError, match="does not fit its header"):
        SafetensorsFile(str(tmp_path / "cut.safetensors"))
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(DiffmegError, match="not a readable safetensors file"):
        SafetensorsFile(str(tmp_path / "junk.safetensors"))

    out = tmp_path / "out"
    out.mkdir()
    writer = SafetensorsShardWriter(
        str(out), 10**6, [("w", (2, 3), torch.float32), ("v", (4,), torch.float32)]
    )
    with pytest.raises(DiffmegError, match="the plan says torch.float32 \\[2, 3\\]"):
        writer.add({"w": torch.zeros(3, 2)})
    with pytest.raises(DiffmegError, match="not in the shard plan"):
        writer.add({"u": torch.zeros(1)})
    writer.add({"w": torch.zeros(2, 3)})
    with pytest.raises(DiffmegError, match="not in the shard plan or was written already"):
        writer.add({"w": torch.zeros(2, 3)})
    with pytest.raises(DiffmegError, match="'v' was planned but never written"):
        writer.close()
    writer.abort()
