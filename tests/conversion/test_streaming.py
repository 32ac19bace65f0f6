"""Both conversion directions stream: converting a model 6x deeper does not raise peak memory, and the
round trip is bit-exact (benchmarks/conversion_scale.py measures the same at 3B scale).

Each direction runs in a child process that converts the shallow model, then the deep one, reading its peak
RSS (VmHWM, which only grows) after each: holding the deep model would add 10 layers (128 MB) to the
peak; streaming adds nothing but noise.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diffmeg.conversion.hf_config import hf_config_dict
from diffmeg.conversion.layout import DiffLayout, LlamaLayout, ModelLayout
from diffmeg.conversion.mapping import HF_LAYER_PREFIX
from tests.conftest import REPO_ROOT
from tests.tools.helpers import tool_env

SHALLOW, DEEP = 2, 12


def layout(layers: int, cls: type[ModelLayout] = DiffLayout) -> ModelLayout:
    """12.8 MB of fp32 per layer, a small embedding: the layers dominate the model."""
    return cls(
        num_layers=layers, hidden_size=512, ffn_hidden_size=1408, num_heads=4, num_kv_heads=4, head_dim=64,
        vocab_size=512, max_position_embeddings=128, rotary_base=10000.0, norm_eps=1e-5,
    )  # fmt: skip


def layer_bytes() -> int:
    return sum(4 * torch.Size(s).numel() for s in layout(1).hf_layer_shapes().values())


def write_random_diffllama(path: Path, layers: int, cls: type[ModelLayout] = DiffLayout) -> None:
    """A DiffLlama (or `cls`: Llama) folder as transformers saves one (config.json, a safetensors file per
    4 layers)."""
    from safetensors.torch import save_file

    model = layout(layers, cls)
    path.mkdir()
    config = {
        "model_type": model.model_type,
        **hf_config_dict(model, dtype="float32", bos_token_id=None, eos_token_id=None),
    }
    (path / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(layers)
    names = dict(model.hf_global_shapes())
    for index in range(layers):
        names.update({HF_LAYER_PREFIX.format(index) + k: s for k, s in model.hf_layer_shapes().items()})
    groups: list[list[str]] = [[]]
    for name in names:
        if len(groups[-1]) >= 4 * len(model.hf_layer_shapes()):
            groups.append([])
        groups[-1].append(name)
    weight_map = {}
    for i, group in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: torch.randn(names[n], generator=gen) * 0.05 for n in group}, str(path / file))
        weight_map.update(dict.fromkeys(group, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


# The peak RSS of the child's own address space (VmHWM). Not ru_maxrss: Linux carries the launching
# process's high-water mark across fork + exec, so a child of this (large) pytest process would report
# pytest's peak for both models and any growth would go unseen.
_CHILD = """
import json, sys
sys.path.insert(0, {repo!r})
from tests.conversion.helpers import tool_main

def peak():
    with open("/proc/self/status") as f:
        return 1024 * int(next(line for line in f if line.startswith("VmHWM:")).split()[1])

main, peaks = tool_main("convert_checkpoint"), []
for argv in json.loads(sys.argv[1]):
    main(argv)
    peaks.append(peak())
print(json.dumps(peaks))
"""


def peaks_of(conversions: list[list[str]]) -> list[int]:
    """Peak RSS after each conversion, all run in one fresh process in this order."""
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD.format(repo=str(REPO_ROOT)), json.dumps(conversions)],
        cwd=REPO_ROOT, env=tool_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from Linux's /proc")
def test_peak_memory_is_flat_in_depth_and_the_round_trip_exact(tmp_path):
    from tests.conversion.helpers import read_safetensors_folder  # the safetensors package's reader

    for layers in (SHALLOW, DEEP):
        write_random_diffllama(tmp_path / f"hf{layers}", layers)
    to_mcore = peaks_of(
        [
            ["hf-to-mcore", "--load", str(tmp_path / f"hf{n}"), "--save", str(tmp_path / f"ckpt{n}")]
            for n in (SHALLOW, DEEP)
        ]
    )
    to_hf = peaks_of(
        [
            [
                "mcore-to-hf",
                "--load",
                str(tmp_path / f"ckpt{n}"),
                "--save",
                str(tmp_path / f"back{n}"),
                "--max-shard-size",
                "60MB",
            ]
            for n in (SHALLOW, DEEP)
        ]
    )
    held = (DEEP - SHALLOW) * layer_bytes()  # what holding the deep model would add
    for name, (shallow, deep) in (("hf-to-mcore", to_mcore), ("mcore-to-hf", to_hf)):
        growth = deep - shallow
        assert growth < 2 * layer_bytes(), (
            f"{name}: peak grew {growth / 1e6:.0f} MB (holding the model: {held / 1e6:.0f} MB)"
        )

    source, back = (
        read_safetensors_folder(tmp_path / f"hf{DEEP}"),
        read_safetensors_folder(tmp_path / f"back{DEEP}"),
    )
    assert back.keys() == source.keys()
    for key, value in source.items():
        assert back[key].dtype == value.dtype and torch.equal(
            back[key].view(torch.uint8), value.view(torch.uint8)
        ), key


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from Linux's /proc")
def test_upcycling_streams(tmp_path):
    """Upcycling a 12-layer Llama peaks less than two (upcycled) layers above a 2-layer one."""
    for layers in (SHALLOW, DEEP):
        write_random_diffllama(tmp_path / f"llama{layers}", layers, LlamaLayout)
    shallow, deep = peaks_of(
        [
            ["upcycle", "--load", str(tmp_path / f"llama{n}"), "--save", str(tmp_path / f"up{n}")]
            for n in (SHALLOW, DEEP)
        ]
    )
    upcycled_layer = layer_bytes() + 4 * 512 * 4 * 64  # the query rows twice, lambda_proj
    assert deep - shallow < 2 * upcycled_layer, f"peak grew {(deep - shallow) / 1e6:.0f} MB"
