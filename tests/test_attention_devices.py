"""Issue 17, items 4 and 5 on CPU: backends resolved from the tensors at call time; the baseline's local
spec runs torch SDPA (flash kernels) instead of megatron-core's score-materialising core."""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.enums import AttnMaskType

from diffmeg.errors import DiffmegError
from tests.builders import make_config


def _baseline_config(heads=4, groups=2, d=8, **kw):
    """The float64 Transformer baseline: `heads` (even) heads of d over `groups` KV groups."""
    return make_config(heads // 2, None, d, num_query_groups=groups, diff_attention=False, **kw)


# ---------------------------------------------------------------------------------------------------
# item 4: the backend follows the tensors


def cuda_only(device_type: str | None) -> str | None:
    """A GPU-only row's check, as a GPU kernel's would answer."""
    return "attention backend 'gpu_only' needs a CUDA GPU; use 'sdpa'" if device_type == "cpu" else None


@pytest.fixture
def gpu_only_row(monkeypatch):
    """A `diff_attention` row that refuses CPU tensors (no package row does since flash and flex left)."""
    from diffmeg import registry

    sdpa = "diffmeg.kernels.sdpa:diff_attention_sdpa"
    row = registry.Entry(
        "diff_attention", "gpu_only", sdpa, "SDPA behind a GPU-only check", f"{__name__}:cuda_only"
    )
    monkeypatch.setattr(registry, "ENTRIES", (*registry.ENTRIES, row))


def test_backend_is_resolved_per_call_from_the_tensors(single_rank_parallel_state, gpu_only_row):
    """The inputs' device type decides each call, from the row's answers prepared at build (outside any
    compiled region): a core built on the CPU runs a GPU backend once its inputs are on the GPU."""
    from diffmeg.attention import DiffCoreAttention

    cfg = make_config(2, 1, 8, diff_attn_backend="gpu_only")
    core = DiffCoreAttention(cfg, 1, AttnMaskType.causal, "self")
    assert core.backend_for("cuda").__name__ == "diff_attention_sdpa"  # built on the CPU all the same
    with pytest.raises(DiffmegError, match="'gpu_only' needs a CUDA GPU"):
        core.backend_for("cpu")


def test_a_core_built_for_a_gpu_backend_refuses_cpu_tensors_in_one_line(
    single_rank_parallel_state, gpu_only_row
):
    """Building never refuses a backend for the device it happens to be built on (use_cpu_initialization
    on a GPU machine used to refuse a GPU backend); a call on tensors it cannot run on says why."""
    from diffmeg.attention import DiffCoreAttention

    cfg = make_config(2, 1, 16, diff_attn_backend="gpu_only")
    core = DiffCoreAttention(cfg, 1, AttnMaskType.causal, "self").float()  # built on the CPU all the same
    q, k, v = (torch.randn(20, 1, n, 16) for n in (4, 2, 2))
    with pytest.raises(DiffmegError, match="'gpu_only' needs a CUDA GPU"):
        core(q, k, v, None)


def test_backend_names_this_installation_cannot_run_fail_at_build():
    from diffmeg import registry

    assert registry.resolve("diff_attention", "auto") == "sdpa"
    with pytest.raises(DiffmegError, match="not available in this build"):
        registry.resolve("diff_attention", "te")


# ---------------------------------------------------------------------------------------------------
# item 5: the baseline's core attention


def test_local_spec_gives_the_baseline_the_sdpa_core():
    from diffmeg.attention import DiffCoreAttention, SDPACoreAttention
    from diffmeg.layer_specs import get_diff_layer_local_spec

    base = get_diff_layer_local_spec(_baseline_config()).submodules.self_attention.submodules
    assert base.core_attention is SDPACoreAttention
    diff = get_diff_layer_local_spec(make_config(2, 1, 8)).submodules.self_attention.submodules
    assert getattr(diff.core_attention, "module", diff.core_attention) is DiffCoreAttention


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2), (4, 1)])
def test_sdpa_core_equals_megatron_core_attention(single_rank_parallel_state, heads, groups):
    """Forward and input gradients equal megatron-core's DotProductAttention (float64), GQA included."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from diffmeg.attention import SDPACoreAttention

    cfg = _baseline_config(heads, groups)
    cores = [cls(cfg, 1, AttnMaskType.causal, "self") for cls in (DotProductAttention, SDPACoreAttention)]
    gen = torch.Generator().manual_seed(heads * 10 + groups)
    ins = [torch.randn(13, 2, n, 8, generator=gen, dtype=torch.float64) for n in (heads, groups, groups)]
    dout = torch.randn(13, 2, heads * 8, generator=gen, dtype=torch.float64)
    results = []
    for core in cores:
        leaves = [t.clone().requires_grad_(True) for t in ins]
        out = core(*leaves, None)
        out.backward(dout)
        results.append([out.detach()] + [t.grad for t in leaves])
    for mine, theirs in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-12)


def test_sdpa_core_decode_step_and_explicit_mask(single_rank_parallel_state):
    from diffmeg.attention import SDPACoreAttention

    core = SDPACoreAttention(_baseline_config(2, 1), 1, AttnMaskType.causal, "self")
    gen = torch.Generator().manual_seed(3)
    q_all, k, v = (torch.randn(9, 1, n, 8, generator=gen, dtype=torch.float64) for n in (2, 1, 1))
    full = core(q_all, k, v, None)  # [9, 1, 16]
    # a KV-cache step: the last 3 queries against all 9 keys are the last 3 rows of the full pass
    torch.testing.assert_close(core(q_all[-3:], k, v, None), full[-3:], rtol=1e-12, atol=1e-12)
    # an explicit mask (True = masked out) replaces the causal one: masking nothing attends everywhere
    everything = core(q_all, k, v, torch.zeros(1, 1, 9, 9, dtype=torch.bool))
    assert not torch.allclose(everything[:-1], full[:-1]) and torch.allclose(everything[-1], full[-1])


def test_sdpa_core_refuses_context_parallelism():
    from diffmeg.attention import SDPACoreAttention

    cfg = _baseline_config()
    cfg.context_parallel_size = 2
    with pytest.raises(DiffmegError, match="context parallelism"):
        SDPACoreAttention(cfg, 1, AttnMaskType.causal, "self")
