"""Which tokenizer a run, a dataset and a checkpoint use, and the checks that they agree.

Three kinds (`--tokenizer-type`):
- `cl100k_base`: the paper's tokenizer (tiktoken, `--tokenizer-file`), the default;
- `HuggingFaceTokenizer`: a Hugging Face tokenizer folder (`--tokenizer-model PATH`, Megatron-LM's names):
  a model imported or upcycled from a Hugging Face Llama keeps its own vocabulary and tokenizer;
- `null`: token ids of no tokenizer (mock data, generated corpora).

What each records, so that token ids are never read with another tokenizer's meaning:
- a run's resolved arguments, hence every checkpoint's args.json: `tokenizer_type`, `tokenizer_model`
  and `tokenizer_fingerprint` (a hash of the vocabulary, `resolve_tokenizer_args`);
- a dataset written by tools/preprocess_data.py: `{prefix}.tokenizer.json` beside its .bin/.idx.

A run refuses a checkpoint (`check_checkpoint`) or a dataset (`check_datasets`) made with another
vocabulary, in one line naming both and the fix; and any dataset holding ids its embedding has no row
for (`check_vocabulary`, against `--vocab-size`: `null` ids too). Datasets without a record were written
before records existed, by diffmeg's cl100k_base tools: they count as cl100k_base. A Hugging Face folder
holding diffmeg's own cl100k_base export (tools/convert_checkpoint.py mcore-to-hf) has cl100k_base's ids
and counts as cl100k_base.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from diffmeg.data.hf_tokenizer import HF_TOKENIZER, HFTokenizer
from diffmeg.data.tiktoken_cl100k import Cl100kTokenizer, IdTokenizer, load_tokenizer
from diffmeg.data.token_range import token_range
from diffmeg.errors import DiffmegError
from diffmeg.storage import write_json

CL100K = "cl100k_base"
NULL = "null"
TOKENIZER_TYPES = (CL100K, HF_TOKENIZER, NULL)
RECORD_SUFFIX = ".tokenizer.json"
"""A dataset's tokenizer record: `{prefix}.tokenizer.json`."""
CL100K_HF_FINGERPRINT = "b9597a51a614db3c3250d93ecde8530221b4ada20a960b7f3206e10a96123588"
"""`vocabulary_fingerprint` of diffmeg's cl100k_base export (diffmeg.conversion.tokenizer_export; checked
by tests/data/test_tokenizers.py): such a folder has cl100k_base's ids."""


@dataclass(frozen=True)
class TokenizerRecord:
    """The vocabulary token ids belong to."""

    type: str
    """cl100k_base, HuggingFaceTokenizer or null."""
    fingerprint: str | None = None
    """HuggingFaceTokenizer: sha256 of its vocabulary (None: unknown, an older record)."""
    model: str | None = None
    """HuggingFaceTokenizer: the folder it was loaded from (for messages)."""

    def same_ids(self, other: TokenizerRecord) -> bool:
        """Ids of one mean the same tokens in the other (null ids are anyone's: not checked)."""
        if NULL in (self.type, other.type):
            return True
        if self.type != other.type:
            return False
        return (
            self.type != HF_TOKENIZER
            or None in (self.fingerprint, other.fingerprint)
            or (self.fingerprint == other.fingerprint)
        )

    def describe(self) -> str:
        if self.type == HF_TOKENIZER:
            short = (self.fingerprint or "unknown")[:12]
            return f"the Hugging Face tokenizer {self.model or '(folder unknown)'} (vocabulary {short})"
        return "cl100k_base" if self.type == CL100K else "no tokenizer (token ids)"

    def as_json(self) -> dict:
        return {
            "tokenizer_type": self.type,
            "tokenizer_fingerprint": self.fingerprint,
            "tokenizer_model": self.model,
        }


def build_tokenizer(
    tokenizer_type: str,
    *,
    tokenizer_file: str | None = None,
    tokenizer_model: str | None = None,
    vocab_size: int | None = None,
):
    """The tokenizer object of a `--tokenizer-type` (cl100k_base: `--tokenizer-file`; HuggingFaceTokenizer:
    `--tokenizer-model`; null: ids below `vocab_size`)."""
    if tokenizer_type == HF_TOKENIZER:
        if not tokenizer_model:
            raise DiffmegError(
                "--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model PATH (its folder)"
            )

        return HFTokenizer(tokenizer_model)
    if tokenizer_type == NULL:
        if vocab_size is None:
            raise DiffmegError(
                "--tokenizer-type null needs --vocab-size (one more than the largest token id)"
            )
        return IdTokenizer(vocab_size)
    if tokenizer_type != CL100K:
        raise DiffmegError(f"--tokenizer-type {tokenizer_type!r}: choose one of {', '.join(TOKENIZER_TYPES)}")

    return load_tokenizer(tokenizer_file)


