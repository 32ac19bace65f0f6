"""diffmeg.eval.long_context (and the checkpoint checks of diffmeg.eval.common): the position
statistics against brute force, the per-token NLL against the model's own logits, and the checks made
before any model is loaded."""

from __future__ import annotations

import numpy as np
import pytest

from diffmeg.errors import DiffmegError
from diffmeg.eval.common import check_same_vocabulary, default_labels, expand_text_files
from diffmeg.eval.long_context import (
    DocumentSource,
    IndexedDocuments,
    PositionStats,
    TextDocuments,
    csv_positions,
    cumulative_average,
    evaluate_model,
    per_token_nll,
    select_documents,
    write_csv,
)
from diffmeg.model_source import CheckpointInfo
from tests.eval.helpers import MOCK_VOCAB, periodic_documents, write_indexed_dataset

# ---------------------------------------------------------------------------------------------------
# Pure numpy parts


def brute_force_curve(nll: np.ndarray, valid: list[int]) -> np.ndarray:
    """Mean over the documents reaching each position, then the mean of those up to p, by loops."""
    length = max(valid)
    means = []
    for p in range(length):
        values = [nll[d, p] for d in range(len(valid)) if p < valid[d]]
        means.append(sum(values) / len(values))
    return np.array([sum(means[: p + 1]) / (p + 1) for p in range(length)])


def test_cumulative_average_matches_brute_force():
    rng = np.random.default_rng(0)
    values = rng.exponential(3.0, size=257)
    expected = [sum(values[: p + 1]) / (p + 1) for p in range(len(values))]
    np.testing.assert_allclose(cumulative_average(values), expected, rtol=1e-12)


@pytest.mark.parametrize("valid", [[50, 50, 50, 50], [50, 20, 35, 1, 50]], ids=["full", "ragged"])
def test_position_stats_match_brute_force(valid):
    rng = np.random.default_rng(1)
    nll = rng.exponential(2.0, size=(len(valid), 50))
    nll[np.arange(50)[None, :] >= np.array(valid)[:, None]] = 1e9  # padding must never be counted
    stats = PositionStats(50)
    stats.add(nll[:2], valid[:2])  # streamed in two batches
    stats.add(nll[2:], valid[2:])
    assert stats.documents == len(valid) and stats.tokens == sum(valid)
    np.testing.assert_allclose(stats.cumulative(), brute_force_curve(nll, valid), rtol=1e-12)


def test_position_stats_stop_at_the_last_covered_position():
    stats = PositionStats(10)
    stats.add(np.ones((2, 10)), [4, 6])
    assert stats.covered == 6 and len(stats.cumulative()) == 6


@pytest.mark.parametrize(
    "length,every,expected",
    [(64, 8, [0, 8, 16, 24, 32, 40, 48, 56, 63]), (65, 8, [0, 8, 16, 24, 32, 40, 48, 56, 64]), (1, 8, [0]),
     (5, 1, [0, 1, 2, 3, 4])],
)  # fmt: skip
def test_csv_positions_keep_first_every_nth_and_last(length, every, expected):
    assert csv_positions(length, every).tolist() == expected


def test_csv_quotes_labels_with_commas(tmp_path):
    path = tmp_path / "x.csv"
    write_csv(str(path), {"DIFF (a,b)": np.array([1.0, 0.5]), "T": np.array([2.0, 1.0])})
    assert path.read_text().splitlines() == [
        'position,"DIFF (a,b)",T',
        "0,1.000000,2.000000",
        "1,0.500000,1.000000",
    ]


def test_select_documents_samples_reproducibly_and_explains_failure():
    lengths = np.array([10, 100, 5, 200, 70, 300, 99])
    assert select_documents(lengths, 70, None, 0).tolist() == [1, 3, 4, 5, 6]
    sample = select_documents(lengths, 70, 3, seed=7)
    assert len(sample) == 3 and set(sample) <= {1, 3, 4, 5, 6} and list(sample) == sorted(sample)
    assert sample.tolist() == select_documents(lengths, 70, 3, seed=7).tolist()
    with pytest.raises(
        DiffmegError, match="no document has at least 301 tokens: 7 document.*longest has 300"
    ):
        select_documents(lengths, 301, None, 0)


def _info(root: str, **args) -> CheckpointInfo:
    base = {"diff_attention": True, "seq_length": 64, "vocab_size": 512, "mock_data": True}
    return CheckpointInfo(root=root, iteration=2, path=root + "/iter_0000002", args={**base, **args})


def test_default_labels_name_the_architecture_and_stay_unique():
    diff, base = _info("/runs/diff3b/"), _info("/runs/base3b", diff_attention=False)
    assert default_labels([diff, base]) == ["DIFF (diff3b)", "Transformer (base3b)"]
    twins = [_info("/a/ckpt"), _info("/b/ckpt")]
    assert default_labels(twins) == ["DIFF (ckpt @ 2) #1", "DIFF (ckpt @ 2) #2"]


