"""Needle-in-a-haystack prompts as token ids, with every needle's and answer's exact token position.

The protocol of LWM / Gemini 1.5 as the DIFF paper uses it: N sentences "the magic number of <city>
is <number>" are inserted into filler context, the prompt ends with a question naming R of the cities,
and the model must continue with their numbers. The first queried needle sits at the requested depth
(0.0 = start of the filler, 1.0 = its end); the other needles sit at seeded random depths.

Prompts are built from separately tokenized pieces (filler, needle sentences, question) concatenated
as ids, so the positions recorded here are exactly where the needles are (a tokenizer never merges
across a piece boundary). Two vocabularies:

* `TextVocab` (cl100k checkpoints): English sentences, cities and 7-digit numbers, filler from text.
* `IdVocab` (mock-data checkpoints, whose ids mean nothing): fixed random id sequences play the roles
  of the sentence templates, each city and each number is a short random id sequence, and filler is
  random ids (or ids from a dataset). Structure and positions are the same as in text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from diffmeg.data.tokenizers import text_tokenizer
from diffmeg.errors import DiffmegError
from diffmeg.eval.common import expand_text_files, read_text_file

CITIES = (
    "Chicago Yangon Antananarivo Colombo Almaty Sydney Mexico-City Seattle Lagos Amsterdam Belgrade Cairo "
    "Baghdad Damascus Kigali Dakar Sofia Victoria Tashkent Mumbai Barcelona Riyadh Lima Ottawa Oslo Quito "
    "Hanoi Nairobi Santiago Tbilisi Helsinki Montevideo"
).split()


@dataclass
class Needle:
    """One needle in a built prompt: its city/number ids and where its number sits ([start, stop))."""

    city: int
    number: int
    depth: float
    start: int
    value_span: tuple[int, int]
    queried: bool = False


@dataclass
class NeedlePrompt:
    """A prompt (context then question) and the answer the model should continue it with."""

    tokens: np.ndarray
    context_length: int
    """Tokens before the question (filler and needles); attention "noise" is measured over these."""
    needles: list[Needle]
    answer: list[int]
    """The expected continuation: the queried numbers, in question order, joined by the separator."""
    answer_parts: list[tuple[int, int]] = field(default_factory=list)
    """[start, stop) of each queried number inside `answer`."""

    @property
    def queried(self) -> list[Needle]:
        return [n for n in self.needles if n.queried]


class IdVocab:
    """Needle pieces as fixed random ids, for checkpoints trained on mock data (ids 0..vocab-1)."""

    def __init__(self, vocab_size: int, key_len: int = 2, value_len: int = 2, seed: int = 0) -> None:
        if vocab_size < 16:
            raise DiffmegError(f"vocabulary of {vocab_size} ids is too small for needle prompts")
        rng = np.random.default_rng(10_000 + seed)
        self.vocab_size = vocab_size
        self.key_len, self.value_len = key_len, value_len
        self._templates = {name: rng.integers(0, vocab_size, 3).tolist() for name in ("pre", "mid", "q", "a")}
        self._sep = rng.integers(0, vocab_size, 1).tolist()
        self._seed = seed

    def _ids(self, kind: int, value: int, length: int) -> list[int]:
        """`length` fixed random ids of a city (`kind` 1) or a number (2)."""
        return np.random.default_rng([self._seed, kind, value]).integers(0, self.vocab_size, length).tolist()

    def city_ids(self, city: int) -> list[int]:
        return self._ids(1, city, self.key_len)

    def number_ids(self, number: int) -> list[int]:
        return self._ids(2, number, self.value_len)

    def needle(self, city: int, number: int) -> tuple[list[int], int]:
        """(ids of the needle sentence, offset of the number inside it)."""
        head = self._templates["pre"] + self.city_ids(city) + self._templates["mid"]
        return head + self.number_ids(number) + self._sep, len(head)

    def question(self, cities: Sequence[int]) -> list[int]:
        ids = list(self._templates["q"])
        for c in cities:
            ids += self.city_ids(c)
        return ids + self._templates["a"]

    @property
    def separator(self) -> list[int]:
        return self._sep

    def filler(self, length: int, rng: np.random.Generator) -> list[int]:
        return rng.integers(0, self.vocab_size, length).tolist()


class TextVocab:
    """Needle pieces as cl100k text: "The special magic number for Oslo is: 4831052."."""

    def __init__(self, tokenizer, filler_text: str) -> None:
        self.tokenizer = tokenizer
        self._filler = tokenizer.tokenize(filler_text)
        if len(self._filler) < 16:
            raise DiffmegError("the filler text is too short (fewer than 16 tokens); give longer text files")

    @staticmethod
    def _number(number: int) -> str:
        return str(1_000_000 + number % 9_000_000)

    def needle(self, city: int, number: int) -> tuple[list[int], int]:
        head = self.tokenizer.tokenize(f" The special magic number for {CITIES[city]} is:")
        return head + self.number_ids(number) + self.tokenizer.tokenize("."), len(head)

    def number_ids(self, number: int) -> list[int]:
        return self.tokenizer.tokenize(f" {self._number(number)}")

    def question(self, cities: Sequence[int]) -> list[int]:
        names = " and ".join(CITIES[c] for c in cities)
        return self.tokenizer.tokenize(
            f"\nWhat are the special magic numbers for {names}? The special magic numbers are:"
        )

    @property
    def separator(self) -> list[int]:
        return self.tokenizer.tokenize(",")

    def filler(self, length: int, rng: np.random.Generator) -> list[int]:
        start = int(rng.integers(0, len(self._filler)))
        reps = (start + length) // len(self._filler) + 1
        return (self._filler * reps)[start : start + length]


def build_prompt(
    vocab,
    length: int,
    depth: float,
    num_needles: int = 1,
    num_queries: int = 1,
    seed: int = 0,
) -> NeedlePrompt:
    """A prompt of exactly `length` tokens (context and question) with its queried needle at `depth`.

    Needle cities are distinct; the first `num_queries` needles are queried, the first of them at
    `depth` and the others at seeded random depths. A needle at depth d starts after
    round(d * filler_length) filler tokens, so depth 0 opens the context and depth 1 ends it.
    """
    if not 0.0 <= depth <= 1.0:
        raise DiffmegError(f"needle depth must be within [0, 1], got {depth}")
    if not 1 <= num_queries <= num_needles:
        raise DiffmegError(
            f"queries ({num_queries}) must be between 1 and the number of needles ({num_needles})"
        )
    if num_needles > len(CITIES):
        raise DiffmegError(f"at most {len(CITIES)} needles, got {num_needles}")
    rng = np.random.default_rng(seed)
    cities = rng.choice(len(CITIES), size=num_needles, replace=False).tolist()
    numbers = rng.integers(0, 9_000_000, num_needles).tolist()
    depths = [depth] + rng.random(num_needles - 1).tolist()
    pieces = [vocab.needle(c, n) for c, n in zip(cities, numbers, strict=True)]
    question = vocab.question(cities[:num_queries])
    filler_len = length - len(question) - sum(len(p) for p, _ in pieces)
    if filler_len < 0:
        raise DiffmegError(
            f"a {length}-token prompt cannot hold {num_needles} needle(s) and the question; "
            "use a longer length"
        )
    filler = vocab.filler(filler_len, rng)
    # Insert at filler offsets; needles at the same offset keep their order (the queried one first).
    offsets = [round(d * filler_len) for d in depths]
    order = sorted(range(num_needles), key=lambda i: (offsets[i], i))
    tokens: list[int] = []
    needles: list[Needle | None] = [None] * num_needles
    cursor = 0
    for i in order:
        tokens += filler[cursor : offsets[i]]
        cursor = offsets[i]
        ids, value_at = pieces[i]
        start = len(tokens)
        value = (start + value_at, start + value_at + len(vocab.number_ids(numbers[i])))  # [start, stop)
        needles[i] = Needle(cities[i], numbers[i], depths[i], start, value, i < num_queries)
        tokens += ids
    tokens += filler[cursor:]
    context_length = len(tokens)
    tokens += question
    answer: list[int] = []
    parts = []
    for k in range(num_queries):
        if k:
            answer += vocab.separator
        value = vocab.number_ids(numbers[k])
        parts.append((len(answer), len(answer) + len(value)))
        answer += value
    return NeedlePrompt(np.asarray(tokens, dtype=np.int64), context_length, needles, answer, parts)  # type: ignore[arg-type]


def needle_vocab(info, text_files: Sequence[str] | None, tokenizer_file: str | None) -> IdVocab | TextVocab:
    """The vocabulary of a checkpoint's prompts (`info`: a `diffmeg.model_source.CheckpointInfo`):
    `IdVocab` for mock-data checkpoints, `TextVocab` (filler from `text_files`) for cl100k ones."""
    if info.tokenizer == "mock":
        if text_files:
            raise DiffmegError(
                f"{info.root} was trained on mock ids (vocab {info.vocab_size}); --text-files need a cl100k "
                "checkpoint (mock checkpoints get random-id filler)"
            )
        return IdVocab(info.vocab_size)  # fixed ids per vocabulary: what an id-corpus model was trained on
    if not text_files:
        raise DiffmegError(f"{info.root} reads cl100k text: give --text-files for the filler")

    text = "\n".join(read_text_file(path) for path in expand_text_files(text_files))
    return TextVocab(text_tokenizer(info.args, tokenizer_file), text)  # cl100k_base or its own tokenizer
