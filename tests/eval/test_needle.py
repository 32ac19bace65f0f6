"""Needle prompts: exact length, needles at the requested depths (token positions), answers in place."""

from __future__ import annotations

import numpy as np
import pytest

from diffmeg.errors import DiffmegError
from diffmeg.eval.needle import IdVocab, build_prompt


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_needle_lands_at_the_requested_depth(depth):
    vocab = IdVocab(512)
    prompt = build_prompt(vocab, 200, depth, num_needles=1, seed=3)
    (needle,) = prompt.needles
    needle_ids, value_at = vocab.needle(needle.city, needle.number)
    filler_len = prompt.context_length - len(needle_ids)
    assert len(prompt.tokens) == 200
    assert needle.start == round(depth * filler_len)
    assert prompt.tokens[needle.start : needle.start + len(needle_ids)].tolist() == needle_ids
    start, stop = needle.value_span
    assert prompt.tokens[start:stop].tolist() == prompt.answer == vocab.number_ids(needle.number)
    assert prompt.tokens[prompt.context_length :].tolist() == vocab.question([needle.city])


def test_several_needles_are_all_present_and_the_queried_ones_answered_in_order():
    vocab = IdVocab(512)
    prompt = build_prompt(vocab, 300, 0.5, num_needles=6, num_queries=2, seed=11)
    assert len({n.city for n in prompt.needles}) == 6
    for n in prompt.needles:
        ids, _ = vocab.needle(n.city, n.number)
        assert prompt.tokens[n.start : n.start + len(ids)].tolist() == ids
    first, second = prompt.queried
    assert first.depth == 0.5 and prompt.answer == vocab.number_ids(
        first.number
    ) + vocab.separator + vocab.number_ids(second.number)
    assert [prompt.answer[a:b] for a, b in prompt.answer_parts] == [
        vocab.number_ids(first.number),
        vocab.number_ids(second.number),
    ]


def test_prompts_are_deterministic_by_seed():
    vocab = IdVocab(512)
    a, b, c = (build_prompt(vocab, 128, 0.25, 4, seed=s) for s in (5, 5, 6))
    assert np.array_equal(a.tokens, b.tokens) and not np.array_equal(a.tokens, c.tokens)


def test_a_prompt_too_short_for_its_needles_is_an_error():
    with pytest.raises(DiffmegError, match="cannot hold 8 needle"):
        build_prompt(IdVocab(512), 40, 0.5, num_needles=8)
