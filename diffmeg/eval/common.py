"""What every evaluation shares: the checkpoints it reads, the models it loads, the files it writes.

Checkpoint reading and building are `diffmeg.checkpoints`', the one-process group `diffmeg.runtime`'s;
this module strings them together for the tools: a `CheckpointSet` (the --load/--label/--iteration
values) resolved and checked before any weights are read, the models loaded one at a time, and the
output directory proven writable before the work starts. `EvalConfig` holds the fields every tool's
config has (the flags of `diffmeg.cli`).
"""

from __future__ import annotations

import csv
import gc
import glob
import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import KW_ONLY, dataclass

import torch

from diffmeg import storage
from diffmeg.checkpoints import DTYPES
from diffmeg.data.tiktoken_cl100k import EOD_ID
from diffmeg.data.tokenizers import text_tokenizer
from diffmeg.errors import DiffmegError
from diffmeg.eval.plotting import require_matplotlib
from diffmeg.model_source import CheckpointInfo, load_checkpoint_model, read_checkpoint_info
from diffmeg.runtime import single_process
from diffmeg.storage import atomic_write

Log = Callable[[str], None]


# ----------------------------------------------------------------------------------------------------
# Checkpoints


def check_same_vocabulary(infos: Sequence[CheckpointInfo]) -> None:
    """Checkpoints compared side by side must read the same token ids the same way."""
    first = infos[0]
    for other in infos[1:]:
        if (other.tokenizer, other.vocab_size) != (first.tokenizer, first.vocab_size):
            raise DiffmegError(
                f"checkpoints use different tokenizers/vocabularies: {first.root} ({first.tokenizer}, "
                f"vocab {first.vocab_size}) vs {other.root} ({other.tokenizer}, vocab {other.vocab_size}); "
                "compare checkpoints trained with the same tokenizer"
            )


def default_labels(infos: Sequence[CheckpointInfo]) -> list[str]:
    """`DIFF (dirname)` / `Transformer (dirname)`, made unique by iteration, then by order."""

    def name(info: CheckpointInfo) -> str:
        return os.path.basename(os.path.normpath(info.root)) or info.root

    labels = [f"{i.architecture} ({name(i)})" for i in infos]
    if len(set(labels)) < len(labels):
        labels = [f"{i.architecture} ({name(i)} @ {'hf' if i.hf else i.iteration})" for i in infos]
    if len(set(labels)) < len(labels):
        labels = [f"{label} #{k + 1}" for k, label in enumerate(labels)]
    return labels


def eod_id(info: CheckpointInfo) -> int:
    """The end-of-document token of the ids a checkpoint reads: cl100k's `<|endoftext|>`, a Hugging Face
    tokenizer's end of sequence, or the last id of a mock / `--tokenizer-type null` vocabulary (the
    convention of the generated corpora)."""
    if info.tokenizer == "HuggingFaceTokenizer":
        return text_tokenizer(info.args).eod
    return EOD_ID if info.tokenizer == "cl100k_base" else info.vocab_size - 1


@dataclass
class CheckpointSet:
    """The --load/--label/--iteration flags of a tool, resolved before any weights are read."""

    loads: list[str]
    labels: list[str] | None = None
    iterations: list[int | None] | None = None

    def resolve(self) -> list[CheckpointInfo]:
        """Checkpoint infos with labels; one vocabulary for all (they see the same inputs)."""
        if not self.loads:
            raise DiffmegError("give at least one --load")
        if self.labels and len(self.labels) != len(self.loads):
            raise DiffmegError(
                f"{len(self.labels)} --label value(s) for {len(self.loads)} --load; give one each"
            )
        if self.labels and len(set(self.labels)) != len(self.labels):
            raise DiffmegError(f"--label values must be distinct, got {self.labels}")
        iterations = self.iterations or [None]
        if len(iterations) not in (1, len(self.loads)):
            raise DiffmegError(f"--iteration takes one value, or one per --load ({len(self.loads)})")
        if len(iterations) == 1:
            iterations = iterations * len(self.loads)
        infos = [read_checkpoint_info(root, it) for root, it in zip(self.loads, iterations, strict=True)]
        check_same_vocabulary(infos)
        for info, label in zip(infos, self.labels or default_labels(infos), strict=True):
            info.label = label
        return infos


