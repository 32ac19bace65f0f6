"""CheckpointManager: where a run starts (--load/--save/--ckpt-step), the --save checks before training,
and RNG states that resume across device types."""

from __future__ import annotations

import os
from contextlib import contextmanager

import pytest
import torch

from diffmeg.checkpoints import TRACKER_FILE
from diffmeg.config import count_parameters
from diffmeg.errors import DiffmegError
from diffmeg.folder_lock import LOCK_FILE
from diffmeg.run_config import RunConfig
from diffmeg.training import checkpointing
from diffmeg.training.arguments import resolve_args
from diffmeg.training.checkpointing import CheckpointManager
from tests.training.helpers import SMALL, fake_checkpoint


def _manager(*flags: str) -> tuple[CheckpointManager, list[str]]:
    run = RunConfig.from_args(resolve_args(["--model", "diff-tiny", "--mock-data", *flags], world_size=1))
    lines: list[str] = []
    return CheckpointManager(run, log=lines.append), lines


def _lock(manager: CheckpointManager) -> None:
    """`lock_save_target` with the run's parameter count, as the Trainer calls it."""
    manager.lock_save_target(count_parameters(manager.run.model))


def _fake_checkpoints(root, iterations, tracker=None) -> str:
    for it in iterations:
        fake_checkpoint(root, it, {})
    if tracker is not None:
        (root / TRACKER_FILE).write_text(str(tracker))
    return str(root)


# ------------------------------------------------------------------------------------ where a run starts


def test_same_new_directory_for_save_and_load_starts_from_scratch(tmp_path):
    """Issue 16, item 1: `--save D --load D` on a job's first start (D not there yet)."""
    d = str(tmp_path / "ckpt")
    manager, lines = _manager("--save", d, "--load", d)
    assert manager.resolve() is None
    assert lines == [f" no checkpoint in {d}, starting from scratch"]


def test_an_empty_load_directory_starts_from_scratch(tmp_path):
    manager, lines = _manager("--load", str(tmp_path))
    assert manager.resolve() is None and "starting from scratch" in lines[0]


@pytest.mark.parametrize(
    "make,flags,match",
    [
        (lambda t: None, ["--load", "{t}/ckpt_typo"], "does not exist"),
        (lambda t: None, ["--load", "{t}/ckpt_typo", "--save", "{t}/ckpt"], "does not exist"),
        (lambda t: (t / "file").write_text("x"), ["--load", "{t}/file"], "is a file"),
        (
            lambda t: (t / "data.bin").write_text("x"),
            ["--load", "{t}", "--save", "{t}/c"],
            "not a checkpoint dir",
        ),
        (
            lambda t: (t / "config.json").write_text("{}"),
            ["--load", "{t}", "--save", "{t}/c"],
            "is a Hugging Face model folder .*/convert_checkpoint.py hf-to-mcore --load",
        ),
    ],
    ids=["typo", "typo-other-save", "file", "foreign-directory", "hf-folder"],
)
def test_a_load_that_is_not_a_checkpoint_is_one_line(tmp_path, make, flags, match):
    make(tmp_path)
    manager, _ = _manager(*(f.format(t=tmp_path) for f in flags))
    with pytest.raises(DiffmegError, match=match) as err:
        manager.resolve()
    assert "\n" not in str(err.value)


def test_ckpt_step_picks_any_complete_iteration(tmp_path):
    root = _fake_checkpoints(tmp_path / "c", [2, 4], tracker=4)
    assert _manager("--load", root)[0].resolve().iteration == 4
    assert _manager("--load", root, "--ckpt-step", "2")[0].resolve().iteration == 2
    with pytest.raises(DiffmegError) as err:
        _manager("--load", root, "--ckpt-step", "3")[0].resolve()
    assert str(err.value) == (
        f"--ckpt-step 3: {root}/iter_0000003 is missing; complete iterations in {root}: 2, 4; start from one "
        "with --ckpt-step N"
    )
    (tmp_path / "c" / TRACKER_FILE).write_text("6")  # names an iteration that is not there
    with pytest.raises(DiffmegError, match=rf"iteration 6, but {root}/iter_0000006 is missing; .*: 2, 4;"):
        _manager("--load", root)[0].resolve()


