"""The fused optimizer step (`--optimizer-impl fused`): megatron-core's step without its host syncs.

Without TransformerEngine or apex, megatron-core 0.16.1 steps torch's AdamW in its default form and does
the rest in Python fallbacks (megatron/core/optimizer/clip_grads.py, optimizer.py, core/utils.py):
- the grad norm is one `torch.norm` per tensor, gathered through `torch.tensor(list)` (a host sync per
  tensor), their norm read by `float()` (one more), then `.item()` after the all-reduce (one more);
- clipping compares that Python float with 1 and scales each grad through a `src * scale` temporary;
- the fp32 main params are copied to the bf16 model params through `dst.copy_(src * 1.0)`: a full-size
  fp32 temporary per parameter.
Here the norm is one `_foreach_norm` and a stack, summed over the same process group on the device; the
clip factor stays a device scalar (min(1, clip / (norm + 1e-6)), multiplied in with `_foreach_mul_`,
exact where it is 1); the main-to-model copy is one `_foreach_copy_`; AdamW runs torch's `fused=True`
kernel (CUDA and CPU; its `foreach` form elsewhere), which keeps its step counters as tensors where the
foreach form reads each one into Python twice per step. The step returns the grad norm as a 0-dim device
tensor: the Trainer reads it at log steps only. So a step reads nothing back to the host (fp16: its one
overflow flag, megatron-core's check over all grads at once; tests/fusions/test_optimizer_step.py counts
them). Same equations as megatron-core's, so the same weights to fp32 rounding (the same tests).
"""

from __future__ import annotations

import types

import torch

from diffmeg import collectives
from diffmeg.errors import DiffmegError


def keep_megatron_step(optimizer) -> None:
    """The eager twin (`--optimizer-impl megatron`): megatron-core's optimizer steps as it was built."""
    del optimizer


def megatron_has_fused_adam() -> bool:
    """Whether megatron-core steps a fused Adam of its own (TransformerEngine's or apex's)."""
    import megatron.core.optimizer as mcore_optimizer

    return not getattr(mcore_optimizer, "USING_PYTORCH_OPTIMIZER", True)


def grad_norm(grads: list[torch.Tensor], group: torch.distributed.ProcessGroup | None) -> torch.Tensor:
    """The L2 norm of `grads` over all ranks of `group`, as a 0-dim fp32 device tensor (no host sync)."""
    distributed = group is not None and torch.distributed.get_world_size(group) > 1
    if grads:
        local = torch.stack([n.float() for n in torch._foreach_norm(grads)]).square().sum()
    else:  # a rank without grads still joins the all-reduce, with a zero on the backend's device
        local = collectives.small_tensor([0.0], torch.float32, group)[0] if distributed else torch.zeros(())
    if distributed:
        local = collectives.all_reduce(local, collectives.SUM, group)
    return local.sqrt()


def clip_(grads: list[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale `grads` in place by min(1, max_norm / (total_norm + 1e-6)) (megatron-core's factor)."""
    if grads:
        coeff = (max_norm / (total_norm + 1.0e-6)).clamp(max=1.0)
        torch._foreach_mul_(grads, coeff)


def _grads_of(optimizer) -> list[torch.Tensor]:
    """The main grads megatron-core's clip scales for one of the chained optimizers."""
    decoupled = optimizer.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
    name = "decoupled_grad" if decoupled else "grad"
    return [g.detach() for p in optimizer.get_parameters() if (g := getattr(p, name, None)) is not None]


def _foreach_copy_main_to_model(self) -> None:
    """Float16OptimizerWithFloat16Params' main-to-model copy as one foreach copy (no fp32 temporary)."""
    model_data, main_data = self._get_model_and_main_params_data_float16()
    if model_data:
        torch._foreach_copy_(model_data, main_data)


FUSED_ADAM_DEVICES = ("cuda", "cpu")
"""Where torch (>= 2.4) has its fused AdamW kernel."""


def fused_adam_runs_on(params: list[torch.Tensor]) -> bool:
    """Whether torch's fused AdamW kernel can step `params` (all on devices it has the kernel for)."""
    return all(p.device.type in FUSED_ADAM_DEVICES for p in params)


class _AdamFlags:
    """Runs torch AdamW's step with `fused` (CUDA, CPU) or `foreach` set on every param group, and puts the
    groups' own flags back after it: a checkpoint this run saves stays loadable by megatron-core's step
    exactly as before, and one it loads cannot switch the fused kernel off."""

    def __init__(self, inner: torch.optim.Optimizer, fused: bool) -> None:
        self.inner, self.fused, self.step = inner, fused, inner.step

    def __call__(self, *args, **kwargs):
        saved = [(group.get("fused"), group.get("foreach")) for group in self.inner.param_groups]
        for group in self.inner.param_groups:
            group["fused"], group["foreach"] = (True, False) if self.fused else (None, True)
        if self.fused:  # fused AdamW keeps its step counters on the device (a CPU one comes from a load)
            for p, state in self.inner.state.items():
                step = state.get("step")
                if isinstance(step, torch.Tensor) and step.device != p.device:
                    state["step"] = step.to(device=p.device, dtype=torch.float32)
        try:
            return self.step(*args, **kwargs)
        finally:
            for group, (fused, foreach) in zip(self.inner.param_groups, saved, strict=True):
                group["fused"], group["foreach"] = fused, foreach


@torch.no_grad()
def _fused_step(self):
    """megatron-core's ChainedOptimizer.step with the grad norm and clip on the device."""
    if self.prepare_grads():  # an fp16 overflow: skipped, as megatron-core does
        return False, None, None
    group = self.get_grad_stats_parallel_group()
    grads = [g for opt in self.chained_optimizers for g in opt.get_main_grads_for_grad_norm()]
    norm = grad_norm(grads, group)
    for opt in self.chained_optimizers:
        if getattr(opt, "is_stub_optimizer", False) or opt.config.clip_grad <= 0.0:
            continue
        clip_(_grads_of(opt), opt.config.clip_grad, norm)
    num_zeros = self.count_zeros() if self.config.log_num_zeros_in_grad else None
    return self.step_with_ready_grads(), norm, num_zeros


def apply_fused_step(optimizer) -> None:
    """Turn a built megatron-core optimizer's step into the fused one, in place (the object, its state
    dicts and checkpoints stay megatron-core's). Refuses a layout it does not cover."""
    from megatron.core.optimizer import ChainedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    if not isinstance(optimizer, ChainedOptimizer):
        raise DiffmegError(
            "--optimizer-impl fused expects megatron-core's ChainedOptimizer, got "
            f"{type(optimizer).__name__}; use --optimizer-impl megatron"
        )
    if not optimizer.grads_states_parallel_group_is_shared():
        raise DiffmegError(
            "--optimizer-impl fused needs one grad-norm process group for all parameters (no expert "
            "parallelism); use --optimizer-impl megatron"
        )
    for opt in optimizer.chained_optimizers:
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.AdamW):
            raise DiffmegError(
                f"--optimizer-impl fused steps torch's AdamW, but megatron-core built "
                f"{type(inner).__name__}; use --optimizer-impl megatron"
            )
        params = [p for group in inner.param_groups for p in group["params"]]
        inner.step = _AdamFlags(inner, fused=fused_adam_runs_on(params))
        if isinstance(opt, Float16OptimizerWithFloat16Params):
            opt._copy_main_params_to_model_params = types.MethodType(_foreach_copy_main_to_model, opt)
    optimizer.step = types.MethodType(_fused_step, optimizer)
