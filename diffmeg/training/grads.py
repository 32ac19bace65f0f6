"""Gradient finalisation: megatron-core's, plus the TP sum for DIFF's replicated parameters."""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from diffmeg.collectives import SUM_GRAD_OVER_TP_ATTR


def _grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    return getattr(param, "main_grad", None) if hasattr(param, "main_grad") else param.grad


def sum_replicated_grads_over_tp(model: list[torch.nn.Module]) -> None:
    """One coalesced all-reduce(SUM) over TP of every parameter tagged `SUM_GRAD_OVER_TP_ATTR`.

    Each TP rank computes lambda and head-norm gradients from its own heads only, so the true gradient
    is the sum over ranks. megatron-core's own TP reductions (sequence-parallel norms, q/k layernorm,
    `average_gradients_across_tp_domain`) do not cover these, so none of them runs twice.
    """
    group = parallel_state.get_tensor_model_parallel_group()
    if group.size() == 1:
        return
    grads = [
        g
        for chunk in model
        for p in chunk.parameters()
        if p.requires_grad and getattr(p, SUM_GRAD_OVER_TP_ATTR, False) and (g := _grad(p)) is not None
    ]
    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.SUM, group=group)
    for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
        grad.copy_(synced)


def finalize_diff_model_grads(model: list[torch.nn.Module], *args, **kwargs) -> None:
    """Drop-in for megatron-core's `finalize_model_grads` (config.finalize_model_grads_func)."""
    finalize_model_grads(model, *args, **kwargs)
    sum_replicated_grads_over_tp(model)
