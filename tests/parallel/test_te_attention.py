"""megatron-core-style (TE) context parallelism for DIFF, on CPU through the plain-torch stand-in.

Transformer Engine is not installable here, so `AllGatherCPAttention` (tests/parallel/cp_stand_in.py:
TEDotProductAttention's constructor and call signature, CP by all-gathering K/V) goes in through the
differential core's `cp_attention` submodule. Two gloo ranks (CP=2) check the stand-in against plain
causal attention and DiffCoreAttention's two-map composition against the float64 equations of
tests/reference_model.py, values and gradients. What this cannot show is that real TE behaves like the
stand-in: see the `gpu` test in tests/distributed/test_te_cp.py.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from tests.conftest import free_port

CP = 2


def _causal_attention(q, k, v, scale):
    """[s, b, n, dk] x [s, b, g, dk] x [s, b, g, dv] -> [s, b, n * dv], float64, GQA by repeat."""
    s, b, n, _ = q.shape
    rep = n // k.shape[2]
    qh, kh, vh = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    kh, vh = kh.repeat_interleave(rep, dim=1), vh.repeat_interleave(rep, dim=1)
    scores = (qh @ kh.transpose(-1, -2)) * scale
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return (torch.softmax(scores, dim=-1) @ vh).permute(2, 0, 1, 3).reshape(s, b, -1)


def _local(t: torch.Tensor, rank: int) -> torch.Tensor:
    from diffmeg.parallel import slice_sequence_for_cp

    return slice_sequence_for_cp(t, 0, rank, CP)


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def _check_standin(rank: int) -> None:
    """The stand-in on this rank's tokens equals full causal attention's rows at their positions."""
    from megatron.core.transformer.enums import AttnMaskType

    from tests.builders import make_config
    from tests.parallel.cp_stand_in import AllGatherCPAttention

    for heads, kv_heads, dk, dv in [(4, 4, 8, 8), (4, 2, 8, 16), (3, 1, 8, 16)]:
        cfg = make_config(heads=2, kv_heads=2, head_dim=dk)  # only its TP size is read with explicit sizes
        cfg.num_attention_heads, cfg.num_query_groups = heads, kv_heads
        attn = AllGatherCPAttention(cfg, 1, AttnMaskType.causal, "self", k_channels=dk, v_channels=dv)
        gen = torch.Generator().manual_seed(heads * 100 + kv_heads * 10 + dv)
        s, b = 16, 2
        q = torch.randn(s, b, heads, dk, generator=gen, dtype=torch.float64)
        k = torch.randn(s, b, kv_heads, dk, generator=gen, dtype=torch.float64)
        v = torch.randn(s, b, kv_heads, dv, generator=gen, dtype=torch.float64)
        grad_out = torch.randn(s, b, heads * dv, generator=gen, dtype=torch.float64)
        full = [_leaf(t) for t in (q, k, v)]
        ref = _causal_attention(*full, scale=dk**-0.5)
        (ref * grad_out).sum().backward()
        mine = [_leaf(_local(t, rank)) for t in (q, k, v)]
        out = attn(*mine, None, attn_mask_type=AttnMaskType.causal)
        (out * _local(grad_out, rank)).sum().backward()
        torch.testing.assert_close(out, _local(ref, rank), rtol=1e-12, atol=1e-12)
        for name, m, r in zip("qkv", mine, full, strict=True):  # dK/dV: every rank's queries summed
            torch.testing.assert_close(m.grad, _local(r.grad, rank), rtol=1e-11, atol=1e-12, msg=name)


def _check_diff_composition(rank: int) -> None:
    """DiffCoreAttention with cp_comm_type p2p/all_gather/a2a (and ulysses) vs the float64 equations."""
    from megatron.core.transformer.enums import AttnMaskType

    from diffmeg.attention import DiffCoreAttention, DiffCoreAttentionSubmodules
    from diffmeg.parallel import DiffMapsWithCP
    from tests.builders import make_config
    from tests.parallel.cp_stand_in import AllGatherCPAttention
    from tests.reference_model import diff_heads, lambda_init

    cases = [  # (h, g, comm, n): n noise heads (grouped differential attention), None: the 1:1 pairs
        (4, 4, "p2p", None),
        (4, 2, "p2p", None),
        (3, 1, "p2p", None),  # 3 heads, 1 KV head: not divisible by CP=2, fine for TE's p2p and all_gather
        (4, 2, "all_gather", None),
        (3, 3, "all_gather", None),
        (2, 2, "a2a", None),
        (4, 2, "ulysses", None),
        (4, 1, "p2p", 1),  # 4 signal heads over one noise head: 5 query sub-heads
        (4, 2, "all_gather", 2),
        (4, 2, "a2a", 2),
    ]
    d, s, b, layer_number = 8, 16, 2, 3
    for heads, kv_heads, comm, noise in cases:
        cfg = make_config(heads, kv_heads, d, context_parallel_size=CP, cp_comm_type=comm, noise=noise)
        noise = noise or heads
        stand_in = DiffCoreAttentionSubmodules(cp_attention=AllGatherCPAttention)
        core = DiffCoreAttention(cfg, layer_number, AttnMaskType.causal, "self", submodules=stand_in).double()
        assert isinstance(core.cp_maps, DiffMapsWithCP) == (comm != "ulysses")
        if comm != "ulysses":
            assert core.cp_maps.split_value == (comm != "p2p")
        gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
        with torch.no_grad():  # lambda far from init, a non-trivial head-norm weight; equal on both ranks
            for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
                getattr(core, name).copy_(torch.randn(d, generator=gen, dtype=torch.float64) * 0.5)
            core.head_norm.weight.copy_(1 + 0.3 * torch.randn(2 * d, generator=gen, dtype=torch.float64))
        q = torch.randn(s, b, heads + noise, d, generator=gen, dtype=torch.float64)
        k = torch.randn(s, b, 2 * kv_heads, d, generator=gen, dtype=torch.float64)
        v = torch.randn(s, b, 2 * kv_heads, d, generator=gen, dtype=torch.float64)
        grad_out = torch.randn(s, b, heads * 2 * d, generator=gen, dtype=torch.float64)

        mine = [_leaf(_local(t, rank)) for t in (q, k, v)]
        out = core(*mine, None)
        (out * _local(grad_out, rank)).sum().backward()

        params = [core.lambda_q1, core.lambda_k1, core.lambda_q2, core.lambda_k2, core.head_norm.weight]
        ref_params = [_leaf(p) for p in params]
        qr, kr, vr = (_leaf(t) for t in (q, k, v))
        ref = []
        r = heads // noise
        for bi in range(b):  # groups [signal x r, noise] (r = 1: sub-heads 2i, 2i+1 are Q1/Q2 of head i)
            groups = qr[:, bi].view(s, noise, r + 1, d)
            q1 = groups[:, :, :r].reshape(s, heads, d).transpose(0, 1)  # [h, s, d]
            q2 = groups[:, :, r].transpose(0, 1)  # [n, s, d]
            k1, k2 = kr[:, bi, 0::2].transpose(0, 1), kr[:, bi, 1::2].transpose(0, 1)
            vv = torch.cat([vr[:, bi, 0::2], vr[:, bi, 1::2]], dim=-1).transpose(0, 1)
            ref.append(diff_heads(q1, q2, k1, k2, vv, *ref_params, lambda_init(layer_number - 1)))
        ref = torch.stack(ref, dim=1)  # [s, b, h * 2d]
        (ref * grad_out).sum().backward()

        tag = f"{comm} h={heads} g={kv_heads} n={noise}"
        torch.testing.assert_close(out, _local(ref, rank), rtol=1e-10, atol=1e-10, msg=tag)
        for name, m, r in zip("qkv", mine, (qr, kr, vr), strict=True):
            torch.testing.assert_close(
                m.grad, _local(r.grad, rank), rtol=1e-9, atol=1e-10, msg=f"{tag} d{name}"
            )
        for p, r in zip(params, ref_params, strict=True):  # each rank's part; CP ranks' grads sum to it
            grad = p.grad.clone()
            torch.distributed.all_reduce(grad)
            torch.testing.assert_close(grad, r.grad, rtol=1e-9, atol=1e-10, msg=tag)


def _worker(rank: int, port: int, checks: list[str]) -> None:
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=CP, rank=rank
    )
    from megatron.core import parallel_state

    from diffmeg import runtime
    from diffmeg.compat import model_parallel_manual_seed

    runtime.setup()
    parallel_state.initialize_model_parallel(context_parallel_size=CP)
    model_parallel_manual_seed(1234)
    try:
        for check in checks:
            globals()[check](rank)
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_standin_and_two_map_composition_with_cp2():
    """Both checks in one pair of processes (each start costs seconds of imports)."""
    torch.set_num_threads(1)
    mp.spawn(_worker, args=(free_port(), ["_check_standin", "_check_diff_composition"]), nprocs=CP)


def test_cp_comm_type_flag(monkeypatch):
    """Defaults, and one clear line for every impossible combination."""
    import diffmeg.parallel.te_attention as te_attention
    from diffmeg.errors import DiffmegError
    from diffmeg.training.arguments import resolve_args
    from tests.parallel.cp_stand_in import AllGatherCPAttention

    monkeypatch.setenv("WORLD_SIZE", "2")
    cp2 = ["--model", "diff-tiny", "--context-parallel-size", "2"]
    assert resolve_args(cp2).cp_comm_type == "ulysses"
    assert resolve_args(["--model", "transformer-tiny"]).cp_comm_type == "p2p"
    if not te_attention.cp_attention_available():
        with pytest.raises(
            DiffmegError, match=r"needs transformer_engine and a CUDA GPU; use --cp-comm-type ulysses"
        ):
            resolve_args([*cp2, "--cp-comm-type", "p2p"])
    with pytest.raises(DiffmegError, match="hierarchical CP groups"):
        resolve_args([*cp2, "--cp-comm-type", "a2a+p2p"])
    with pytest.raises(DiffmegError, match="baseline uses megatron-core's Transformer Engine attention"):
        resolve_args(
            ["--model", "transformer-tiny", "--context-parallel-size", "2", "--cp-comm-type", "ulysses"]
        )
    with pytest.raises(DiffmegError, match="Transformer Engine on a GPU"):
        resolve_args(["--model", "transformer-tiny", "--context-parallel-size", "2"])
    # diff-tiny has 4 heads: CP=8 cannot shard them, but the TE modes keep all heads on every rank.
    monkeypatch.setenv("WORLD_SIZE", "8")
    cp8 = ["--model", "diff-tiny", "--context-parallel-size", "8"]
    with pytest.raises(DiffmegError, match=r"with --cp-comm-type ulysses .* need not"):
        resolve_args(cp8)
    with pytest.raises(DiffmegError, match="with --cp-comm-type a2a"):
        resolve_args([*cp8, "--cp-comm-type", "a2a"])
    monkeypatch.setattr(te_attention, "default_cp_attention", lambda: AllGatherCPAttention)
    for comm in ("p2p", "all_gather"):
        assert resolve_args([*cp8, "--cp-comm-type", comm]).cp_comm_type == comm
    with pytest.raises(DiffmegError, match=r"divisible by 2 x CP = 16"):
        resolve_args([*cp8, "--cp-comm-type", "p2p", "--seq-length", "200"])
    with pytest.raises(DiffmegError, match="--attention-dropout 0"):
        resolve_args([*cp8, "--cp-comm-type", "p2p", "--attention-dropout", "0.1"])


def test_config_cp_comm_type_validation():
    from diffmeg.errors import DiffmegError
    from tests.builders import make_config

    assert make_config(heads=3, kv_heads=1, context_parallel_size=2, cp_comm_type="p2p").cp_comm_type == "p2p"
    with pytest.raises(DiffmegError, match="shards whole differential heads"):
        make_config(heads=3, kv_heads=1, context_parallel_size=2)
    with pytest.raises(DiffmegError, match="cp-comm-type must be one of"):
        make_config(cp_comm_type="ring")
    with pytest.raises(DiffmegError, match="baseline"):
        make_config(diff_attention=False, cp_comm_type="ulysses")


def test_without_te_the_maps_refuse_to_build(single_rank_parallel_state, monkeypatch):
    """No stand-in and no TE: building the TE path is one clear error, not an ImportError deep inside."""
    from megatron.core.transformer.enums import AttnMaskType

    import diffmeg.parallel.te_attention as te_attention
    from diffmeg.errors import DiffmegError
    from tests.builders import make_config

    monkeypatch.setattr(te_attention, "transformer_engine_available", lambda: False)
    cfg = make_config(context_parallel_size=2, cp_comm_type="p2p")
    with pytest.raises(DiffmegError, match="use --cp-comm-type ulysses"):
        te_attention.DiffMapsWithCP(cfg, 1, AttnMaskType.causal, "self", 0.1, "p2p", None)
