"""Which tokenizer a run, a dataset and a checkpoint use (diffmeg.data.tokenizers, hf_tokenizer): a Hugging
Face tokenizer folder encodes documents its own way and is recorded beside the datasets it made; runs,
merges and checkpoints of another vocabulary are refused in one line; diffmeg's cl100k_base export counts
as cl100k_base. The tiny tokenizer is built here (tests/conversion/upcycle_helpers.py), no downloads."""

from __future__ import annotations

import json

import numpy as np
import pytest

from diffmeg.data.indexed import IndexedWriter, merge_datasets
from diffmeg.data.preprocess import PreprocessConfig, preprocess
from diffmeg.data.tokenizers import (
    CL100K,
    CL100K_HF_FINGERPRINT,
    TokenizerRecord,
    check_checkpoint,
    check_datasets,
    read_dataset_record,
)
from diffmeg.errors import DiffmegError
from tests.conversion.upcycle_helpers import TOKENIZER_IDS, save_tiny_tokenizer
from tests.data.helpers import read_documents, write_jsonl

TEXTS = ["the quick brown fox", "", "Upcycling keeps the logits.", "def main():\n    return 0\n"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-tokenizer")
    save_tiny_tokenizer(folder)
    return folder


def _preprocess(tmp_path, name: str, **tokenizer) -> str:
    corpus = write_jsonl(tmp_path / f"{name}.jsonl", [{"text": t} for t in TEXTS])
    cfg = PreprocessConfig(
        inputs=[str(corpus)], output_prefix=str(tmp_path / name), append_eod=True, log_interval=0, **tokenizer
    )
    return preprocess(cfg, log=lambda line: None).outputs["text"]


def test_documents_are_encoded_and_recorded_with_the_hugging_face_tokenizer(tiny, tmp_path):
    from diffmeg.data.hf_tokenizer import HFTokenizer

    prefix = _preprocess(tmp_path, "llama", tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tiny))
    tokenizer = HFTokenizer(str(tiny))
    assert (tokenizer.vocab_size, tokenizer.bos, tokenizer.eod, tokenizer.pad) == (TOKENIZER_IDS, 1, 2, -1)
    documents = [d.tolist() for d in read_documents(prefix)]
    # Llama's convention: <s> first (the tokenizer's own special tokens), </s> appended as end of document
    assert documents == [[1, *tokenizer.tokenize(text), 2] for text in TEXTS]
    assert tokenizer.detokenize(documents[0][1:-1]) == TEXTS[0]
    record = read_dataset_record(prefix)
    assert record == TokenizerRecord("HuggingFaceTokenizer", tokenizer.fingerprint, str(tiny.resolve()))
    values = json.loads((tmp_path / "llama_text_document.tokenizer.json").read_text())  # plain JSON
    assert set(values) == {"tokenizer_type", "tokenizer_fingerprint", "tokenizer_model"}
    check_datasets([prefix], record)
    with pytest.raises(
        DiffmegError, match=r"was tokenized with the Hugging Face tokenizer .* but this run uses "
    ):
        check_datasets([prefix], TokenizerRecord(CL100K))


def test_unrecorded_datasets_are_cl100k_and_mixtures_are_refused(tiny, tmp_path):
    prefix = _preprocess(tmp_path, "llama", tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tiny))
    with IndexedWriter(str(tmp_path / "old")) as writer:  # written before records: cl100k_base's ids
        writer.add_document(np.arange(10, dtype=np.int32))
        writer.commit()
    run = read_dataset_record(prefix)
    with pytest.raises(DiffmegError) as refusal:
        check_datasets([prefix, str(tmp_path / "old")], run)
    message = str(refusal.value)
    assert f"dataset {tmp_path / 'old'} was tokenized with cl100k_base (it has no .tokenizer.json" in message
    assert f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {tiny.resolve()}" in message
    check_datasets([str(tmp_path / "old")], TokenizerRecord(CL100K))
    check_datasets([prefix], TokenizerRecord("null"))  # ids of no tokenizer: anyone's
    with pytest.raises(DiffmegError, match="combine only datasets made with one tokenizer"):
        merge_datasets([prefix, str(tmp_path / "old")], str(tmp_path / "mixed"))
    other = _preprocess(tmp_path, "more", tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tiny))
    merge_datasets([prefix, other], str(tmp_path / "merged"))
    assert read_dataset_record(str(tmp_path / "merged")) == run  # the record travels with the ids


