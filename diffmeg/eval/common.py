"""What the analysis tools share: checkpoint selection and loading, needle vocabularies, outputs.

Checkpoint reading is `diffmeg.checkpoints`', the single-process group `diffmeg.runtime`'s, labels and
output-directory checks the long-context tool's; this module strings them together for several tools.
"""

from __future__ import annotations

import csv
import gc
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from diffmeg.checkpoints import DTYPES, CheckpointInfo, load_checkpoint_model, read_checkpoint_info
from diffmeg.errors import DiffmegError
from diffmeg.eval.long_context import check_same_vocabulary, default_labels, prepare_output_dir
from diffmeg.runtime import single_process

Log = Callable[[str], None]


def stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass
class CheckpointSet:
    """The --load/--label/--iteration flags of a tool, resolved before any weights are read."""

    loads: list[str]
    labels: list[str] | None = None
    iterations: list[int] | None = None

    def resolve(self) -> list[CheckpointInfo]:
        """Checkpoint infos with labels; one vocabulary for all (they see the same prompts)."""
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


def loaded_models(
    infos: Sequence[CheckpointInfo], dtype: str = "float32", seed: int = 1234
) -> Iterator[tuple[CheckpointInfo, torch.nn.Module]]:
    """Each checkpoint's (or Hugging Face folder's) single-rank model in eval mode, one at a time (freed
    before the next loads)."""
    if dtype not in DTYPES:
        raise DiffmegError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype}")
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


def needle_vocab(info: CheckpointInfo, text_files: Sequence[str] | None, tokenizer_file: str | None):
    """`IdVocab` for mock-data checkpoints, `TextVocab` (filler from --text-files) for cl100k ones."""
    from diffmeg.eval.needle import IdVocab, TextVocab

    if info.tokenizer == "mock":
        if text_files:
            raise DiffmegError(
                f"{info.root} was trained on mock ids (vocab {info.vocab_size}); --text-files need a cl100k "
                "checkpoint (mock checkpoints get random-id filler)"
            )
        return IdVocab(info.vocab_size)  # fixed ids per vocabulary: what an id-corpus model was trained on
    if not text_files:
        raise DiffmegError(f"{info.root} reads cl100k text: give --text-files for the filler")
    from diffmeg.data.tokenizer import load_tokenizer
    from diffmeg.eval.long_context import expand_text_files

    texts = []
    for path in expand_text_files(text_files):
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                texts.append(f.read())
        except OSError as exc:
            raise DiffmegError(f"cannot read text file {path}: {exc.strerror}") from None
    return TextVocab(load_tokenizer(tokenizer_file), "\n".join(texts))


def forward(model: torch.nn.Module, tokens: Sequence[int]) -> torch.Tensor:
    """Logits [s, V] (float32) of one prompt at positions 0..s-1."""
    device = next(model.parameters()).device
    ids = torch.as_tensor(list(tokens), dtype=torch.long, device=device).unsqueeze(0)
    positions = torch.arange(ids.shape[1], device=device).unsqueeze(0)
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=positions, attention_mask=None)
    return logits[0].float()


def write_json(path: str, data: dict) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, default=str)
        f.write("\n")
    os.replace(tmp, path)


def write_rows(path: str, rows: Sequence[dict]) -> None:
    """A CSV with the keys of the first row as header (written atomically)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else [])
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, path)


def start_outputs(output_dir: str, plot: bool) -> None:
    """Fail on an unwritable directory or a missing matplotlib before any model is loaded."""
    prepare_output_dir(output_dir)
    if plot:
        from diffmeg.eval.plotting import require_matplotlib

        require_matplotlib()


def add_checkpoint_arguments(parser) -> None:
    """--load/--label/--iteration, the same for every analysis tool (several checkpoints side by side)."""
    parser.add_argument(
        "--load",
        action="extend",
        nargs="+",
        required=True,
        help="checkpoint directories (pretrain_diff.py --save) or Hugging Face DiffLlama / Llama folders",
    )
    parser.add_argument("--label", action="extend", nargs="+", default=None, help="one label per --load")
    parser.add_argument(
        "--iteration",
        type=int,
        nargs="+",
        default=None,
        help="one for all, or one per --load (checkpoint directories only)",
    )


def add_output_arguments(parser, output_dir: str) -> None:
    """--dtype/--output-dir/--no-plot, the same for every analysis tool."""
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--output-dir", default=output_dir)
    parser.add_argument("--no-plot", action="store_true")


def common_config_fields(args) -> dict:
    """The config fields every analysis tool takes from the flags above (plus --seed)."""
    return {
        "checkpoints": CheckpointSet(args.load, args.label, args.iteration),
        "seed": args.seed,
        "output_dir": args.output_dir,
        "dtype": args.dtype,
        "plot": not args.no_plot,
    }
