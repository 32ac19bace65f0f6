"""diffmeg/core_attention.py: every core attention refuses what it cannot compute with one line, at build
or at call, in megatron-core's calling convention."""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.builders import make_config


def _cores(cfg):
    from megatron.core.transformer.enums import AttnMaskType

    from diffmeg.attention import DiffCoreAttention, SDPACoreAttention

    baseline = make_config(2, 2, 8, diff_attention=False)  # the same 4 heads of 8
    return {
        "differential attention": DiffCoreAttention(cfg, 1, AttnMaskType.causal, "self"),
        "the SDPA core attention": SDPACoreAttention(baseline, 1, AttnMaskType.causal, "self"),
    }


def test_packed_sequences_and_bias_are_refused(single_rank_parallel_state):
    from diffmeg.errors import DiffmegError

    cfg = make_config(2, 2, 8)
    q = torch.randn(5, 1, 4, 8)
    for name, core in _cores(cfg).items():
        for extra in ({"attention_bias": torch.zeros(1)}, {"packed_seq_params": object()}):
            refused = f"^{name} does not support packed sequences or attention bias"
            with pytest.raises(DiffmegError, match=refused):
                core(q, q, q, None, **extra)


def test_non_causal_masks_are_refused_at_build(single_rank_parallel_state):
    from megatron.core.transformer.enums import AttnMaskType

    from diffmeg.attention import DiffCoreAttention, SDPACoreAttention
    from diffmeg.errors import DiffmegError

    with pytest.raises(DiffmegError, match="differential attention is causal-only, got mask type"):
        DiffCoreAttention(make_config(2, 2, 8), 1, AttnMaskType.padding, "self")
    baseline = make_config(4, 4, 8, diff_attention=False)
    with pytest.raises(DiffmegError, match="the SDPA core attention is causal-only"):
        SDPACoreAttention(baseline, 1, AttnMaskType.padding, "self")


def test_defaults_come_from_the_config(single_rank_parallel_state):
    from megatron.core.transformer.enums import AttnMaskType

    from diffmeg.attention import SDPACoreAttention

    cfg = make_config(4, 4, 8, diff_attention=False, attention_dropout=0.25)
    core = SDPACoreAttention(cfg, 3, AttnMaskType.causal, "self")
    assert (core.layer_number, core.dropout_p, core.softmax_scale) == (3, 0.25, 8**-0.5)
    core = SDPACoreAttention(cfg, 3, AttnMaskType.causal, "self", attention_dropout=0.0, softmax_scale=0.5)
    assert (core.dropout_p, core.softmax_scale) == (0.0, 0.5)


def _preference_cores(backend: str) -> dict:
    """Both cores (DIFF V1 on its SDPA backend, the baseline's SDPA core) in fp32 with this preference."""
    from megatron.core.transformer.enums import AttnMaskType

    from diffmeg.attention import DiffCoreAttention, SDPACoreAttention
    from tests.builders import tiny_config

    diff = tiny_config(2, 2, 8, sdpa_backend=backend, diff_attn_backend="sdpa")
    baseline = tiny_config(2, 2, 8, sdpa_backend=backend, diff_attention=False)
    return {
        "diff": DiffCoreAttention(diff, 1, AttnMaskType.causal, "self"),
        "sdpa": SDPACoreAttention(baseline, 1, AttnMaskType.causal, "self"),
    }


def test_the_sdpa_preference_is_entered_around_both_cores_calls(single_rank_parallel_state, monkeypatch):
    """Each core runs its SDPA calls inside `sdpa_kernel` with the preferred kernel first and torch's order
    of the others behind it as a priority; auto enters nothing."""
    from torch.nn.attention import SDPBackend

    from diffmeg.kernels import sdpa_backends

    entered = []

    def spy(kernels, set_priority=False):
        entered.append((list(kernels), set_priority))
        return contextlib.nullcontext()

    monkeypatch.setattr(sdpa_backends, "sdpa_kernel", spy)
    q = torch.randn(6, 2, 4, 8)  # [s, b, sub-heads, d]
    cudnn_first = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    for backend, want in (
        ("cudnn", ([*cudnn_first, SDPBackend.MATH], True)),
        ("math", ([SDPBackend.MATH], False)),
    ):
        for name, core in _preference_cores(backend).items():
            entered.clear()
            core(q, q, q, None)
            assert entered == [want], (backend, name)
    for core in _preference_cores("auto").values():
        entered.clear()
        core(q, q, q, None)
        assert entered == []


def test_math_first_gives_the_output_of_torchs_own_choice_on_cpu(single_rank_parallel_state):
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(6, 2, 4, 8, generator=gen) for _ in range(3))
    auto, math = _preference_cores("auto"), _preference_cores("math")
    for name in auto:
        math[name].load_state_dict(auto[name].state_dict())
        torch.testing.assert_close(math[name](q, k, v, None), auto[name](q, k, v, None), msg=name)


def test_the_sdpa_preference_names_and_torchs_order():
    """Our copy of torch's kernel order is torch's (a torch upgrade that changes it fails here), and the GPU
    kernels are refused without CUDA in one line naming the way out."""
    from torch.nn.attention import SDPBackend

    from diffmeg import registry
    from diffmeg.errors import DiffmegError
    from diffmeg.kernels import sdpa_backends

    order = [SDPBackend(i) for i in torch._C._get_sdp_priority_order() if i != int(SDPBackend.OVERRIDEABLE)]
    assert list(sdpa_backends.TORCH_ORDER) == order
    assert registry.select("sdpa_kernel").load() is contextlib.nullcontext  # auto: torch's own order
    assert registry.select("sdpa_kernel", "math", "cpu").name == "math"
    with pytest.raises(
        DiffmegError, match="unknown SDPA kernel preference 'fast'.*; choose one of auto, torch"
    ):
        make_config(2, 2, 8, sdpa_backend="fast")
    if not torch.cuda.is_available():
        for name in ("cudnn", "flash", "efficient"):
            with pytest.raises(
                DiffmegError, match=r"^the GPU SDPA kernels .* need CUDA, .*; use auto or math$"
            ):
                registry.select("sdpa_kernel", name)
