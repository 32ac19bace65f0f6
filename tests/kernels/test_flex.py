"""The FlexAttention backend against the float64 definition: forward on CPU (FlexAttention has no CPU
backward; its gradients are checked on a GPU in test_gpu_kernels.py), and its refusals."""

from __future__ import annotations

import pytest
import torch

from diffmeg import registry
from diffmeg.errors import DiffmegError
from diffmeg.kernels.reference import diff_attention_reference

pytest.importorskip("torch.nn.attention.flex_attention")

from diffmeg.kernels.flex import diff_attention_flex  # noqa: E402


@pytest.mark.parametrize("g,sq", [(4, 24), (2, 24), (2, 5)], ids=["mha", "gqa", "kv-cache"])
def test_forward_matches_float64_reference(g, sq):
    gen = torch.Generator().manual_seed(0)
    b, h, sk, d = 2, 4, 24, 8
    q1, q2 = (torch.randn(b, h, sq, d, generator=gen, dtype=torch.float64) for _ in range(2))
    k1, k2 = (torch.randn(b, g, sk, d, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(b, g, sk, 2 * d, generator=gen, dtype=torch.float64)
    lam = torch.tensor(0.3, dtype=torch.float64)
    out = diff_attention_flex(q1, q2, k1, k2, v, lam, scale=0.25)
    ref = diff_attention_reference(q1, q2, k1, k2, v, lam, scale=0.25)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)


def test_training_on_cpu_masks_and_dropout_are_refused():
    assert registry.select("diff_attention", "flex").name == "flex"  # installed: torch has it
    with pytest.raises(DiffmegError, match="'flex' needs a CUDA GPU .*; use 'sdpa'$"):
        registry.select("diff_attention", "flex", "cpu")
    x = torch.zeros(1, 1, 4, 2)
    v = torch.zeros(1, 1, 4, 4)
    with pytest.raises(ValueError, match="causal-only without attention dropout"):
        diff_attention_flex(x, x, x, x, v, torch.tensor(0.1), scale=1.0, dropout_p=0.1)