def test_a_checkpoint_past_train_iters_is_one_line_not_a_silent_exit(tmp_path):
    root = _fake_checkpoints(tmp_path / "c", [20], tracker=20)
    with pytest.raises(DiffmegError) as err:
        _manager("--load", root, "--train-iters", "15")[0].resolve()
    assert str(err.value) == (
        f"--load {root} is at iteration 20, past --train-iters 15: nothing to train; raise --train-iters (or "
        "--train-tokens) above 20 to continue the run, or add --finetune to train its weights on a new "
        "schedule"
    )
    assert _manager("--load", root, "--train-iters", "20")[0].resolve().iteration == 20  # requeued when done
    assert _manager("--load", root, "--train-iters", "15", "--finetune")[0].resolve().iteration == 20


def test_checkpoints_without_tracker_list_what_can_be_resumed(tmp_path):
    root = _fake_checkpoints(tmp_path / "c", [2, 4])
    os.makedirs(tmp_path / "c" / "iter_0000006")  # died mid-save: no args.json
    expected = rf"did not finish; complete iterations in {root}: 2, 4; start from one with --ckpt-step N"
    with pytest.raises(DiffmegError, match=expected):
        _manager("--load", root)[0].resolve()


def test_ckpt_step_needs_load():
    with pytest.raises(DiffmegError, match="--ckpt-step needs --load"):
        _manager("--ckpt-step", "2")


# ------------------------------------------------------------------------------------ the --save checks


@pytest.mark.parametrize(
    "save,match", [("/proc/nope", "cannot be created"), ("/proc", "is not writable")], ids=["create", "write"]
)
def test_an_unusable_save_target_is_one_line(single_rank_parallel_state, save, match):
    """Issue 16, item 2: found before training, not at the first save."""
    manager, _ = _manager("--save", save)
    with pytest.raises(DiffmegError, match=f"--save {save} {match}") as err:
        _lock(manager)
    assert "\n" not in str(err.value)


def test_a_save_target_is_created_locked_and_left_as_found(single_rank_parallel_state, tmp_path):
    """The folder holds only the lock until the run writes; a run that wrote nothing leaves nothing."""
    save = tmp_path / "a" / "b"
    manager, _ = _manager("--save", str(save))
    _lock(manager)
    assert os.listdir(save) == [LOCK_FILE]
    manager.close()
    assert not (tmp_path / "a").exists()


def test_leftovers_of_earlier_saves_are_named_at_start_never_removed(single_rank_parallel_state, tmp_path):
    for name in ("iter_0000006.saving-node7-4242-a1b2c3", "iter_0000002.replaced-20261127T101500"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "common.pt").write_bytes(b"0" * 2048)
    manager, lines = _manager("--save", str(tmp_path))
    _lock(manager)
    manager.close()
    assert lines == [
        f" {tmp_path} holds what earlier saves left (4.0 KiB): iter_0000002.replaced-20261127T101500, "
        f"iter_0000006.saving-node7-4242-a1b2c3; no run removes what another wrote: delete them to free the "
        f"space"
    ]
    assert sorted(os.listdir(tmp_path)) == [
        "iter_0000002.replaced-20261127T101500",
        "iter_0000006.saving-node7-4242-a1b2c3",
    ]


def test_a_save_target_needs_room_for_one_checkpoint(single_rank_parallel_state, tmp_path, monkeypatch):
    """Checked when the run takes --save, before the model is built: from the run's parameter count."""
    manager, _ = _manager("--save", str(tmp_path))
    _lock(manager)  # diff-tiny: 54.4M parameters, 652 MB in fp32 with two Adam moments: fits
    manager.close()
    assert manager.checkpoint_bytes == count_parameters(manager.run.model) * 12 == 54_365_184 * 12
    monkeypatch.setattr(checkpointing, "free_bytes", lambda path: 10 * 2**20)
    manager, _ = _manager("--save", str(tmp_path))
    with pytest.raises(DiffmegError) as err:
        _lock(manager)
    manager.close()
    assert str(err.value) == (
        f"--save {tmp_path} has 10.0 MiB free, one checkpoint of this model needs about 622.2 MiB; free "
        "space or point --save elsewhere"
    )


def test_checkpoint_size_follows_precision():
    assert checkpointing.checkpoint_bytes(1000, torch.bfloat16) == 1000 * (2 + 4 + 8)
    assert checkpointing.checkpoint_bytes(1000, torch.float32) == 1000 * (4 + 8)


# ------------------------------------------------------------------------------------ RNG across devices


