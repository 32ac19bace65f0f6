"""The output projection and cross entropy in chunks of tokens: a loss that never holds the whole logits.

megatron-core's GPTModel computes logits `[s, b, V / TP]` in the model dtype, then its vocab-parallel
cross entropy keeps an fp32 copy of them as the softmax and turns it into the gradient in backward: at 64K
tokens per rank and a 100288-entry vocabulary that is the largest tensor of the whole step.
`linear_cross_entropy` computes the same per-token loss over `chunk_size` tokens at a time and saves only
the hidden states, the weight, the labels and two fp32 numbers per token (the softmax max and sum). Backward
recomputes each chunk's logits, turns them into the logits' gradient exactly as megatron-core's
`_VocabParallelCrossEntropy` does (softmax minus the one-hot target, times the incoming gradient, cast to
the logits' dtype) and multiplies out the hidden states' and the weight's gradients; the weight's is
accumulated over the chunks in fp32 and cast once, as a single GEMM would.

Tensor parallelism follows megatron-core's: each rank holds V / TP rows of the weight; the max, the sum of
exponentials and the target's logit are all-reduced over TP per chunk. The input is gathered over the
sequence first under sequence parallelism (backward: reduce-scatter) or copied into the TP region
(backward: all-reduce), megatron-core's own region functions around a loss that reads as one device's.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

from diffmeg.errors import DiffmegError


def _chunks(n: int, size: int):
    for start in range(0, n, size):
        yield start, min(n, start + size)


def _logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[c, H] x [v, H] -> [c, v] in fp32: the GEMM in the model dtype, then fp32 as megatron-core's loss
    (float64 stays float64, for the golden tests; megatron-core's would round it to fp32)."""
    logits = torch.matmul(hidden, weight.t())
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


class _LinearCrossEntropy(torch.autograd.Function):
    """Per-token loss of hidden [n, H] (identical on every TP rank) against this rank's rows of the output
    weight [v, H]; labels [n] are global vocabulary ids. Backward returns this rank's share of the hidden
    states' gradient (the caller's region function sums the shares) and its rows' gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size: int, tp_group):
        n, v = hidden.shape[0], weight.shape[0]
        tp = tp_group.size() if tp_group is not None else 1
        first = (tp_group.rank() if tp > 1 else 0) * v
        local = labels - first  # [n]: index into this rank's rows
        outside = (local < 0) | (local >= v)  # [n]: the target lives on another rank
        local = local.masked_fill(outside, 0)
        loss = torch.empty(n, dtype=torch.promote_types(hidden.dtype, torch.float32), device=hidden.device)
        maxima, sums = torch.empty_like(loss), torch.empty_like(loss)
        for start, stop in _chunks(n, chunk_size):
            logits = _logits(hidden[start:stop], weight)  # [c, v] fp32
            top = logits.max(dim=-1).values  # [c]
            if tp > 1:
                torch.distributed.all_reduce(top, op=torch.distributed.ReduceOp.MAX, group=tp_group)
            logits -= top.unsqueeze(-1)
            target = logits.gather(1, local[start:stop].unsqueeze(-1)).squeeze(-1)  # [c]
            target = target.masked_fill(outside[start:stop], 0.0)
            logits.exp_()
            target_and_sum = torch.stack([target, logits.sum(dim=-1)])  # [2, c]
            del logits
            if tp > 1:
                torch.distributed.all_reduce(target_and_sum, group=tp_group)
            target, total = target_and_sum
            loss[start:stop] = torch.log(total) - target
            maxima[start:stop], sums[start:stop] = top, total
        ctx.save_for_backward(hidden, weight, local, outside, maxima, sums)
        ctx.chunk_size = chunk_size
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, local, outside, maxima, sums = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # fp32 accumulation over the chunks (a bf16 weight's gradient is rounded once, at the end)
        wide = torch.promote_types(weight.dtype, torch.float32)
        grad_weight = torch.zeros(weight.shape, dtype=wide, device=weight.device) if need_weight else None
        hit = (~outside).to(wide)  # [n]: 1 where the target is one of this rank's rows
        for start, stop in _chunks(hidden.shape[0], ctx.chunk_size):
            h = hidden[start:stop]  # [c, H]
            grad = _logits(h, weight)  # [c, v], then in place: softmax, minus one-hot, times grad_loss
            grad -= maxima[start:stop].unsqueeze(-1)
            grad.exp_()
            grad /= sums[start:stop].unsqueeze(-1)
            rows = torch.arange(stop - start, device=grad.device)
            grad[rows, local[start:stop]] -= hit[start:stop]
            grad *= grad_loss[start:stop].unsqueeze(-1)
            grad = grad.to(weight.dtype)  # what autograd hands the output layer through logits.float()
            if need_hidden:
                torch.matmul(grad, weight, out=grad_hidden[start:stop])
            if need_weight:
                if grad_weight.dtype == grad.dtype:
                    grad_weight.addmm_(grad.t(), h)
                else:
                    grad_weight += torch.matmul(grad.t(), h)
            del grad
        if need_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int,
    *,
    sequence_parallel: bool = False,
    tp_group=None,
) -> torch.Tensor:
    """Per-token cross entropy [b, s] (fp32) of `labels` [b, s] under logits `hidden @ weight.T`, computed
    `chunk_size` tokens at a time: what GPTModel's output layer plus `compute_language_model_loss` return.

    hidden: [s, b, H], or [s / TP, b, H] under sequence parallelism; weight: [V / TP, H], this rank's rows.
    """
    if chunk_size < 1:
        raise DiffmegError(f"the cross-entropy chunk size must be >= 1 token, got {chunk_size}")
    tp = tp_group.size() if tp_group is not None else 1
    if sequence_parallel and tp > 1:
        hidden = gather_from_sequence_parallel_region(hidden, group=tp_group)  # [s, b, H]
    elif tp > 1:
        hidden = copy_to_tensor_model_parallel_region(hidden, group=tp_group)
    s, b, h = hidden.shape
    flat_labels = labels.transpose(0, 1).reshape(s * b)  # [b, s] -> [s * b], token order of hidden
    loss = _LinearCrossEntropy.apply(hidden.reshape(s * b, h), weight, flat_labels, chunk_size, tp_group)
    return loss.view(s, b).transpose(0, 1).contiguous()  # [s * b] -> [b, s]