def test_checkpoints_with_different_vocabularies_are_refused():
    check_same_vocabulary([_info("/a"), _info("/b")])
    with pytest.raises(DiffmegError, match="different tokenizers/vocabularies.*vocab 512.*vocab 1024"):
        check_same_vocabulary([_info("/a"), _info("/b", vocab_size=1024)])
    with pytest.raises(DiffmegError, match=r"\(mock, vocab 100288\) vs /b \(cl100k_base"):
        check_same_vocabulary(
            [_info("/a", vocab_size=100288), _info("/b", vocab_size=100288, mock_data=False)]
        )


def test_indexed_documents_read_prefixes_of_multi_sequence_documents(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(str(tmp_path / "d.bin"), dtype=np.int32)
    builder.add_document(np.arange(10, dtype=np.int32), [4, 6])  # one document stored as two sequences
    builder.add_document(np.arange(100, 103, dtype=np.int32), [3])
    builder.finalize(str(tmp_path / "d.idx"))
    docs = IndexedDocuments(str(tmp_path / "d"))
    assert docs.lengths.tolist() == [10, 3]
    assert docs.read(0, 7).tolist() == list(range(7))
    assert docs.read(1, 99).tolist() == [100, 101, 102]


def test_text_documents_tokenize_each_file_whole(tmp_path, tokenizer_file):
    from diffmeg.data.tiktoken_cl100k import load_tokenizer

    for name, text in [("a.txt", "hello world " * 50), ("b.txt", "short")]:
        (tmp_path / name).write_text(text)
    tokenizer = load_tokenizer(tokenizer_file)
    paths = expand_text_files([str(tmp_path / "*.txt"), str(tmp_path / "a.txt")])
    assert paths == [str(tmp_path / "a.txt"), str(tmp_path / "b.txt")]
    docs = TextDocuments(paths, tokenizer)
    assert docs.read(0, 10**6).tolist() == tokenizer.tokenize("hello world " * 50)
    assert docs.lengths[1] == len(tokenizer.tokenize("short"))
    with pytest.raises(DiffmegError, match="matches no file"):
        expand_text_files([str(tmp_path / "*.md")])


# ---------------------------------------------------------------------------------------------------
# Against the model


class ListDocuments(DocumentSource):
    def __init__(self, docs):
        self.docs = [np.asarray(d, dtype=np.int64) for d in docs]
        self.lengths = np.array([len(d) for d in docs])
        self.description = "test documents"

    def name(self, index):
        return f"doc {index}"

    def key(self, index):
        return index

    def read(self, index, count):
        return self.docs[index][:count]


@pytest.fixture(scope="module")
def diff_model(tiny_ckpts, single_rank_parallel_state):
    from diffmeg.checkpoints import load_model_weights

    model, args = load_model_weights(str(tiny_ckpts["diff"]))
    assert args.diff_attention and args.vocab_size == MOCK_VOCAB
    return model


def reference_nll(model, doc: np.ndarray) -> np.ndarray:
    """-log softmax(logits)[next token] in float64, from the model's full logits (the slow way)."""
    import torch

    ids = torch.as_tensor(doc[None, :-1])
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None], attention_mask=None)
    logp = torch.log_softmax(logits.double(), dim=-1)[0]
    return -logp[torch.arange(len(doc) - 1), torch.as_tensor(doc[1:])].numpy()


@pytest.mark.parametrize("chunk", [None, 4096, 16, 7], ids=["labels-path", "one-chunk", "chunk16", "chunk7"])
def test_per_position_nll_is_the_models_own_token_loss(diff_model, chunk):
    import torch

    doc = periodic_documents([65])[0]
    got = per_token_nll(diff_model, torch.as_tensor(doc[None]), chunk).numpy()[0]
    assert got.shape == (64,)
    np.testing.assert_allclose(got, reference_nll(diff_model, doc), rtol=0, atol=2e-5)


def test_evaluation_batches_and_truncates_like_single_documents(diff_model):
    """Padding a short document into a batch changes nothing; long ones are cut to length + 1."""
    docs = periodic_documents([80, 40, 65, 200], seed=3)
    source = ListDocuments(docs)
    stats = evaluate_model(
        diff_model, source, np.arange(4), 64, vocab_size=MOCK_VOCAB, batch_size=3, chunk_size=16, log=print
    )
    per_doc = [reference_nll(diff_model, d[:65]) for d in docs]
    valid = [len(p) for p in per_doc]
    nll = np.zeros((4, 64))
    for i, p in enumerate(per_doc):
        nll[i, : len(p)] = p
    assert valid == [64, 39, 64, 64] and stats.tokens == sum(valid)
    np.testing.assert_allclose(stats.cumulative(), brute_force_curve(nll, valid), rtol=0, atol=2e-5)


def test_tokens_outside_the_vocabulary_are_a_clear_error(diff_model, tmp_path):
    prefix = write_indexed_dataset(tmp_path / "big_ids", [np.arange(600, 670)])
    with pytest.raises(DiffmegError, match="document 0 of indexed dataset .* holds token id 664, outside"):
        evaluate_model(diff_model, IndexedDocuments(prefix), np.arange(1), 64, vocab_size=MOCK_VOCAB)