class PhiloxTracker:
    """megatron-core's CUDA RNG tracker, as far as states go: fork() sets a 16-byte Philox state."""

    def __init__(self) -> None:
        self.states = {"model-parallel-rng": torch.zeros(16, dtype=torch.uint8)}

    def get_states(self) -> dict:
        return dict(self.states)

    def set_states(self, states: dict) -> None:
        self.states = states

    @contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if self.states[name].numel() != 16:  # what torch.cuda.set_rng_state says to a CPU generator state
            raise RuntimeError("RNG state is wrong size")
        yield


def test_cpu_saved_rng_state_resumes_on_another_device_type(single_rank_parallel_state, monkeypatch):
    """Issue 17, item 6: a CPU checkpoint's tracker states are skipped on CUDA (and said so), not set."""
    from megatron.core import tensor_parallel

    saved = checkpointing.rng_state()
    assert saved["device_type"] == "cpu"
    tracker = PhiloxTracker()
    monkeypatch.setattr(tensor_parallel, "get_cuda_rng_tracker", lambda: tracker)
    monkeypatch.setattr(checkpointing, "rng_device_type", lambda: "cuda")
    lines: list[str] = []
    checkpointing.restore_rng_state(saved, lines.append)
    with tracker.fork():  # the CPU states were not set into the CUDA tracker
        pass
    assert len(lines) == 1 and "saved on cpu and cannot be restored on cuda" in lines[0]


def test_rng_device_type_of_checkpoints_without_the_field():
    cpu = {"tracker": {"model-parallel-rng": torch.get_rng_state()}}  # 5056 bytes
    cuda = {"tracker": {"model-parallel-rng": torch.zeros(16, dtype=torch.uint8)}}
    assert checkpointing.saved_rng_device_type(cpu) == "cpu"
    assert checkpointing.saved_rng_device_type(cuda) == "cuda"


def test_same_device_rng_state_is_restored_exactly(single_rank_parallel_state):
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    saved = checkpointing.rng_state()
    with tracker.fork():
        first = torch.rand(4)
    lines: list[str] = []
    checkpointing.restore_rng_state(saved, lines.append)
    with tracker.fork():
        again = torch.rand(4)
    assert torch.equal(first, again) and not lines


# ------------------------------------------------------------------------------------ the LR schedule


@pytest.fixture(scope="module")
def four_iterations(single_rank_parallel_state, tmp_path_factory) -> str:
    """A checkpoint of SMALL's schedule over 4 iterations (linear from 3e-3 to 3e-4 after 1 of warmup)."""
    root = str(tmp_path_factory.mktemp("schedule") / "ckpt")
    trainer = _trainer(SMALL, "--min-lr", "3e-4", "--train-iters", "4", "--save", root)
    try:
        trainer.train()
    finally:
        _release(trainer)
    return root


def _trainer(*flags):
    from diffmeg.training.trainer import Trainer

    args = [f for group in flags for f in ([group] if isinstance(group, str) else group)]
    return Trainer(RunConfig.from_args(resolve_args(args, world_size=1)), callbacks=[])


def _release(trainer) -> None:
    from diffmeg.training.builders import release_training_objects

    release_training_objects(trainer.model_config, trainer.model)


def _first_resumed_lr(root: str, *flags: str) -> float:
    """The learning rate iteration 5 trains with when SMALL resumes `root` with `flags`."""
    trainer = _trainer(SMALL, "--min-lr", "3e-4", "--load", root, *flags)
    try:
        assert trainer.state.iteration == 4
        return trainer.optimizer.param_groups[0]["lr"]
    finally:
        _release(trainer)


def test_a_longer_run_is_refused_naming_the_decay_iterations_and_both_flags(four_iterations):
    """--train-iters 8 moves --lr-decay-iters (its default) from 4 to 8: Megatron-LM's mismatch."""
    flags = [*SMALL, "--min-lr", "3e-4", "--load", four_iterations, "--train-iters", "8", "--lr", "6e-3"]
    manager = CheckpointManager(RunConfig.from_args(resolve_args(flags, world_size=1)))
    with pytest.raises(DiffmegError) as err:
        manager.resolve()
    assert str(err.value) == (
        f"checkpoint {four_iterations}/iter_0000004 was trained on another learning-rate schedule: "
        "--lr 0.006 (checkpoint: 0.003); --lr-decay-iters 8 (checkpoint: 4; it follows --train-iters 8 "
        "unless given); add --override-opt-param-scheduler to go on with this run's schedule from iteration "
        "4, or --use-checkpoint-opt-param-scheduler to keep the checkpoint's"
    )


