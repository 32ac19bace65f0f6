"""Checkpoints written at once, as the tests need them: `diffmeg.checkpoints.begin_checkpoint`'s request
run now (`diffmeg.compat.checkpoint_writer.run_now`), what a synchronous save of training does."""

from __future__ import annotations

import argparse

from diffmeg.checkpoints import begin_checkpoint, checkpoint_path
from diffmeg.compat.checkpoint_writer import run_now


def write_checkpoint(root: str, iteration: int, state: dict, args: argparse.Namespace | dict, **kw) -> str:
    """Save `state` (a sharded state dict plus common entries) as `{root}/iter_N`; its directory."""
    run_now(begin_checkpoint(root, iteration, state, args, **kw))
    return checkpoint_path(root, iteration)
