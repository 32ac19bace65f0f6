"""Issue 17, items 4 and 5 on CPU: backend names checked at build; the baseline's local spec runs torch
SDPA (flash kernels) instead of megatron-core's score-materialising core."""

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
# item 4: backend names are checked at build (every backend left runs on any device)


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
