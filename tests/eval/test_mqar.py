"""MQAR accuracy (diffmeg/eval/mqar.py): scoring by hand-built logits, the per-query and per-pair tables,
and evaluation of a fake model on generated data whose right and wrong answers are known."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diffmeg.data.loss_mask import MaskedDocuments
from diffmeg.data.mqar import MQARSetting, write_mqar_dataset
from diffmeg.errors import DiffmegError
from diffmeg.eval.mqar import Tally, evaluate_documents, score_batch


def test_score_batch_compares_the_argmax_one_position_earlier():
    doc = np.array([3, 9, 4, 10, 3, 9, 4, 10])
    mask = np.zeros(8, dtype=bool)
    mask[[5, 7]] = True
    logits = torch.zeros(1, 7, 16)
    logits[0, 4, 9] = 1.0  # position 4 (the query key 3) predicts 9: right
    logits[0, 6, 11] = 1.0  # position 6 (the query key 4) predicts 11, the answer is 10: wrong
    logits[0, 5, 10] = 1.0  # an unmasked position: never scored
    (hits,) = score_batch(logits, [doc], [mask])
    assert hits.tolist() == [True, False]


def test_tally_tables():
    t = Tally()
    t.add(np.array([True, False, True]), np.arange(3), np.array([2, 0, 1]))
    t.add(np.array([False, False, True]), np.arange(3), np.array([0, 1, 2]))
    s = t.summary()
    assert (t.correct, t.total) == (3, 6) and s["accuracy"] == 0.5 and s["answers"] == 6
    assert s["by_query"] == [0.5, 0.0, 1.0]
    assert s["by_pair"] == [0.0, 0.5, 1.0]  # pair 0: 0/2, pair 1: 1/2 (True, False), pair 2: 2/2


class Oracle(torch.nn.Module):
    """Answers every key with the value that followed its first occurrence; wrong on `wrong_queries`
    (by answer index within the document's query section)."""

    def __init__(self, setting: MQARSetting, wrong_queries: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.setting, self.wrong = setting, wrong_queries
        self.anchor = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, position_ids, attention_mask):
        b, s = input_ids.shape
        vocab = self.setting.vocab_size
        logits = torch.zeros(b, s, vocab)
        query_start = self.setting.doc_length - 2 * self.setting.num_queries
        for row in range(b):
            ids = input_ids[row].tolist()
            for p in range(query_start, s, 2):  # the query keys
                value = ids[ids.index(ids[p]) + 1]
                if (p - query_start) // 2 in self.wrong:
                    value = vocab // 2 + (value + 1 - vocab // 2) % (vocab // 2)  # another value id
                logits[row, p, value] = 1.0
        return logits


@pytest.fixture(scope="module")
def kv(tmp_path_factory):
    setting = MQARSetting(6, 4, 2, vocab_size=32)
    prefix = str(tmp_path_factory.mktemp("mqar") / "kv")
    write_mqar_dataset(prefix, setting, documents=10, seed=7)
    return setting, MaskedDocuments(prefix)


def test_a_perfect_model_scores_one_and_a_flawed_one_its_flaw(kv):
    setting, docs = kv
    perfect = evaluate_documents(Oracle(setting), docs, None, 3, 32, mqar_vocab=32).summary()
    assert perfect["accuracy"] == 1.0 and perfect["answers"] == 40
    assert perfect["by_query"] == [1.0] * 4 and len(perfect["by_pair"]) <= 6
    flawed = evaluate_documents(Oracle(setting, (0, 2)), docs, 7, 4, 32, mqar_vocab=32).summary()
    assert flawed["answers"] == 28 and flawed["accuracy"] == 0.5  # the first 7 documents only
    assert flawed["by_query"] == [0.0, 1.0, 0.0, 1.0]
    assert "by_pair" not in evaluate_documents(Oracle(setting), docs, 2, 2, 32, mqar_vocab=None).summary()


def test_token_ids_beyond_the_model_vocabulary_are_an_error(kv):
    setting, docs = kv
    with pytest.raises(DiffmegError, match="outside the model's vocabulary of 16"):
        evaluate_documents(Oracle(setting), docs, 2, 2, vocab_size=16, mqar_vocab=32)
