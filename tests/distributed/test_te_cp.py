"""The real Transformer Engine path of `--cp-comm-type p2p/all_gather/a2a` on GPUs (skipped elsewhere).

On CPU the TE path is tested through a stand-in (tests/parallel/test_te_attention.py and the parity runs in
tests/distributed/test_context_parallel.py). These tests check megatron-core's TEDotProductAttention
itself; they have NOT been run yet (no GPU or TE where this was written):

- one GPU: the two-map composition through TE (V of 2d in one call for p2p, split for the others)
  against float64 math, no more than twice the error of torch SDPA in bf16;
- two GPUs (torchrun, nccl, CP=2): DiffCoreAttention with each TE comm type against the Ulysses path,
  output and input gradients, with the same bf16 error bound against a float64 Ulysses run.

Run: `pytest -m gpu tests/distributed/test_te_cp.py`.
"""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from diffmeg.runtime import transformer_engine_available as te_attention_available
from tests.builders import tiny_config
from tests.distributed.runner import job_env, launch_cmd

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not te_attention_available(), reason="needs transformer_engine and a CUDA GPU"),
]

TE_COMMS = ("p2p", "all_gather", "a2a")


def _config(heads: int, kv_heads: int, d: int, cp: int, comm: str):
    """bf16, built on the GPU (megatron-core's default), CP over `cp` ranks with TE's `comm`."""
    return tiny_config(
        heads,
        kv_heads,
        d,
        ffn=4 * heads * d,
        use_cpu_initialization=False,
        context_parallel_size=cp,
        cp_comm_type=comm,
        params_dtype=torch.bfloat16,
        bf16=True,
    )


def _rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("comm", ["p2p", "all_gather"])
def test_te_two_maps_match_float64_on_one_gpu(single_rank_parallel_state, comm):
    """TEDotProductAttention (no CP) computing A1 V - lam A2 V, GQA, V of 2d whole or split."""
    from megatron.core.transformer.enums import AttnMaskType

    from diffmeg.kernels.reference import diff_attention_reference
    from diffmeg.kernels.sdpa import diff_attention_sdpa
    from diffmeg.parallel import DiffMapsWithCP

    heads, kv_heads, d, s, b = 8, 2, 128, 2048, 2
    cfg = _config(heads, kv_heads, d, 1, comm)
    maps = DiffMapsWithCP(cfg, 1, AttnMaskType.causal, "self", d**-0.5, comm, None).cuda()
    gen = torch.Generator(device="cuda").manual_seed(0)
    query = torch.randn(s, b, 2 * heads, d, device="cuda", generator=gen, dtype=torch.bfloat16)
    key = torch.randn(s, b, 2 * kv_heads, d, device="cuda", generator=gen, dtype=torch.bfloat16)
    value = torch.randn(s, b, 2 * kv_heads, d, device="cuda", generator=gen, dtype=torch.bfloat16)
    lam = torch.tensor(0.37, device="cuda")
    out = maps(query, key, value, lam)  # [s, b, h, 2d]

    def maps(x, t):  # [s, b, 2n, d] -> the two maps' [b, n, s, d] (adjacent sub-heads), in dtype t
        y = x.to(t).view(s, b, x.shape[2] // 2, 2, d).permute(3, 1, 2, 0, 4)
        return y[0], y[1]

    def values(x, t):  # [s, b, 2g, d] -> V of width 2d per KV head: [b, g, s, 2d]
        return x.to(t).reshape(s, b, x.shape[2] // 2, 2 * d).permute(1, 2, 0, 3)

    scale = d**-0.5
    f64, bf16 = torch.float64, torch.bfloat16
    ref = diff_attention_reference(
        *maps(query, f64), *maps(key, f64), values(value, f64), lam.double(), scale=scale
    ).permute(2, 0, 1, 3)  # [s, b, h, 2d]
    base = diff_attention_sdpa(
        *maps(query, bf16), *maps(key, bf16), values(value, bf16), lam, scale=scale
    ).permute(2, 0, 1, 3)
    assert out.shape == ref.shape
    assert _rel_err(out, ref) <= 2 * _rel_err(base, ref) + 1e-3


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="CP=2 needs two GPUs")
def test_te_context_parallel_matches_ulysses_on_two_gpus(tmp_path):
    env = job_env(None, 2)
    cmd = launch_cmd(2, ["-m", "tests.distributed.test_te_cp"])
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert "te-cp-ok" in proc.stdout


def _two_gpu_check() -> None:
    """Each rank: DiffCoreAttention on its load-balanced tokens, TE comm types vs Ulysses vs float64."""
    from megatron.core import parallel_state
    from megatron.core.transformer.enums import AttnMaskType

    from diffmeg.attention import DiffCoreAttention
    from diffmeg.parallel import slice_sequence_for_cp

    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.distributed.init_process_group("nccl")
    parallel_state.initialize_model_parallel(context_parallel_size=2)
    heads, kv_heads, d, s, b, layer = 4, 2, 128, 4096, 1, 3

    def run(comm: str, dtype: torch.dtype):
        core = DiffCoreAttention(_config(heads, kv_heads, d, 2, comm), layer, AttnMaskType.causal, "self")
        core = core.cuda()
        gen = torch.Generator(device="cuda").manual_seed(7)  # same tensors on both ranks
        with torch.no_grad():
            for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
                getattr(core, name).copy_(0.5 * torch.randn(d, device="cuda", generator=gen))
            core.head_norm.weight.copy_(1 + 0.3 * torch.randn(2 * d, device="cuda", generator=gen))
        full = [
            torch.randn(s, b, 2 * n, d, device="cuda", generator=gen) for n in (heads, kv_heads, kv_heads)
        ]
        grad_out = torch.randn(s, b, heads * 2 * d, device="cuda", generator=gen)
        local = [slice_sequence_for_cp(t, 0, rank, 2).to(dtype).requires_grad_(True) for t in full]
        out = core(*local, None)
        (out * slice_sequence_for_cp(grad_out, 0, rank, 2).to(dtype)).sum().backward()
        return [out, *(t.grad for t in local)]

    ref = run("ulysses", torch.float64)
    ulysses = run("ulysses", torch.bfloat16)
    for comm in TE_COMMS:
        te = run(comm, torch.bfloat16)
        for name, x, u, r in zip(("out", "dq", "dk", "dv"), te, ulysses, ref, strict=True):
            e_te, e_ul = _rel_err(x, r), _rel_err(u, r)
            assert e_te <= 2 * e_ul + 1e-3, f"rank {rank} {comm} {name}: TE {e_te:.2e} vs Ulysses {e_ul:.2e}"
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    if rank == 0:
        print("te-cp-ok", flush=True)


if __name__ == "__main__":  # torchrun entry of the two-GPU check
    _two_gpu_check()
