"""The CPU patches: each megatron-core call site they exist for is still there, and each patch works.

If a megatron-core upgrade moves one of these call sites, the first test fails and names it, so the
patch is revisited instead of silently becoming dead or wrong.
"""

from __future__ import annotations

import inspect

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only workarounds")

CALL_SITES = {
    "megatron.core.models.common.embeddings.rotary_pos_embedding": "torch.cuda.current_device()",
    "megatron.core.pipeline_parallel.schedules": 'device="cuda"',
    "megatron.core.optimizer.clip_grads": "torch.cuda.FloatTensor",
    "megatron.core.tensor_parallel.random": "def _set_cuda_rng_state",
    "megatron.core.transformer.utils": "def get_default_causal_mask",
    "megatron.core.fusions.fused_softmax": "get_default_causal_mask",
    "megatron.core.pipeline_parallel.p2p_communication": "torch.cuda.synchronize",
    "megatron.core.models.common.embeddings.rope_utils": "pin_memory=True",
}


@pytest.mark.parametrize("module,needle", sorted(CALL_SITES.items()))
def test_call_sites_still_exist(module, needle):
    import importlib

    source = inspect.getsource(importlib.import_module(module))
    assert needle in source, f"{module} no longer contains {needle!r}: revisit diffmeg/compat/cpu.py"


def test_patches_make_cuda_call_sites_work_on_cpu(single_rank_parallel_state):
    from diffmeg.compat import cpu_compat_active

    assert cpu_compat_active()
    assert torch.zeros(3, device="cuda").device.type == "cpu"
    assert torch.arange(4, device=torch.device("cuda")).device.type == "cpu"
    assert torch.cuda.current_device() == torch.device("cpu")
    assert torch.tensor([1, 2], device="cpu", pin_memory=True).tolist() == [1, 2]
    assert torch.ones(2).type() == "torch.cuda.FloatTensor"
    assert torch.ones(2).type(torch.float64).dtype == torch.float64
    import megatron.core.transformer.utils as tu

    mask = tu.get_default_causal_mask(4)
    assert mask.device.type == "cpu" and mask[0, 1] and not mask[1, 0]
    assert torch._dynamo.config.disable


def test_rng_tracker_forks_and_restores(single_rank_parallel_state):
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    before = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)
    states = tracker.get_states()
    with tracker.fork():
        b = torch.rand(3)
    assert not torch.equal(a, b)
    tracker.set_states(states)
    with tracker.fork():
        assert torch.equal(torch.rand(3), b)


def test_device_context_manager_still_builds_on_meta(single_rank_parallel_state):
    with torch.device("meta"):
        t = torch.zeros(3)
    assert t.device.type == "meta"
