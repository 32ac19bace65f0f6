"""tiktoken cl100k_base as a Hugging Face fast tokenizer with tiktoken's exact ids.

The BPE model gets tiktoken's ranks as ids and one merge per way of splitting a token into two tokens,
ranked by the merged token's rank (tiktoken merges the adjacent pair whose concatenation ranks lowest).
`ignore_merges` makes a pre-token that is itself a vocabulary entry map straight to it, as tiktoken does.

tiktoken's pattern uses possessive quantifiers. The `tokenizers` library compiles it with Oniguruma,
which reads `?+`, `*+`, `++` as possessive but `{1,3}+` as "one or more runs of 1-3" (Ruby syntax), so
a digit run would become one pre-token. `{m,n}+` is rewritten to `{m,n}`: in cl100k's pattern it ends
its alternative, where possessive and greedy match the same text.

Special tokens are put into the BPE vocabulary at their tiktoken ids before they are registered as
added tokens, so `<|endoftext|>` stays 100257 (registering them alone numbers them consecutively from
100256). cl100k's unused ids (100256, 100261..100275) stay unused: ids equal tiktoken's, so
`len(tokenizer)` is 100261 while the largest id is 100276.
"""

from __future__ import annotations

import re
from typing import Any

import tiktoken

from diffmeg.errors import DiffmegError


def oniguruma_pattern(pattern: str) -> str:
    """tiktoken's split pattern in a form Oniguruma reads with the same meaning (see the module doc)."""
    return re.sub(r"(\{\d+(?:,\d*)?\})\+", r"\1", pattern)


def vocab_and_merges(
    encoding: tiktoken.Encoding,
) -> tuple[dict[str, int], list[tuple[str, str]], dict[str, int]]:
    """(BPE vocab in ByteLevel characters, merges in priority order, special tokens) of `encoding`."""
    special = {text: encoding.encode_single_token(text) for text in encoding.special_tokens_set}
    special_ids = set(special.values())
    ranks: dict[bytes, int] = {}
    for token_id in range(encoding.n_vocab):
        if token_id in special_ids:
            continue
        try:
            ranks[encoding.decode_single_token_bytes(token_id)] = token_id
        except KeyError:
            continue  # an unused id
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    table = bytes_to_unicode()  # GPT-2's printable stand-in for each byte, which ByteLevel emits

    def chars(token: bytes) -> str:
        return "".join(table[b] for b in token)

    merges: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], left, right))
    merges.sort()
    vocab = {chars(token): rank for token, rank in ranks.items()}
    for text, token_id in special.items():
        if text in vocab:
            raise DiffmegError(f"special token {text!r} collides with an ordinary token")
        vocab[text] = token_id
    return vocab, [(chars(m[3]), chars(m[4])) for m in merges], special


def build_fast_tokenizer(encoding: tiktoken.Encoding, model_max_length: int) -> Any:
    """A `PreTrainedTokenizerFast` whose `encode` equals `encoding.encode_ordinary` on plain text.

    `<|endoftext|>` (the end-of-document token our pretraining appends) is both bos and eos, as in
    the generation config; tiktoken defines no pad or unk token.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    vocab, merges, special = vocab_and_merges(encoding)
    tok = Tokenizer(BPE(vocab, merges, fuse_unk=False, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(
                Regex(oniguruma_pattern(encoding._pat_str)), behavior="isolated", invert=False
            ),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens(
        [AddedToken(text, normalized=False, special=True) for text in sorted(special, key=special.get)]
    )
    for text, token_id in special.items():
        if tok.token_to_id(text) != token_id:
            raise DiffmegError(f"special token {text!r} got id {tok.token_to_id(text)}, expected {token_id}")
    eot = encoding.decode_single_token_bytes(encoding.eot_token).decode()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=eot,
        eos_token=eot,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
