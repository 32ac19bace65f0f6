"""`--gradient-accumulation-fusion` in training: the same run as without it (the CPU reference path, through
the explicit test hook), carried from the flag to megatron-core's config, and refused where it cannot run."""

from __future__ import annotations

import argparse

import pytest
import torch

from diffmeg.errors import DiffmegError
from diffmeg.fusions import grad_accum
from diffmeg.run_config import RunConfig
from diffmeg.training.arguments import resolve_args
from tests.training.helpers import SMALL, train_steps

FLAG = "--gradient-accumulation-fusion"


@pytest.fixture
def fused_gemm_calls(monkeypatch) -> list[torch.dtype]:
    """The test hook on, and each call megatron-core makes into our fp32 GEMM recorded (operand dtype)."""
    monkeypatch.setenv(grad_accum.CPU_TEST_ENV, "1")
    calls = []
    gemm = grad_accum.wgrad_gemm_accum_fp32

    def recorded(total_input, grad_output, main_grad):
        calls.append(total_input.dtype)
        gemm(total_input, grad_output, main_grad)

    monkeypatch.setattr(grad_accum, "wgrad_gemm_accum_fp32", recorded)  # looked up at each call
    return calls


@pytest.mark.parametrize(
    "flags",
    [
        (),
        ("--tie-embeddings-and-output-weights",),
        ("--use-distributed-optimizer",),
        ("--overlap-grad-reduce",),
    ],
    ids=["untied", "tied", "dist-opt", "overlap"],
)
def test_fused_accumulation_trains_as_ddps_hook_does(single_rank_parallel_state, fused_gemm_calls, flags):
    """fp32: the weight gradients go into main_grad inside the GEMM instead of through DDP's hook; losses,
    grad norms and weights agree to fp32 rounding. Tied: the output layer's product and the embedding's
    gradient share one main_grad (megatron-core's `zero_out_wgrad`). Overlap: DDP's hook, which then starts
    the bucket's reduction, still fires on the placeholder gradient megatron-core returns."""
    steps = 3
    ref_losses, ref_norms, ref_w = train_steps(*flags, steps=steps)
    assert fused_gemm_calls == []
    losses, norms, w = train_steps(*flags, FLAG, steps=steps)
    # 2 layers x (QKV, out-proj, fc1, fc2) + the output layer (tied: into the embedding's main_grad), for each
    # of 2 micro-batches a step
    linears = 2 * 4 + 1
    assert len(fused_gemm_calls) == steps * 2 * linears
    assert losses[0] == ref_losses[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=1e-7)
    assert set(w) == set(ref_w)
    for name in w:
        torch.testing.assert_close(w[name], ref_w[name], rtol=1e-5, atol=1e-6, msg=name)


def test_bf16_products_accumulate_in_fp32(single_rank_parallel_state, fused_gemm_calls):
    """--bf16: bf16 operands into the fp32 main_grad (the CUDA GEMM's job; here its CPU reference). Unfused,
    each micro-batch's weight gradient is rounded to bf16 first, so the two agree to bf16 rounding only."""
    ref_losses, ref_norms, _ = train_steps("--bf16", steps=2)
    losses, norms, _ = train_steps("--bf16", FLAG, steps=2)
    assert fused_gemm_calls and set(fused_gemm_calls) == {torch.bfloat16}
    assert losses[0] == ref_losses[0]
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=2e-2, atol=0)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-2, atol=0)


def test_the_flag_reaches_megatron_cores_config(monkeypatch):
    from diffmeg.checkpoints import single_rank_args, upgrade_saved_args
    from diffmeg.model import transformer_config

    monkeypatch.setenv(grad_accum.CPU_TEST_ENV, "1")
    assert not resolve_args(SMALL, world_size=1).gradient_accumulation_fusion  # off by default
    args = resolve_args([*SMALL, FLAG], world_size=1)
    run = RunConfig.from_args(args)
    assert run.training.gradient_accumulation_fusion and vars(run.to_args()) == vars(args)
    assert transformer_config(run).gradient_accumulation_fusion
    old = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "gradient_accumulation_fusion"})
    assert upgrade_saved_args(old).gradient_accumulation_fusion is False  # runs before the flag: DDP's hook
    assert single_rank_args(args).gradient_accumulation_fusion is False  # readers build without DDP


def test_refused_on_cpu_without_the_test_hook(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("the CPU refusal")
    monkeypatch.delenv(grad_accum.CPU_TEST_ENV, raising=False)
    with pytest.raises(DiffmegError, match="^--gradient-accumulation-fusion needs a CUDA GPU"):
        resolve_args([*SMALL, FLAG], world_size=1)


def test_refused_with_torchaos_fp8(monkeypatch):
    """The flags' validation reads torchao's one rule, so the lever matrix cannot hold the pair."""
    from diffmeg.fusions import torchao_fp8

    monkeypatch.setenv(grad_accum.CPU_TEST_ENV, "1")
    monkeypatch.setattr(torchao_fp8, "fp8_unsupported_reason", lambda emulate=False: None)  # as on an H100
    fp8 = ["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]
    assert resolve_args([*SMALL, *fp8], world_size=1).fp8_format == "hybrid"
    with pytest.raises(
        DiffmegError, match="^torchao's FP8 linears .* leave out --gradient-accumulation-fusion"
    ):
        resolve_args([*SMALL, *fp8, FLAG], world_size=1)
