"""The SDPA backend against the float64 definition, and its `o1 - lam * o2` combination in fp32."""

from __future__ import annotations

import pytest
import torch

from diffmeg.errors import DiffmegError
from diffmeg.kernels.reference import diff_attention_reference
from diffmeg.kernels.sdpa import diff_attention_sdpa
from diffmeg.kernels.sdpa_paths import PATHS, crossovers, path_for_length


def _inputs(dtype: torch.dtype, b=1, h=4, g=2, s=40, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q1, q2 = (torch.randn(b, h, s, d, generator=gen).to(dtype) for _ in range(2))
    k1, k2 = (torch.randn(b, g, s, d, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(b, g, s, 2 * d, generator=gen).to(dtype)
    return [q1, q2, k1, k2, v]


def _matches_reference(ts: list[torch.Tensor], **path) -> None:
    """`diff_attention_sdpa(..., **path)` equals the float64 reference, forward and every gradient
    (lambda's included, and nonzero)."""
    lam = torch.tensor(0.3, dtype=torch.float64)
    mine = [t.clone().requires_grad_(True) for t in (*ts, lam)]
    ref_in = [t.clone().requires_grad_(True) for t in (*ts, lam)]
    out = diff_attention_sdpa(*mine, scale=0.25, **path)
    ref = diff_attention_reference(*ref_in, scale=0.25)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out.backward(dout)
    ref.backward(dout)
    for a, b in zip(mine, ref_in, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-9, atol=1e-11)
    assert mine[-1].grad.abs() > 0  # lambda's gradient flowed


@pytest.mark.parametrize("split_v", [False, True])
def test_matches_float64_reference_with_gradients(split_v):
    ts = _inputs(torch.float64)
    _matches_reference(ts, split_v=split_v)


def test_bf16_combination_keeps_lambda_and_its_gradient_in_fp32():
    """lambda = 0.8003 is 0.80078125 in bf16: the output and lambda's gradient must use the fp32 value."""
    ts = _inputs(torch.bfloat16, seed=2)
    lam = torch.tensor(0.8003, dtype=torch.float32, requires_grad=True)
    zero = torch.tensor(0.0)
    o1 = diff_attention_sdpa(*ts, zero, scale=0.25, split_v=False)  # exactly A1 V in bf16
    o2 = diff_attention_sdpa(ts[1], ts[0], ts[3], ts[2], ts[4], zero, scale=0.25, split_v=False)  # A2 V
    out = diff_attention_sdpa(*ts, lam, scale=0.25, split_v=False)
    expected = (o1.float() - 0.8003 * o2.float()).to(torch.bfloat16)
    assert torch.equal(out, expected)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    out.backward(dout)
    exact = -(dout.double() * o2.double()).sum()
    assert lam.grad.dtype == torch.float32
    assert abs(lam.grad.double() - exact) <= 1e-5 * exact.abs()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("gqa,sq", [(False, 40), (True, 40), (True, 7)], ids=["mha", "gqa", "kv-cache"])
def test_each_path_matches_float64_reference_with_gradients_and_lambda(path, gqa, sq):
    """Every path (the batched split-V among them) is the definition: output and all gradients, lambda's
    included, in float64; GQA, and a KV-cache step (queries at the end of the keys)."""
    ts = _inputs(torch.float64, b=2, g=2 if gqa else 4, seed=4)
    ts[0], ts[1] = ts[0][:, :, -sq:], ts[1][:, :, -sq:]
    _matches_reference(ts, path=path)


def test_the_path_is_the_measured_one_per_length_and_two_call_on_cpu():
    assert path_for_length(1 << 20, "cpu") == "two_call"
    table = ((8192, "split_v"), (32768, "split_v_batched"))
    assert [path_for_length(n, "cuda", table) for n in (4096, 8192, 16384, 32768)] == [
        "two_call",
        "split_v",
        "split_v",
        "split_v_batched",
    ]
    assert path_for_length(4096, "cuda") == "two_call"  # the H100's 4K: two-call 2.56 ms, split-V 2.97 ms


def test_crossovers_are_read_from_timings_and_ties_do_not_switch():
    timings = {
        2048: {"two_call": 1.38, "split_v": 1.72, "split_v_batched": 1.5},
        8192: {"two_call": 7.388, "split_v": 7.381},  # 0.1%: a tie
        16384: {"two_call": 26.6, "split_v": 24.1, "split_v_batched": 23.0},
    }
    assert crossovers(timings) == ((16384, "split_v_batched"),)
    with pytest.raises(DiffmegError, match="unknown SDPA path 'four'"):
        crossovers({2048: {"four": 1.0}})


def test_every_path_is_registered_and_auto_stays_sdpa():
    from diffmeg import registry

    for path in PATHS:
        fn = registry.select("diff_attention", f"sdpa_{path}", "cpu").load()
        assert fn.keywords == {"path": path}
    assert registry.resolve("diff_attention") == "sdpa"
