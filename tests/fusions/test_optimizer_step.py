"""The fused optimizer step (`--optimizer-impl fused`): the same weights and losses as megatron-core's step
to fp32 rounding, no host sync of its own, the selection by `auto`, and its one-line refusals."""

from __future__ import annotations

import pytest
import torch

from diffmeg.errors import DiffmegError
from diffmeg.fusions import optimizer_step
from diffmeg.run_config import RunConfig
from diffmeg.training.arguments import resolve_args
from tests.training.helpers import SMALL, STEPS, train_steps


def _run(
    impl: str, *flags: str, steps: int = STEPS
) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """Losses, grad norms and final weights of `steps` Trainer steps with `--optimizer-impl impl`."""
    return train_steps(*flags, "--optimizer-impl", impl, steps=steps)


@pytest.mark.parametrize(
    "flags",
    [
        (),
        ("--clip-grad", "0.05"),  # every step clipped: the device-side factor is used
        ("--use-distributed-optimizer", "--clip-grad", "0.05"),
    ],
    ids=["unclipped", "clipped", "dist-opt"],
)
def test_fused_step_matches_megatron_cores(single_rank_parallel_state, flags):
    ref_losses, ref_norms, ref_w = _run("megatron", *flags)
    losses, norms, w = _run("fused", *flags)
    assert losses[0] == ref_losses[0]  # the first forward sees the same initial weights
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=1e-7)
    if "--clip-grad" in flags:
        assert min(ref_norms) > 0.05  # the clip did act
    assert set(w) == set(ref_w)
    for name in w:
        torch.testing.assert_close(w[name], ref_w[name], rtol=1e-5, atol=1e-6, msg=name)


def test_bf16_fused_step_matches_megatron_cores(single_rank_parallel_state):
    """--bf16: fp32 main params copied to the bf16 model by one foreach copy. One step: afterwards a
    one-ulp fp32 difference can round a bf16 weight the other way, and bf16 forwards amplify it."""
    ref_losses, ref_norms, ref_w = _run("megatron", "--bf16", "--clip-grad", "0.05", steps=1)
    losses, norms, w = _run("fused", "--bf16", "--clip-grad", "0.05", steps=1)
    assert losses == ref_losses and min(ref_norms) > 0.05
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=1e-7)
    for name in w:
        torch.testing.assert_close(w[name], ref_w[name], rtol=1e-5, atol=1e-6, msg=name)


def test_grad_norm_and_clip_stay_on_the_device():
    grads = [torch.full((3,), 2.0), torch.full((4,), -1.0)]
    norm = optimizer_step.grad_norm(grads, group=None)
    assert isinstance(norm, torch.Tensor) and norm.dim() == 0
    assert norm.item() == pytest.approx((12 + 4) ** 0.5)
    before = [g.clone() for g in grads]
    optimizer_step.clip_(grads, 10.0, norm)  # factor clamped to 1: unchanged bit for bit
    assert all(torch.equal(a, b) for a, b in zip(grads, before, strict=True))
    optimizer_step.clip_(grads, 1.0, norm)
    assert optimizer_step.grad_norm(grads, None).item() == pytest.approx(1.0, rel=1e-5)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ((), []),
        (("--use-distributed-optimizer",), []),
        (("--fp16",), ["item at megatron/core/optimizer/optimizer.py"]),  # the overflow flag, once
    ],
    ids=["fp32", "dist-opt", "fp16"],
)
def test_a_fused_step_reads_nothing_back_to_the_host(single_rank_parallel_state, flags, expected):
    """A whole Trainer step (two micro-batches, forward, backward, the fused optimizer step): no host
    read; the grad norm stays a device tensor. fp16 reads its overflow flag (megatron-core's
    `_unscale_main_grads_and_check_for_nan`: one check over all grads), whatever the number of tensors."""
    from diffmeg.training.builders import release_training_objects
    from diffmeg.training.trainer import Trainer
    from tests.host_reads import host_reads

    run = RunConfig.from_args(resolve_args([*SMALL, *flags, "--optimizer-impl", "fused"], world_size=1))
    trainer = Trainer(run, callbacks=[])
    try:
        trainer.train_step()  # state built
        with host_reads() as reads:
            out = trainer.train_step()
        assert isinstance(out.grad_norm, torch.Tensor) or flags == ("--fp16",)
        assert [read.rsplit(":", 1)[0] for read in reads] == expected
    finally:
        release_training_objects(trainer.model_config, trainer.model)


