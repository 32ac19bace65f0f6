"""Two tiny checkpoints (DIFF and its Transformer baseline) and small indexed datasets for the
evaluation tests, shared by tests/eval and tests/tools within one pytest session."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from tests.distributed.runner import run_training

CKPT_SEQ_LENGTH = 64
"""tests/distributed/runner.py trains at this length: the tool's default evaluation length."""
MOCK_VOCAB = 512
NAMES = {"diff": "diff-tiny", "transformer": "transformer-tiny"}


def tiny_checkpoints(base: Path) -> dict[str, Path]:
    """`{"diff": dir, "transformer": dir}`, trained for 2 iterations on mock data (vocab 512).

    Both runs start at once (each is mostly process start-up and checkpoint I/O); a later call in the
    same session reuses them.
    """
    out = base / "eval_tiny_checkpoints"
    paths = {name: out / name for name in NAMES}
    if all((p / "latest_checkpointed_iteration.txt").is_file() for p in paths.values()):
        return paths
    out.mkdir(parents=True, exist_ok=True)

    def train(name: str) -> None:
        run_training(
            out, name, ["--model", NAMES[name], "--train-iters", "2", "--global-batch-size", "2",
                        "--save", str(paths[name])]
        )  # fmt: skip

    with ThreadPoolExecutor(len(NAMES)) as pool:
        list(pool.map(train, NAMES))
    return paths


def write_indexed_dataset(prefix: Path | str, documents: Sequence[Sequence[int]]) -> str:
    """An int32 megatron-core indexed dataset with one sequence per document; returns the prefix."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(prefix)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for doc in documents:
        tokens = np.asarray(doc, dtype=np.int32)
        builder.add_document(tokens, [len(tokens)])
    builder.finalize(prefix + ".idx")
    return prefix


def periodic_documents(lengths: Sequence[int], vocab: int = MOCK_VOCAB, seed: int = 0) -> list[np.ndarray]:
    """Documents that repeat a random 16-token pattern: a model with context can learn to copy it."""
    rng = np.random.default_rng(seed)
    return [np.resize(rng.integers(0, vocab, 16), n) for n in lengths]


def fake_checkpoint(root: Path, args: dict, iteration: int = 1) -> Path:
    """A checkpoint directory with arguments but no weights: enough for checks made before loading."""
    path = root / f"iter_{iteration:07d}"
    path.mkdir(parents=True)
    (path / "args.json").write_text(json.dumps(args))
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return root


def checkpoint_args(root: Path) -> dict:
    (iteration,) = [d for d in os.listdir(root) if d.startswith("iter_")]
    return json.loads((root / iteration / "args.json").read_text())
