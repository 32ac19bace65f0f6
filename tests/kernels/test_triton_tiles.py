"""The fused kernel's tiles fit the GPU's shared memory for the input dtype (pure arithmetic, no GPU).

fp32 inputs hold twice the bytes of bf16 in every staged tile: with the bf16 tiles the dQ kernel would
need ~311 KB at d=128 (ptxas, tests/kernels/test_triton_compile.py) where an H100 block has 227 KiB.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from diffmeg.kernels import triton_diff
from diffmeg.kernels.triton_diff import (
    SM90_SHARED_MEMORY_BYTES,
    _ptxas_tiles,
    _tiles,
    default_config,
    fit_shared_memory,
    shared_memory_estimate,
    shared_memory_limit,
)


@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_bf16_tiles_are_the_chosen_ones_and_fp32_tiles_fit_sm90(head_dim):
    bf16 = default_config(head_dim, interpreted=False)
    assert bf16 == _tiles(head_dim, torch.bfloat16)  # fitting never touches the tiles chosen for bf16
    # measured on the H100 at d=128 (one dK/dV pass, 32-row tiles), ptxas-chosen elsewhere
    assert (bf16 != _ptxas_tiles(head_dim)) == (head_dim == 128)
    assert default_config(head_dim, interpreted=False, dtype=torch.float16) == bf16
    assert max(shared_memory_estimate(bf16, head_dim, torch.bfloat16).values()) <= SM90_SHARED_MEMORY_BYTES
    fp32 = default_config(head_dim, interpreted=False, dtype=torch.float32)
    assert max(shared_memory_estimate(fp32, head_dim, torch.float32).values()) <= SM90_SHARED_MEMORY_BYTES
    if head_dim >= 96:  # the dQ and dK/dV kernels hold half the rows; the forward keeps its tiles
        ptxas = _ptxas_tiles(head_dim)  # 4-byte inputs start from these (what the H100 ran in fp32)
        assert (fp32.dq_block_m, fp32.dkdv_block_n) == (ptxas.dq_block_m // 2, ptxas.dkdv_block_n // 2)
        assert (fp32.block_m, fp32.block_n, fp32.v_splits) == (ptxas.block_m, ptxas.block_n, ptxas.v_splits)
    else:
        assert fp32 == bf16


@pytest.mark.parametrize("limit", [100 * 1024, 48 * 1024, 20 * 1024])
def test_a_smaller_shared_memory_shrinks_every_kernel_to_fit(limit):
    """A fake per-block limit (a smaller GPU): each kernel's estimate fits, every warp keeps 16 rows."""
    for head_dim in (64, 96, 128):
        for dtype in (torch.bfloat16, torch.float32):
            cfg = default_config(head_dim, interpreted=False, dtype=dtype, smem_limit=limit)
            est = shared_memory_estimate(cfg, head_dim, dtype)
            smallest = fit_shared_memory(
                triton_diff.TritonDiffConfig(16, 16, 1, 1, 1, 16, 16, 16, 16, 1, 1), head_dim, dtype, limit
            )
            if max(shared_memory_estimate(smallest, head_dim, dtype).values()) <= limit:
                assert max(est.values()) <= limit, (head_dim, dtype, cfg, est)
            assert cfg.block_m >= 16 * cfg.num_warps
            assert min(cfg.dq_block_m, cfg.dkdv_block_n) >= 16 * cfg.bwd_num_warps


def test_the_limit_comes_from_the_device(monkeypatch):
    """diff_attention_triton asks the tensors' GPU (shared_memory_per_block_optin), sm_90's otherwise."""
    props = SimpleNamespace(shared_memory_per_block_optin=101_376)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    assert shared_memory_limit(torch.device("cuda", 0)) == 101_376
    assert shared_memory_limit(torch.device("cpu")) == SM90_SHARED_MEMORY_BYTES
    cfg = default_config(128, interpreted=False, dtype=torch.float32, smem_limit=101_376)
    assert max(shared_memory_estimate(cfg, 128, torch.float32).values()) <= 101_376