def test_resolved_arguments_record_the_tokenizer(tiny):
    from diffmeg.training.arguments import resolve_args

    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64"]
    base += ["--lr", "1e-3", "--train-iters", "1"]
    args = resolve_args([*base, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tiny)])
    assert args.vocab_size == 320 and len(args.tokenizer_fingerprint) == 64  # 300 ids padded to 64
    assert args.tokenizer_model == str(tiny.resolve())
    hf = ["--tokenizer-type", "HuggingFaceTokenizer"]
    refusals = {
        "is smaller than the 300 ids": [*hf, "--tokenizer-model", str(tiny), "--vocab-size", "256"],
        "--tokenizer-model is the folder of --tokenizer-type HuggingFaceTokenizer": [
            "--tokenizer-model",
            str(tiny),
        ],
        "needs --tokenizer-model PATH": hf,
        "holds no tokenizer": [*hf, "--tokenizer-model", str(tiny.parent)],
        "--mock-data generates token ids": [*hf, "--tokenizer-model", str(tiny), "--mock-data"],
    }
    for message, flags in refusals.items():
        with pytest.raises(DiffmegError, match=message):
            resolve_args([*base, *flags])


def test_checkpoints_of_another_vocabulary_are_refused():
    llama = {
        "tokenizer_type": "HuggingFaceTokenizer",
        "tokenizer_fingerprint": "a" * 64,
        "tokenizer_model": "/m",
    }
    with pytest.raises(DiffmegError) as refusal:
        check_checkpoint(llama, TokenizerRecord(CL100K), "checkpoint X")
    assert str(refusal.value) == (
        f"checkpoint X holds a model of the ids of the Hugging Face tokenizer /m (vocabulary {'a' * 12}), "
        "but this run uses cl100k_base; continue it with --tokenizer-type HuggingFaceTokenizer "
        "--tokenizer-model /m (and data tokenized with it)"
    )
    with pytest.raises(DiffmegError, match="vocabulary bbbbbbbbbbbb"):
        check_checkpoint(llama, TokenizerRecord("HuggingFaceTokenizer", "b" * 64, "/other"), "checkpoint X")
    check_checkpoint(llama, TokenizerRecord("HuggingFaceTokenizer", "a" * 64, "/moved"), "checkpoint X")
    check_checkpoint({"mock_data": True}, TokenizerRecord(CL100K), "X")  # mock ids: anyone's
    check_checkpoint({}, TokenizerRecord(CL100K), "X")  # arguments from before tokenizer types: cl100k_base
    with pytest.raises(DiffmegError, match="holds a model of the ids of cl100k_base"):
        check_checkpoint({}, TokenizerRecord("HuggingFaceTokenizer", "a" * 64, "/m"), "X")


def test_diffmeg_cl100k_export_counts_as_cl100k(tokenizer, tmp_path):
    """A Hugging Face folder holding diffmeg's cl100k_base export has cl100k_base's ids: runs, datasets and
    imports name it cl100k_base (its fingerprint is CL100K_HF_FINGERPRINT)."""
    from diffmeg.conversion.checkpoint_io import save_hf_tokenizer
    from diffmeg.conversion.tokenizer_export import build_fast_tokenizer
    from diffmeg.conversion.tokenizer_io import folder_tokenizer
    from diffmeg.data.hf_tokenizer import HFTokenizer
    from diffmeg.data.tokenizers import record_of

    save_hf_tokenizer(build_fast_tokenizer(tokenizer.encoding, model_max_length=256), str(tmp_path))
    exported = HFTokenizer(str(tmp_path))
    assert exported.fingerprint == CL100K_HF_FINGERPRINT
    assert record_of(exported) == TokenizerRecord(CL100K)
    assert folder_tokenizer(str(tmp_path)).source is None  # an import records nothing: cl100k_base
    text = "Hello world, 12345 naïve"
    assert exported.tokenize(text) == tokenizer.tokenize(text)