@dataclass
class EvalConfig:
    """The fields every evaluation's config has; a tool's config adds its own after `checkpoints`."""

    checkpoints: CheckpointSet
    _: KW_ONLY
    seed: int = 1234
    """Seeds the sampled inputs (prompts, documents, random ids) and the model-parallel RNG."""
    output_dir: str = "eval_output"
    dtype: str = "float32"
    """Weights and activations: float32 (exact; CPU), bfloat16 or float16."""
    plot: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise DiffmegError(f"--dtype must be one of {sorted(DTYPES)}, got {self.dtype}")

    def require_positive(self, *names: str) -> None:
        """Each named field, where set, is >= 1; else one line naming its flag."""
        for name in names:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise DiffmegError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def loaded_models(
    infos: Sequence[CheckpointInfo], dtype: str = "float32", seed: int = 1234
) -> Iterator[tuple[CheckpointInfo, torch.nn.Module]]:
    """Each checkpoint's (or Hugging Face folder's) single-rank model in eval mode, one at a time (freed
    before the next loads). `dtype` a name of `DTYPES` (`EvalConfig` checked it)."""
    single_process(seed)
    for info in infos:
        model = load_checkpoint_model(info, DTYPES[dtype])
        try:
            yield info, model
        finally:
            del model
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


def forward(model: torch.nn.Module, tokens: Sequence[int]) -> torch.Tensor:
    """Logits [s, V] (float32) of one prompt at positions 0..s-1."""
    device = next(model.parameters()).device
    ids = torch.as_tensor(list(tokens), dtype=torch.long, device=device).unsqueeze(0)
    positions = torch.arange(ids.shape[1], device=device).unsqueeze(0)
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=positions, attention_mask=None)
    return logits[0].float()


# ----------------------------------------------------------------------------------------------------
# Inputs


def expand_text_files(patterns: Sequence[str]) -> list[str]:
    """Files matching each glob (sorted), or the path itself; each file once, in the order given."""
    paths: list[str] = []
    for pattern in patterns:
        found = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
        found = [p for p in found if os.path.isfile(p)]
        if not found:
            raise DiffmegError(f"--text-files {pattern!r} matches no file")
        paths.extend(p for p in found if p not in paths)
    return paths


def read_text_file(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError as exc:
        raise DiffmegError(f"cannot read text file {path}: {exc.strerror}") from None


# ----------------------------------------------------------------------------------------------------
# Outputs


def prepare_output_dir(path: str) -> None:
    """Create the output directory and prove it writable before hours of evaluation."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise DiffmegError(f"--output-dir {path} exists and is not a directory")
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write-test-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as exc:
        raise DiffmegError(f"--output-dir {path} is not writable: {exc.strerror}") from None


def start_outputs(output_dir: str, plot: bool) -> None:
    """Fail on an unwritable directory or a missing matplotlib before any model is loaded."""
    prepare_output_dir(output_dir)
    if plot:
        require_matplotlib()


def write_json(path: str, data: dict) -> None:
    """`data` as indented JSON, written atomically (a crash or Ctrl-C leaves the previous file and no
    temporary: the tools' Ctrl-C line says so)."""
    storage.write_json(path, data, default=str)


def write_jsonl(path: str, records: Sequence[dict]) -> None:
    """One JSON object per line, written atomically."""
    with atomic_write(path) as f:
        f.writelines(json.dumps(r, default=str) + "\n" for r in records)


def write_rows(path: str, rows: Sequence[dict]) -> None:
    """A CSV with the keys of the first row as header (written atomically)."""
    with atomic_write(path, newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else [])
        writer.writeheader()
        writer.writerows(rows)
