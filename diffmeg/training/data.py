"""Training batches: datasets (real, builtin or mock) and the per-rank slice of each global batch.

Batch layout follows Megatron-LM's pretraining sampler: global batch `n` covers dataset samples
`[n * G, (n + 1) * G)`; micro-step `m` of data-parallel rank `r` reads the `r`-th block of `mbs`
samples of the m-th chunk of `mbs * dp`. Any DP size therefore sees the same samples per global batch,
and resuming from `consumed_samples` continues exactly where the run stopped.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from megatron.core import parallel_state

from diffmeg.data.gpt_datasets import build_gpt_datasets, check_blend, parse_data_path
from diffmeg.data.indexed import has_loss_mask
from diffmeg.data.loss_mask import build_loss_mask_datasets
from diffmeg.data.tokenizers import build_tokenizer
from diffmeg.errors import DiffmegError
from diffmeg.parallel import slice_sequence_for_cp
from diffmeg.run_config import RunConfig


class MockTokenDataset(torch.utils.data.Dataset):
    """Deterministic synthetic sequences with learnable structure (each repeats a random segment)."""

    def __init__(self, vocab_size: int, seq_length: int, seed: int, size: int = 10**9) -> None:
        self.vocab_size, self.seq_length, self.seed, self.size = vocab_size, seq_length, seed, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        rng = np.random.default_rng((self.seed, idx))
        period = int(rng.integers(8, 33))
        segment = rng.integers(0, self.vocab_size, size=period)
        text = np.resize(segment, self.seq_length + 1)  # repeats the segment
        tokens = torch.from_numpy(text.astype(np.int64))
        return {
            "tokens": tokens[:-1],
            "labels": tokens[1:],
            "loss_mask": torch.ones(self.seq_length, dtype=torch.float32),
            "position_ids": torch.arange(self.seq_length, dtype=torch.int64),
        }


def build_datasets(run: RunConfig):
    """(train, valid, test) datasets for the run; valid/test may be None. Data whose ids are not the run's
    (another tokenizer's, or ids past its vocabulary) is one line here: the Trainer builds the datasets
    before the model."""
    m, t, d, log = run.model, run.training, run.data, run.logging
    if d.mock_data:
        return (
            MockTokenDataset(m.vocab_size, m.seq_length, t.seed),
            MockTokenDataset(m.vocab_size, m.seq_length, t.seed + 1),
            None,
        )

    eval_runs = t.train_iters // log.eval_interval + 1 if log.eval_iters > 0 else 0
    num_samples = (
        t.train_iters * t.global_batch_size,
        eval_runs * log.eval_iters * t.global_batch_size,
        log.eval_iters * t.global_batch_size,
    )
    prefixes, _ = parse_data_path(d.data_path)
    check_blend(prefixes, d.split)  # what --dry-run checks too, in the same words
    if any(has_loss_mask(p) for p in prefixes):  # one whole document per sample, loss on masked tokens
        return build_loss_mask_datasets(prefixes, d.split, m.seq_length, t.seed, num_samples, m.vocab_size)
    tokenizer = build_tokenizer(
        d.tokenizer_type,
        tokenizer_file=d.tokenizer_file,
        tokenizer_model=d.tokenizer_model,
        vocab_size=m.vocab_size,
    )
    if tokenizer.vocab_size > m.vocab_size:
        raise DiffmegError(
            f"--vocab-size {m.vocab_size} is smaller than the tokenizer's {tokenizer.vocab_size} ids; pass a "
            f"--vocab-size of at least {tokenizer.vocab_size}"
        )
    return build_gpt_datasets(
        data_path=d.data_path,
        split=d.split,
        seq_length=m.seq_length,
        seed=t.seed,
        num_samples=num_samples,
        tokenizer=tokenizer,
        cache_path=d.data_cache_path,
        vocab_size=m.vocab_size,
    )


def microbatches(
    dataset, consumed_samples: int, global_batch_size: int, micro_batch_size: int, pin_memory: bool = False
) -> Iterator[dict[str, torch.Tensor]]:
    """This rank's micro-batches of the global batch starting at `consumed_samples`.

    `pin_memory` (for a CUDA model): page-locked batches, so `to_device` copies them without a host sync.
    """
    dp = parallel_state.get_data_parallel_world_size()
    rank = parallel_state.get_data_parallel_rank()
    cp_size = parallel_state.get_context_parallel_world_size()
    cp_rank = parallel_state.get_context_parallel_rank()
    for m in range(global_batch_size // (micro_batch_size * dp)):
        start = consumed_samples + m * micro_batch_size * dp + rank * micro_batch_size
        samples = [dataset[(start + i) % len(dataset)] for i in range(micro_batch_size)]
        batch = {
            key: torch.stack([torch.as_tensor(s[key]) for s in samples])
            for key in ("tokens", "labels", "loss_mask", "position_ids")
        }  # each [mbs, s]
        if cp_size > 1:  # this CP rank's tokens, in megatron-core's load-balanced layout
            batch = {k: slice_sequence_for_cp(v, 1, cp_rank, cp_size) for k, v in batch.items()}
        if pin_memory:
            batch = {k: v.pin_memory() for k, v in batch.items()}
        yield batch


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """A micro-batch on the model's device; to CUDA asynchronously (pinned batches: see `microbatches`)."""
    non_blocking = device.type == "cuda"
    return {k: v.to(device, non_blocking=non_blocking) for k, v in batch.items()}
