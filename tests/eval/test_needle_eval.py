"""Needle scoring: a prompt whose answer the test controls is scored right and wrong correctly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diffmeg.errors import DiffmegError
from diffmeg.eval.common import CheckpointSet
from diffmeg.eval.harness import HarnessConfig
from diffmeg.eval.needle import IdVocab, NeedlePrompt, build_prompt
from diffmeg.eval.needle_eval import NeedleEvalConfig, score_prompt

VOCAB = 512


def answering(replies: list[int]):
    """A fake model whose greedy continuation of the prompt is `replies`, whatever follows."""

    def logits_fn(tokens):
        logits = torch.zeros(len(tokens), VOCAB)
        prompt_len = len(tokens) - (len(replies) - 1)
        for i, t in enumerate(replies):
            logits[prompt_len - 1 + i, t] = 1.0
        return logits

    return logits_fn


def test_hand_built_prompt_scored_right_and_wrong():
    prompt = NeedlePrompt(np.array([5, 6, 7, 8, 9]), 3, [], answer=[40, 41], answer_parts=[(0, 2)])
    assert score_prompt(answering([40, 41]), prompt) == [True]
    assert score_prompt(answering([40, 42]), prompt) == [False]  # one wrong token fails the number
    assert score_prompt(answering([39, 41]), prompt) == [False]


def test_generated_prompt_with_two_queries_scores_each_number():
    vocab = IdVocab(VOCAB)
    prompt = build_prompt(vocab, 120, 0.25, num_needles=4, num_queries=2, seed=9)
    first, second = prompt.queried
    right = vocab.number_ids(first.number) + vocab.separator + vocab.number_ids(second.number)
    assert prompt.answer == right
    assert score_prompt(answering(right), prompt) == [True, True]
    other = next(n for n in prompt.needles if not n.queried)  # a distractor needle's number
    swapped = vocab.number_ids(other.number) + vocab.separator + vocab.number_ids(second.number)
    assert score_prompt(answering(swapped), prompt) == [False, True]


def test_an_oracle_reading_the_needle_from_the_context_retrieves_it():
    """Reads the number out of the prompt tokens at the needle's recorded span: right at every depth."""
    vocab = IdVocab(VOCAB)
    for depth in (0.0, 0.5, 1.0):
        prompt = build_prompt(vocab, 100, depth, seed=2)
        (needle,) = prompt.queried
        start, stop = needle.value_span
        assert score_prompt(answering(prompt.tokens[start:stop].tolist()), prompt) == [True]


def test_counts_below_one_are_one_line_errors():
    """`EvalConfig.require_positive`, as each evaluation's config calls it."""
    with pytest.raises(DiffmegError, match=r"^--samples must be >= 1, got 0$"):
        NeedleEvalConfig(CheckpointSet(["ckpt"]), samples=0)
    with pytest.raises(DiffmegError, match=r"^--max-gen-toks must be >= 1, got -2$"):
        HarnessConfig(CheckpointSet(["ckpt"]), max_gen_toks=-2)
    HarnessConfig(CheckpointSet(["ckpt"]), max_length=None)  # unset: its default
