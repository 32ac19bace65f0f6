"""Text generation from a pretrain_diff.py checkpoint (one prompt, greedy or top-p sampling, KV cache).

The KV cache is megatron-core's `StaticInferenceContext`: `SelfAttention` keeps each layer's keys and
values (after RoPE) and feeds the whole cache to `DiffCoreAttention`, whose causal mask aligns the
queries with the end of the keys, so one decode step (sq = 1 < sk) sees every earlier token. Without
the cache every step recomputes the whole sequence; both give the same tokens (tests check it).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import torch

from diffmeg.errors import DiffmegError


@dataclass
class SamplingConfig:
    """Greedy decoding, or sampling with temperature and nucleus (top-p) truncation."""

    greedy: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise DiffmegError(f"--temperature must be > 0 (use --greedy for argmax), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise DiffmegError(f"--top-p must lie in (0, 1], got {self.top_p}")


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    output_ids: list[int]
    """Generated ids, the end-of-document token included when generation stopped on it."""
    stop_reason: str
    """"eod" (the model ended the document) or "length" (--max-new-tokens reached)."""
    step_logits: list[torch.Tensor] = field(default_factory=list, repr=False)
    """The logits each generated token was chosen from (only with `return_logits=True`)."""


def _forward(model, tokens: torch.Tensor, start: int, context=None) -> torch.Tensor:
    """Logits of the last position: tokens [1, s] at positions start .. start + s - 1."""
    positions = torch.arange(start, start + tokens.shape[1], device=tokens.device).unsqueeze(0)  # [1, s]
    # with the KV cache: megatron-core requires gathered logits at inference
    cache = {} if context is None else {"inference_context": context, "runtime_gather_output": True}
    logits = model(input_ids=tokens, position_ids=positions, attention_mask=None, **cache)
    return logits[0, -1].float()  # [b, s, V] -> [V]


def sampling_generator(seed: int, device: torch.device) -> torch.Generator:
    """A seeded generator on the device the probabilities live on: `torch.multinomial` refuses a CPU
    generator for CUDA probabilities (so a seed gives one sequence per device type, not across them)."""
    return torch.Generator(device=device).manual_seed(seed)


def next_token(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> int:
    """Argmax, or a sample from the smallest top-probability set whose mass reaches top_p."""
    if sampling.greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # keep a token while the mass before it is below top_p (so the most likely one always stays)
        keep = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) < sampling.top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate(
    model,
    prompt_ids: list[int],
    max_new_tokens: int,
    sampling: SamplingConfig | None = None,
    *,
    eod_id: int | None = None,
    use_cache: bool = True,
    return_logits: bool = False,
) -> GenerationResult:
    """Continue `prompt_ids` by up to `max_new_tokens` tokens, stopping after `eod_id`."""
    from megatron.core.inference.contexts import StaticInferenceContext

    sampling = sampling or SamplingConfig(greedy=True)
    if not prompt_ids:
        raise DiffmegError("the prompt is empty: generation needs at least one token")
    if max_new_tokens < 0:
        raise DiffmegError(f"--max-new-tokens must be >= 0, got {max_new_tokens}")
    vocab = model.vocab_size
    bad = [i for i in prompt_ids if not 0 <= i < vocab]
    if bad:
        raise DiffmegError(f"prompt token id {bad[0]} is outside the model's vocabulary of {vocab}")
    generator = None  # made at the first step, on the logits' device (see sampling_generator)
    device = next(model.parameters()).device
    ids = list(prompt_ids)
    out: list[int] = []
    logits_seen: list[torch.Tensor] = []
    context = StaticInferenceContext(1, len(ids) + max_new_tokens) if use_cache else None
    pending = torch.tensor([ids], dtype=torch.long, device=device)  # [1, s]: the prompt, then one token
    start = 0
    stop = "length"
    for _ in range(max_new_tokens):
        logits = _forward(model, pending if use_cache else torch.tensor([ids], device=device), start, context)
        if use_cache:
            context.sequence_len_offset += pending.shape[1]
            start += pending.shape[1]
        if return_logits:
            logits_seen.append(logits)
        if generator is None and sampling.seed is not None:
            generator = sampling_generator(sampling.seed, logits.device)
        token = next_token(logits, sampling, generator)
        out.append(token)
        ids.append(token)
        if eod_id is not None and token == eod_id:
            stop = "eod"
            break
        pending = torch.tensor([[token]], dtype=torch.long, device=device)
    return GenerationResult(list(prompt_ids), out, stop, logits_seen)


def decode(tokenizer, ids: list[int], eod_id: int | None) -> str:
    """Text of `ids` without a final end-of-document token."""
    if ids and eod_id is not None and ids[-1] == eod_id:
        ids = ids[:-1]
    return tokenizer.detokenize(ids)


def check_length(args: argparse.Namespace, prompt_len: int, max_new_tokens: int) -> None:
    """Refuse sequences longer than the positions the model was built for (RoPE was never trained there)."""
    total = prompt_len + max_new_tokens
    if total > args.max_position_embeddings:
        raise DiffmegError(
            f"prompt ({prompt_len} tokens) + --max-new-tokens {max_new_tokens} = {total} exceeds the model's "
            f"{args.max_position_embeddings} positions"
        )
