"""The memory phase's generation check on a saved checkpoint: KV-cache greedy decoding against
recomputation, seeded sampling, token ids.

Greedy decoding in bf16 cannot be compared token for token with a recomputation: where two logits lie
within bf16's rounding of each other (after 50 mock iterations the logits are nearly flat) either path
may pick either token, and after one flip the sequences part. So the cached path's tokens are checked
against a teacher-forced recomputation of the same sequence (one forward over the prompt and the cached
tokens) in float32: at every position the cached token's float32 logit must lie within `tol` of the
best, where tol is four times the largest bf16 error of the recomputation itself (bf16 against float32,
measured here) plus float32's own rounding. Where the top-2 margin exceeds tol (a decisive position)
this means the cached token is the argmax; below it (a near-tie) either near-top token passes. A broken
cache (wrong positions, stale keys) moves logits by far more than tol and fails. `decisive` says how
many positions were decisive.
"""

from __future__ import annotations

import traceback
from pathlib import Path


def greedy_agreement(cached_ids: list[int], recomputed, reference) -> dict:
    """Check greedy tokens against logits [T, V] of the same positions: `recomputed` in the run's dtype,
    `reference` in float32 (the same forward)."""
    import torch

    ref = reference.float()
    error = (recomputed.float() - ref).abs().max().item()
    tol = 4 * error + 1e-5 * ref.abs().max().item()
    top2 = ref.topk(2, dim=-1).values  # [T, 2]
    chosen = ref.gather(1, torch.tensor(cached_ids, device=ref.device)[:, None])[:, 0]  # [T]
    shortfall = top2[:, 0] - chosen
    bad = [i for i, s in enumerate(shortfall.tolist()) if s > tol]
    return {
        "ok": not bad,
        "positions": len(cached_ids),
        "decisive": int(((top2[:, 0] - top2[:, 1]) > tol).sum()),
        "bf16_error": error,
        "tolerance": tol,
        "mismatches": bad[:5],
    }


def _teacher_forced_logits(model, ids: list[int], generated: int):
    """Logits [generated, V] that predicted the last `generated` of `ids`, from one forward over ids."""
    import torch

    device = next(model.parameters()).device
    tokens = torch.tensor([ids[:-1]], device=device)  # [1, s]
    positions = torch.arange(tokens.shape[1], device=device)[None]  # [1, s]
    with torch.no_grad():
        logits = model(input_ids=tokens, position_ids=positions, attention_mask=None)  # [1, s, V]
    return logits[0, -generated:].float()


def generation_check(ckpt: Path, device: str, tokens: int) -> dict:
    """Greedy decoding with the KV cache agrees with recomputation (near-ties allowed: module doc);
    seeded sampling repeats; ids in the vocabulary; the requested lengths."""
    import torch

    from diffmeg.checkpoints import load_model_weights
    from diffmeg.generation import SamplingConfig, generate
    from diffmeg.runtime import single_process

    try:
        single_process()
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        model, _ = load_model_weights(str(ckpt), dtype=dtype)
        prompt = [1, 2, 3, 4, 5]
        cached = generate(model, prompt, tokens, use_cache=True, return_logits=True)
        ids = prompt + cached.output_ids
        recomputed = _teacher_forced_logits(model, ids, tokens)
        step_logits = torch.stack([x.float() for x in cached.step_logits])  # [T, V]
        s1 = generate(model, prompt, tokens, SamplingConfig(temperature=1.0, top_p=0.9, seed=3))
        s2 = generate(model, prompt, tokens, SamplingConfig(temperature=1.0, top_p=0.9, seed=3))
        vocab, where = model.vocab_size, str(next(model.parameters()).device)
        del model
        reference_model, _ = load_model_weights(str(ckpt), dtype=torch.float32)
        reference = _teacher_forced_logits(reference_model, ids, tokens)
        del reference_model
        greedy = greedy_agreement(cached.output_ids, recomputed, reference)
        checks = {
            "cache_agrees_with_recompute": greedy["ok"],
            "seeded_sampling_repeats": s1.output_ids == s2.output_ids,
            "ids_in_vocab": all(0 <= i < vocab for i in cached.output_ids + s1.output_ids),
            "lengths": len(cached.output_ids) == tokens and len(s1.output_ids) == tokens,
        }
        return {
            "ok": all(checks.values()),
            **checks,
            "greedy": greedy,
            "cache_logits_max_abs_diff": (step_logits - recomputed).abs().max().item(),
            "device": where,
            "error": None,
        }
    except Exception as exc:  # noqa: BLE001 - every failure is a result here
        traceback.print_exc()
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
