"""The cheapest in-process training run of the tests: a 2-layer model, a few Trainer steps on mock data."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from diffmeg.run_config import RunConfig
from diffmeg.training.arguments import resolve_args

SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "2", "--seq-length", "32"]
SMALL += ["--mock-data", "--vocab-size", "128", "--micro-batch-size", "2", "--global-batch-size", "4"]
SMALL += ["--lr", "3e-3", "--eval-iters", "0", "--lr-warmup-iters", "1", "--train-iters", "20"]
STEPS = 5


def train_steps(*flags: str, steps: int = STEPS) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """Losses, grad norms and final (main) weights of `steps` Trainer steps of SMALL with `flags`; the
    run's hooks are released afterwards, so a test can run several in one process."""
    from diffmeg.training.builders import release_training_objects
    from diffmeg.training.trainer import Trainer

    run = RunConfig.from_args(resolve_args([*SMALL, *flags], world_size=1))
    trainer = Trainer(run, callbacks=[])
    try:
        for chunk in trainer.model:
            chunk.train()
        losses, norms = [], []
        for _ in range(steps):
            out = trainer.train_step()
            losses.append(float(out.loss))
            norms.append(float(out.grad_norm))
        return losses, norms, main_weights(trainer)
    finally:
        release_training_objects(trainer.model_config, trainer.model)


def main_weights(trainer) -> dict[str, torch.Tensor]:
    """The fp32 weights the optimizer updates, by parameter name: under --bf16 the main copies (the bf16
    model weights round them, so one fp32 ulp there can be one bf16 ulp here)."""
    main = {}
    for opt in trainer.optimizer.chained_optimizers:
        pairs = zip(
            getattr(opt, "float16_groups", []), getattr(opt, "fp32_from_float16_groups", []), strict=True
        )
        for model_group, main_group in pairs:
            main.update({id(p): m for p, m in zip(model_group, main_group, strict=True)})
    return {n: main.get(id(p), p).detach().clone() for n, p in trainer.model[0].named_parameters()}


def fake_checkpoint(root: Path, iteration: int, args: dict, common: dict | None = None) -> str:
    """`root/iter_N` as a run reads it at start, without weights: `args` as its args.json and megatron-core's
    common state (the counters, plus `common`); `root`."""
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config

    path = root / f"iter_{iteration:07d}"
    path.mkdir(parents=True)
    save_config(CheckpointingConfig("torch_dist"), str(path))
    torch.save({"iteration": iteration, "consumed_samples": 0, **(common or {})}, path / "common.pt")
    (path / "args.json").write_text(json.dumps(args))
    return str(root)