def test_the_same_schedule_resumes_without_a_flag(four_iterations):
    lr = _first_resumed_lr(four_iterations, "--train-iters", "8", "--lr-decay-iters", "4")
    assert lr == pytest.approx(3e-4)  # past the decay: --min-lr


def test_override_takes_this_runs_schedule_lr_included(four_iterations):
    """Iteration 5 under this run's schedule: warmup 1, linear decay over 8, from --lr 6e-3 (the optimizer
    state's param groups carry the checkpoint's 3e-3: Megatron-LM issue 1138)."""
    flags = ("--train-iters", "8", "--lr", "6e-3", "--override-opt-param-scheduler")
    lr = _first_resumed_lr(four_iterations, *flags)
    assert lr == pytest.approx(3e-4 + (1 - 3 / 7) * (6e-3 - 3e-4))


def test_use_checkpoint_keeps_the_checkpoints_schedule(four_iterations):
    flags = ("--train-iters", "8", "--lr", "6e-3", "--use-checkpoint-opt-param-scheduler")
    lr = _first_resumed_lr(four_iterations, *flags)
    assert lr == pytest.approx(3e-4)  # its decay ended at iteration 4


# ------------------------------------------------------------------------------------ precision


def _bf16_copy(root: str, tmp_path) -> str:
    """`root`'s latest iteration as a bf16 run would have saved it, without weights (the precision check
    reads its args.json before anything loads)."""
    import json
    from pathlib import Path

    saved = json.loads((Path(root) / "iter_0000004" / "args.json").read_text())
    fake_checkpoint(
        tmp_path / "bf16", 4, {**saved, "bf16": True}, torch.load(f"{root}/iter_0000004/common.pt")
    )
    (tmp_path / "bf16" / TRACKER_FILE).write_text("4")
    return str(tmp_path / "bf16")


def test_an_fp32_checkpoint_resumed_with_bf16_is_one_line(four_iterations):
    """The optimizer of an fp32 run has no fp32 main weights for a bf16 one: named before anything loads,
    not megatron-core's missing-tensor error ending in 'point the run at another checkpoint'."""
    flags = [*SMALL, "--min-lr", "3e-4", "--train-iters", "4", "--load", four_iterations, "--bf16"]
    with pytest.raises(DiffmegError) as err:
        CheckpointManager(RunConfig.from_args(resolve_args(flags, world_size=1))).resolve()
    assert str(err.value) == (
        f"checkpoint {four_iterations}/iter_0000004 was saved with fp32 and this run is bf16: drop --bf16 to "
        "match, or add --no-load-optim to load only the weights (a fresh optimizer)"
    )


def test_a_bf16_checkpoint_resumed_in_fp32_is_one_line(four_iterations, tmp_path):
    """Without --bf16 megatron-core's optimizer load ends in `KeyError: 'pre_wd_mult'`."""
    root = _bf16_copy(four_iterations, tmp_path)
    flags = [*SMALL, "--min-lr", "3e-4", "--train-iters", "4", "--load", root]
    with pytest.raises(DiffmegError) as err:
        CheckpointManager(RunConfig.from_args(resolve_args(flags, world_size=1))).resolve()
    assert str(err.value) == (
        f"checkpoint {root}/iter_0000004 was saved with bf16 and this run is fp32: pass --bf16 to match, or "
        "add --no-load-optim to load only the weights (a fresh optimizer)"
    )
    flags += ["--no-load-optim"]
    assert CheckpointManager(RunConfig.from_args(resolve_args(flags, world_size=1))).resolve() is not None


def test_no_load_optim_loads_an_fp32_checkpoints_weights_into_a_bf16_run(four_iterations):
    """The fix the precision line offers works: the weights convert, the optimizer starts fresh."""
    trainer = _trainer(SMALL, "--min-lr", "3e-4", "--train-iters", "4", "--load", four_iterations)
    try:
        fp32 = [p.detach().clone() for p in trainer.model[0].parameters()]
    finally:
        _release(trainer)
    flags = ("--train-iters", "8", "--load", four_iterations, "--bf16", "--no-load-optim")
    trainer = _trainer(SMALL, "--min-lr", "3e-4", *flags)
    try:
        bf16 = [p.detach() for p in trainer.model[0].parameters()]
        assert trainer.state.iteration == 4 and bf16[0].dtype == torch.bfloat16
        assert all(torch.equal(a.to(torch.bfloat16), b) for a, b in zip(fp32, bf16, strict=True))
    finally:
        _release(trainer)
