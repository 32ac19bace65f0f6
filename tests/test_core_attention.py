"""diffmeg/core_attention.py: every core attention refuses what it cannot compute with one line, at build
or at call, in megatron-core's calling convention."""

from __future__ import annotations

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