def record_of(tokenizer) -> TokenizerRecord:
    """The record of a tokenizer object (`build_tokenizer`'s)."""
    if isinstance(tokenizer, HFTokenizer):
        if tokenizer.fingerprint == CL100K_HF_FINGERPRINT:
            return TokenizerRecord(CL100K)
        return TokenizerRecord(HF_TOKENIZER, tokenizer.fingerprint, tokenizer.source)
    return TokenizerRecord(CL100K if isinstance(tokenizer, Cl100kTokenizer) else NULL)


def record_of_args(args: Mapping | argparse.Namespace) -> TokenizerRecord:
    """The record of a run's resolved arguments (a checkpoint's args.json): mock data and `null` are ids of
    no tokenizer; arguments from before `--tokenizer-type` existed mean cl100k_base."""
    values = vars(args) if isinstance(args, argparse.Namespace) else args
    kind = values.get("tokenizer_type") or CL100K
    if values.get("mock_data"):
        kind = NULL
    if kind == HF_TOKENIZER:
        return TokenizerRecord(kind, values.get("tokenizer_fingerprint"), values.get("tokenizer_model"))
    return TokenizerRecord(kind)


def resolve_tokenizer_args(args: argparse.Namespace) -> None:
    """Check a run's tokenizer flags and derive `tokenizer_fingerprint` and the default `--vocab-size`
    (called by `resolve_args`; loads a Hugging Face tokenizer, never cl100k_base's file).

    HuggingFaceTokenizer: the folder must load; a diffmeg cl100k_base export is recorded as cl100k_base; the
    vocabulary size defaults to the tokenizer's ids rounded up to a multiple of 64 and must hold them.
    """
    args.tokenizer_fingerprint = None
    if args.tokenizer_type != HF_TOKENIZER:
        if getattr(args, "tokenizer_model", None):
            raise DiffmegError(
                f"--tokenizer-model is the folder of --tokenizer-type HuggingFaceTokenizer; this run uses "
                f"{args.tokenizer_type}: pass --tokenizer-type HuggingFaceTokenizer with it"
            )
        return
    if args.mock_data:
        raise DiffmegError("--mock-data generates token ids: drop --tokenizer-type HuggingFaceTokenizer")
    tokenizer = build_tokenizer(HF_TOKENIZER, tokenizer_model=args.tokenizer_model)
    args.tokenizer_model = tokenizer.source
    record = record_of(tokenizer)
    args.tokenizer_fingerprint = record.fingerprint if record.type == HF_TOKENIZER else None
    if record.type == CL100K:
        args.tokenizer_type, args.tokenizer_model = CL100K, None  # the same ids: one name for them
    if args.vocab_size is None:
        args.vocab_size = -(-tokenizer.vocab_size // 64) * 64
    if args.vocab_size < tokenizer.vocab_size:
        raise DiffmegError(
            f"--vocab-size {args.vocab_size} is smaller than the {tokenizer.vocab_size} ids of the tokenizer "
            f"in {tokenizer.source}"
        )


def text_tokenizer(
    args: Mapping | argparse.Namespace, tokenizer_file: str | None = None, tokenizer_model: str | None = None
):
    """The tokenizer that writes text as a checkpoint's ids (evaluation, generation): `tokenizer_model` (a
    Hugging Face tokenizer folder given on the command line, which must hold the recorded vocabulary), else
    its recorded Hugging Face tokenizer folder, else cl100k_base (`tokenizer_file`, else the recorded BPE
    file, else the environment's). Never cl100k_base for a model of another vocabulary."""
    values = vars(args) if isinstance(args, argparse.Namespace) else args
    record = record_of_args(values)
    if tokenizer_model is not None:
        if record.type != HF_TOKENIZER:
            raise DiffmegError(
                f"--tokenizer-model {tokenizer_model}: the model reads the ids of {record.describe()}, "
                f"not of a Hugging Face tokenizer; drop --tokenizer-model"
            )
        tokenizer = build_tokenizer(HF_TOKENIZER, tokenizer_model=tokenizer_model)
        given = record_of(tokenizer)
        if record.fingerprint is not None and given.fingerprint != record.fingerprint:
            raise DiffmegError(
                f"--tokenizer-model {tokenizer_model} is {given.describe()}, but the model reads the ids of "
                f"{record.describe()}; pass that tokenizer's folder"
            )
        return tokenizer
    if record.type == HF_TOKENIZER:
        folder = values.get("tokenizer_model")
        if not folder or not os.path.isdir(folder):
            raise DiffmegError(
                f"the model reads the ids of the Hugging Face tokenizer {folder}, which is gone; restore "
                f"that folder (its tokenizer files), or pass --tokenizer-model with a copy of it"
            )
        return build_tokenizer(HF_TOKENIZER, tokenizer_model=folder)
    if record.type == NULL:
        raise DiffmegError("the model reads ids of no tokenizer (mock or `--tokenizer-type null` data)")
    return build_tokenizer(CL100K, tokenizer_file=tokenizer_file or values.get("tokenizer_file"))


# ----------------------------------------------------------------------------------------------------
# Datasets


def record_path(prefix: str) -> str:
    return prefix + RECORD_SUFFIX


def write_dataset_record(prefix: str, record: TokenizerRecord) -> None:
    """Write `{prefix}.tokenizer.json` (after the dataset's .bin/.idx: a dataset never names a tokenizer it
    was not made with)."""
    write_json(record_path(prefix), record.as_json())


def read_dataset_record(prefix: str) -> TokenizerRecord | None:
    """A dataset's record, or None when it has none (written before records existed)."""
    path = record_path(prefix)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            values = json.load(f)
        return TokenizerRecord(
            values["tokenizer_type"], values.get("tokenizer_fingerprint"), values.get("tokenizer_model")
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DiffmegError(
            f"cannot read the tokenizer record {path} ({exc}); delete it or write the dataset again"
        ) from None


def dataset_record(prefix: str) -> TokenizerRecord:
    """A dataset's tokenizer: its record, else cl100k_base (what diffmeg's tools wrote before records)."""
    return read_dataset_record(prefix) or TokenizerRecord(CL100K)


def common_record(prefixes: Sequence[str]) -> TokenizerRecord | None:
    """The one tokenizer of datasets to be combined into one (merged, upsampled), or a one-line refusal.
    None when no input has a record (the output gets none either)."""
    records = [(p, read_dataset_record(p)) for p in prefixes]
    known = [(p, r) for p, r in records if r is not None]
    if not known:
        return None
    first_prefix, first = known[0]
    for prefix, record in records:
        record = record or TokenizerRecord(CL100K)
        if not record.same_ids(first):
            raise DiffmegError(
                f"{first_prefix} was tokenized with {first.describe()} but {prefix} with "
                f"{record.describe()}; combine only datasets made with one tokenizer"
            )
    return first


def check_datasets(prefixes: Sequence[str], run: TokenizerRecord) -> None:
    """Every dataset holds ids of the run's tokenizer, or one line naming the first that does not."""
    for prefix in prefixes:
        record = dataset_record(prefix)
        if not record.same_ids(run):
            unrecorded = (
                "" if read_dataset_record(prefix) else f" (it has no {RECORD_SUFFIX}: diffmeg's cl100k_base)"
            )
            raise DiffmegError(
                f"dataset {prefix} was tokenized with {record.describe()}{unrecorded}, but this run uses "
                f"{run.describe()}; tokenize the text again with tools/preprocess_data.py {_flags(run)}"
            )


def check_vocabulary(
    prefixes: Sequence[str], vocab_size: int, cache_dir: str | None = None, collective: bool = False
) -> None:
    """Every dataset's token ids are rows of the run's embedding (0 <= id < `vocab_size`), or one line naming
    the first that is not, its largest id and the fix. Reads each dataset's recorded id range (one scan of
    its `.bin` the first time for data from elsewhere, split over the ranks when `collective`, recorded
    under `cache_dir` when given: `diffmeg.data.token_range`)."""
    for prefix in prefixes:
        ids = token_range(prefix, cache_dir, collective)
        if ids is None:
            continue
        lo, hi = ids
        if lo < 0:
            raise DiffmegError(
                f"dataset {prefix} holds the negative token id {lo}, which no vocabulary has; write the data "
                f"again (tools/preprocess_data.py)"
            )
        if hi >= vocab_size:
            record = read_dataset_record(prefix)
            made = f" (it was tokenized with {record.describe()}: {_flags(record)})" if record else ""
            raise DiffmegError(
                f"dataset {prefix} holds token ids up to {hi}, but this run's vocabulary has {vocab_size} "
                f"(ids 0..{vocab_size - 1}); train with the vocabulary the data was made with{made}, a "
                f"--vocab-size above {hi}, or data tokenized for {vocab_size} ids"
            )


# ----------------------------------------------------------------------------------------------------
# Checkpoints


def check_checkpoint(checkpoint_args: Mapping | argparse.Namespace, run: TokenizerRecord, where: str) -> None:
    """A checkpoint's model was trained on ids of the run's tokenizer, or one line saying which to pass."""
    saved = record_of_args(checkpoint_args)
    if saved.same_ids(run):
        return
    raise DiffmegError(
        f"{where} holds a model of the ids of {saved.describe()}, but this run uses {run.describe()}; "
        f"continue it with {_flags(saved)} (and data tokenized with it)"
    )


def _flags(record: TokenizerRecord) -> str:
    if record.type == HF_TOKENIZER:
        return f"--tokenizer-type {HF_TOKENIZER} --tokenizer-model {record.model or 'PATH'}"
    return f"--tokenizer-type {record.type}"
