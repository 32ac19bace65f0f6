"""The Triton kernels compile for Hopper (sm_90) with the default tiles, on a machine without a GPU.

The interpreter (test_triton_diff.py) checks the numerics but not the GPU compile path (layouts, type
rules, shared-memory limits). triton's wheel ships ptxas, so the full TTIR -> cubin pipeline runs on CPU:
this catches kernels that only break on a real GPU. It runs in a subprocess without TRITON_INTERPRET.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

REPO = Path(__file__).resolve().parents[2]
H100_SMEM_BYTES = 227 * 1024  # opt-in shared memory per block on sm_90

_SCRIPT = """
import json, sys
from dataclasses import asdict
from diffmeg.kernels.triton_aot import compile_all
from diffmeg.kernels.triton_diff import default_config
d = int(sys.argv[1])
print(json.dumps([asdict(s) for s in compile_all(d, default_config(d, interpreted=False))]))
"""


@pytest.mark.parametrize("head_dim", [128, 96])
def test_kernels_compile_for_sm90(head_dim, tmp_path):
    """d=128 (3B) and d=96 (830M, two exact tiles of 64 + 32, nothing padded) with their default tiles."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "cache"), TRITON_DEFAULT_FP_FUSION="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(head_dim)], capture_output=True, text=True, env=env, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    stats = json.loads(proc.stdout.strip().splitlines()[-1])
    from diffmeg.kernels.triton_diff import default_config

    launches = len(default_config(head_dim, interpreted=False).dkdv_passes())
    assert [s["kernel"] for s in stats] == [
        "diff_fwd_kernel",
        "diff_bwd_preprocess_kernel",
        *["diff_bwd_dkdv_kernel"] * launches,
        "diff_bwd_dq_kernel",
    ]
    for s in stats:
        assert 0 < s["registers"] <= 255, s
        assert s["shared_bytes"] <= H100_SMEM_BYTES, s


def test_d96_is_two_exact_tiles_not_padding():
    """DIFF-830M's d=96: QK^T over 64 + 32 columns and V (192 wide, or thirds of 64) without padding."""
    import torch

    from diffmeg.kernels.triton_diff import default_config, dkdv_meta, dq_meta, fwd_meta

    cfg = default_config(96, interpreted=False)
    fwd = fwd_meta(96, 4096, torch.bfloat16, cfg, store_o2=True)
    assert (fwd["BLOCK_D"], fwd["BLOCK_D2"], fwd["HAS_D2"], fwd["PAD_D"]) == (64, 32, True, False)
    v_slice = fwd["BLOCK_DV"] + (fwd["BLOCK_DV2"] if fwd["HAS_DV2"] else 0)
    assert not fwd["PAD_DV"] and v_slice == 192 // cfg.v_splits
    for meta in (dkdv_meta(96, 4096, 4096, torch.bfloat16, cfg), dq_meta(96, 4096, torch.bfloat16, cfg)):
        assert (meta["BLOCK_D"], meta["BLOCK_D2"], meta["HAS_D2"], meta["PAD_D"]) == (64, 32, True, False)
        assert (meta["BLOCK_DV"], meta["BLOCK_DV2"], meta["HAS_DV2"], meta["PAD_DV"]) == (
            128,
            64,
            True,
            False,
        )
