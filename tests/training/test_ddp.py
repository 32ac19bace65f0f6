"""diffmeg.training.ddp in one process: the DDP settings and schedule hooks Megatron-LM would set, and the
parameter-gather switches around evaluation and saves, on megatron-core's own DDP (the attributes read
here are the ones diffmeg relies on: an upgrade that renames them fails here, not in a 2-rank job)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from diffmeg.errors import DiffmegError
from diffmeg.run_config import RunConfig
from diffmeg.training import ddp
from diffmeg.training.arguments import resolve_args

SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "2", "--seq-length", "32"]
SMALL += ["--mock-data", "--vocab-size", "128", "--micro-batch-size", "2", "--global-batch-size", "4"]
SMALL += ["--lr", "1e-3", "--eval-iters", "1", "--eval-interval", "2", "--log-interval", "1"]
OVERLAP = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]


@pytest.fixture
def trainer_of(single_rank_parallel_state, monkeypatch):
    from diffmeg.training.trainer import Trainer

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    return lambda *flags: Trainer(RunConfig.from_args(resolve_args([*SMALL, *flags], world_size=1)), [])


def test_overlapped_model_has_buckets_hooks_and_matches_the_plain_run(trainer_of):
    plain = trainer_of("--train-iters", "3", "--use-distributed-optimizer")
    plain_result = plain.train()
    t = trainer_of("--train-iters", "3", *OVERLAP, "--ddp-bucket-size", "5000")
    config, model = t.model_config, t.model
    assert len(model) == 1 and ddp.param_gather_overlapped(model)
    assert ddp.bucket_count(model) >= 3 and model[0].bucket_size == 5000
    assert plain.model[0].bucket_size is None and ddp.bucket_count(plain.model) == 1  # no overlap: one
    # One chunk: the non-interleaved schedules take single functions; no aligned all-gather without VP.
    assert config.no_sync_func == model[0].no_sync and config.grad_sync_func == model[0].start_grad_sync
    assert config.param_sync_func is None and plain.model_config.no_sync_func is None
    assert ddp.describe(model) is None  # one rank: nothing overlaps (the dry run says so too)

    hooks = len(model[0].remove_forward_pre_hook_handles)
    assert hooks > 0
    with ddp.params_gathered(model):  # evaluation: no pre-hooks inside, all of them back after
        assert model[0].remove_forward_pre_hook_handles == {}
    assert len(model[0].remove_forward_pre_hook_handles) == hooks

    # Trained with evaluation at iteration 2 in between, the run is the plain one.
    result = t.train()
    assert result["lm_loss"] == pytest.approx(plain_result["lm_loss"], rel=1e-6)
    for (name, a), b in zip(plain.model[0].named_parameters(), model[0].parameters(), strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), name


def test_chunks_get_lists_of_hooks_and_aligned_param_gathers():
    """Interleaved pipelines (several chunks): Megatron-LM's per-chunk lists, param gathers aligned."""

    def chunk(overlap_grad: bool, overlap_param: bool):
        config = SimpleNamespace(
            overlap_grad_reduce=overlap_grad,
            overlap_param_gather=overlap_param,
            align_param_gather=overlap_param,
        )
        return SimpleNamespace(
            ddp_config=config, no_sync=object(), start_grad_sync=object(), start_param_sync=object()
        )

    config, model = SimpleNamespace(), [chunk(True, True), chunk(True, True)]
    ddp.set_schedule_hooks(config, model)
    assert config.no_sync_func == [c.no_sync for c in model]
    assert config.grad_sync_func == [c.start_grad_sync for c in model]
    assert config.param_sync_func == [c.start_param_sync for c in model]
    ddp.set_schedule_hooks(config, [chunk(False, False), chunk(False, False)])
    assert config.no_sync_func is config.grad_sync_func is config.param_sync_func is None

    run = RunConfig.from_args(
        resolve_args(
            ["--model", "diff-tiny", "--pipeline-model-parallel-size", "2", "--global-batch-size", "8"]
            + ["--num-layers-per-virtual-pipeline-stage", "1", *OVERLAP, "--ddp-bucket-size", "123"],
            world_size=4,
        )
    )
    settings = ddp.ddp_config(run)
    assert settings.align_param_gather and settings.overlap_param_gather and settings.bucket_size == 123
    assert settings.grad_reduce_in_fp32 and settings.use_distributed_optimizer


@pytest.mark.parametrize("release", [True, False])
def test_a_released_run_is_freed_when_dropped(trainer_of, release):
    """megatron-core's RotaryEmbedding caches its forward in a process-wide lru_cache keyed on the module;
    with --overlap-param-gather that module's pre-hook holds the DDP wrapper, and through the config the
    optimizer: on the GPU a finished run's weights, gradients and optimizer state stayed allocated under
    the next benchmark rows. bf16 as on a GPU (in fp32 megatron-core's optimizer shards are autograd views
    of the weights, a separate cycle through C++ that gc cannot see)."""
    import gc
    import weakref

    from diffmeg.training.builders import release_training_objects

    t = trainer_of("--train-iters", "1", "--bf16", *OVERLAP)
    t.train()
    optimizer, model = weakref.ref(t.optimizer), weakref.ref(t.model[0])
    if release:
        release_training_objects(t.model_config, t.model)
        assert not ddp.param_gather_overlapped(t.model) and t.model_config.grad_scale_func is None
    del t
    gc.collect()
    assert (optimizer() is None and model() is None) == release  # without the release: still held


def test_a_model_without_ddps_main_grad_is_refused(single_rank_parallel_state, monkeypatch):
    """A model trained outside megatron-core's DDP would fail deep in backward: refused up front."""
    from diffmeg.fusions import grad_accum
    from diffmeg.model import build_model
    from tests.builders import tiny_config

    monkeypatch.setenv(grad_accum.CPU_TEST_ENV, "1")
    model = build_model(
        tiny_config(2, 2, 8, gradient_accumulation_fusion=True), vocab_size=64, max_sequence_length=16
    )
    with pytest.raises(
        DiffmegError, match=r"DDP's main_grad, which decoder\.layers\.0\..*\.weight lacks: wrap the model"
    ):
        ddp.require_main_grad([model])
    for p in model.parameters():
        p.main_grad = torch.zeros_like(p, dtype=torch.float32)
    ddp.require_main_grad([model])  # DDP's buffers: accepted