def test_auto_is_the_registrys_order_and_fused_cannot_run_beside_megatron_cores_fused_adam(monkeypatch):
    """One decision: the registry's `auto` order and each entry's availability check (the docstrings of
    training/builders.py and run_config.py say so); unknown names are refused."""
    import dataclasses

    from diffmeg import registry

    # until a GPU run measured the fused step faster, the registry's auto order keeps megatron-core's
    assert registry.resolve("optimizer") == "megatron"
    measured = dataclasses.replace(registry.slot("optimizer"), auto=("fused", "megatron"))  # as once measured
    monkeypatch.setattr(
        registry, "SLOTS", tuple(measured if s.name == "optimizer" else s for s in registry.SLOTS)
    )
    monkeypatch.setattr(optimizer_step, "megatron_has_fused_adam", lambda: False)
    assert registry.resolve("optimizer") == "fused" and registry.resolve("optimizer", "fused") == "fused"
    monkeypatch.setattr(optimizer_step, "megatron_has_fused_adam", lambda: True)  # TE or apex installed
    assert registry.resolve("optimizer") == "megatron"
    with pytest.raises(DiffmegError, match="^--optimizer-impl fused steps torch's AdamW, but megatron-core .*"
                       "use --optimizer-impl megatron$"):  # fmt: skip
        registry.resolve("optimizer", "fused")
    with pytest.raises(
        DiffmegError, match="unknown optimizer step 'apex'.*choose one of auto, megatron, fused"
    ):
        registry.resolve("optimizer", "apex")
    assert registry.entry("optimizer", "fused").load() is optimizer_step.apply_fused_step


def test_the_flag_is_in_the_run_config_with_auto_by_default():
    run = RunConfig.from_args(resolve_args(SMALL, world_size=1))
    assert run.impls["optimizer_impl"] == "auto"
    run = RunConfig.from_args(resolve_args([*SMALL, "--optimizer-impl", "fused"], world_size=1))
    assert run.impls["optimizer_impl"] == "fused" and run.to_args().optimizer_impl == "fused"


def test_adamw_runs_its_fused_kernel_here_and_leaves_the_groups_flags_as_they_were():
    """On a CPU too the fused step's AdamW is torch's fused kernel (no per-tensor read of the step
    counters, as foreach's bias corrections make); the param groups (what a checkpoint saves) keep their
    own flags."""
    import importlib
    from unittest import mock

    w = torch.nn.Parameter(torch.ones(4))
    inner = torch.optim.AdamW([w], lr=0.1)
    stepper = optimizer_step._AdamFlags(inner, fused=optimizer_step.fused_adam_runs_on([w]))
    w.grad = torch.ones(4)
    adam = importlib.import_module("torch.optim.adam")
    with mock.patch.object(adam, "_fused_adam", wraps=adam._fused_adam) as fused:
        stepper()
    assert fused.call_count == 1 and w.detach().lt(1).all()
    assert inner.param_groups[0]["foreach"] is None and inner.param_groups[0]["fused"] is None


@pytest.mark.parametrize("flags", [(), ("--use-distributed-optimizer",)], ids=["plain", "dist-opt"])
def test_a_fused_run_resumes_exactly_from_its_checkpoint(
    single_rank_parallel_state, tmp_path, monkeypatch, flags
):
    """Save after 2 fused steps, load into a new fused Trainer: its next 2 losses are the uninterrupted
    run's."""
    from diffmeg.training.builders import release_training_objects
    from diffmeg.training.trainer import Trainer

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "")  # the Trainer sets the launcher variables; restored at teardown
        monkeypatch.delenv(key)
    ckpt = str(tmp_path / "ckpt")
    common = [*SMALL, *flags, "--optimizer-impl", "fused", "--save", ckpt, "--save-interval", "100"]

    def trainer(*extra: str) -> Trainer:
        return Trainer(RunConfig.from_args(resolve_args([*common, *extra], world_size=1)), callbacks=[])

    first = trainer()
    try:
        for _ in range(2):
            first.train_step()
        first.checkpoints.save(2, first.state.consumed_samples, first.model, first.optimizer, first.scheduler)
        first.checkpoints.wait()
        expected = [float(first.train_step().loss) for _ in range(2)]
    finally:
        release_training_objects(first.model_config, first.model)
    resumed = trainer("--load", ckpt)
    try:
        assert resumed.state.iteration == 2
        assert [float(resumed.train_step().loss) for _ in range(2)] == expected
    finally:
        release_training_objects(resumed.model_config, resumed.model)
