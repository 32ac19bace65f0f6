"""FP8 without Transformer Engine (diffmeg.fusions.torchao_fp8): the local spec's converter replaces exactly
the layer's QKV, out-proj and MLP linears, a tiny model's loss and gradients match fp32 within FP8's
rounding (torchao's emulation on CPU), and every machine that cannot run it refuses in one line."""

from __future__ import annotations

import pytest
import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

pytest.importorskip("torchao.float8")

from diffmeg import registry  # noqa: E402
from diffmeg.errors import DiffmegError  # noqa: E402
from diffmeg.fusions import torchao_fp8  # noqa: E402
from diffmeg.fusions.torchao_fp8 import (  # noqa: E402
    Float8ColumnParallelLinear,
    Float8RowParallelLinear,
    TorchaoFp8,
)
from diffmeg.layer_specs import get_diff_layer_local_spec  # noqa: E402
from tests.builders import tiny_config  # noqa: E402

FP8 = dict(fp8="hybrid", fp8_recipe="tensorwise", fp8_emulate=True)
FULL_RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def _linears(spec) -> dict[str, type]:
    """Each linear field of a layer spec by its dotted path."""
    import dataclasses

    found: dict[str, type] = {}

    def visit(node, path: str) -> None:
        if isinstance(node, type) and issubclass(node, (ColumnParallelLinear, RowParallelLinear)):
            found[path] = node
        elif hasattr(node, "module") and hasattr(node, "submodules"):
            visit(node.module, path)
            visit(node.submodules, path)
        elif dataclasses.is_dataclass(node) and not isinstance(node, type):
            for f in dataclasses.fields(node):
                visit(getattr(node, f.name), f"{path}.{f.name}".lstrip("."))

    visit(spec, "")
    return found


@pytest.mark.parametrize("version", [1, 2])
def test_the_spec_rewrite_replaces_exactly_qkv_proj_and_the_mlp(version):
    cfg = tiny_config(2, 2, 16, diff_version=version, **FP8)
    spec = get_diff_layer_local_spec(cfg)
    before = _linears(spec)
    after = _linears(TorchaoFp8(cfg).convert(spec))
    assert _linears(spec) == before  # the input spec is kept
    fp8 = {p for p, c in after.items() if c in (Float8ColumnParallelLinear, Float8RowParallelLinear)}
    assert {p.rsplit(".", 1)[-1] for p in fp8} == set(torchao_fp8.FP8_LINEARS)
    kept = {p: c for p, c in after.items() if p not in fp8}
    assert kept == {p: c for p, c in before.items() if p not in fp8}
    if version == 2:  # the lambda projection stays in high precision
        assert any("lambda" in p for p in kept)
    for p in fp8:  # column stays column, row stays row
        assert issubclass(after[p], before[p])


def _loss_and_grads(cfg, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    from diffmeg.model import build_model

    model = build_model(cfg, vocab_size=64, max_sequence_length=32, rotary_base=500.0, seed=3)
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    loss = model(input_ids=tokens, position_ids=positions, attention_mask=None, labels=tokens.roll(-1, 1))
    loss.mean().backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, model


@pytest.mark.parametrize("version", [1, 2])
def test_a_tiny_model_trains_in_fp8_with_fp32s_loss_and_gradients(single_rank_parallel_state, version):
    tokens = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    ref_loss, ref_grads, _ = _loss_and_grads(tiny_config(2, 2, 16, ffn=64, diff_version=version), tokens)
    cfg = tiny_config(2, 2, 16, ffn=64, diff_version=version, **FP8)
    loss, grads, model = _loss_and_grads(cfg, tokens)
    fp8_classes = (Float8ColumnParallelLinear, Float8RowParallelLinear)
    converted = [m for m in model.modules() if isinstance(m, fp8_classes)]
    assert len(converted) == 4  # one layer: QKV, proj, fc1, fc2
    # FP8's rounding shows (the matmuls really ran in FP8) but stays within its precision (e4m3: 2^-4)
    assert not torch.equal(loss, ref_loss)
    assert torch.allclose(loss, ref_loss, rtol=2e-2, atol=0)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        ref = ref_grads[name]
        cos = torch.nn.functional.cosine_similarity(g.flatten(), ref.flatten(), dim=0)
        assert cos > 0.98, (name, cos.item())  # per tensor: the direction (lambda's are cancelled sums)
    flat, ref_flat = (torch.cat([g.flatten() for g in d.values()]) for d in (grads, ref_grads))
    assert (flat - ref_flat).norm() <= 0.1 * ref_flat.norm()


def test_hybrid_casts_the_output_gradient_to_e5m2():
    x = torch.randn(8, 2, 32, requires_grad=True, generator=torch.Generator().manual_seed(1))
    w = torch.randn(48, 32, generator=torch.Generator().manual_seed(2)).requires_grad_()
    grads = {}
    for fmt in ("e4m3", "hybrid"):
        out = torchao_fp8.float8_linear(x, w, fmt, emulate=True)
        (dx,) = torch.autograd.grad(out, x, torch.linspace(-3, 3, out.numel()).view_as(out))
        grads[fmt] = dx
    forward = [torchao_fp8.float8_linear(x, w, fmt, emulate=True) for fmt in ("e4m3", "hybrid")]
    assert torch.equal(*forward)  # the forward is e4m3 in both
    assert not torch.equal(grads["e4m3"], grads["hybrid"])  # e5m2 has one mantissa bit less


def test_the_local_spec_selects_torchao_and_the_te_spec_needs_no_converter():
    """The Transformer Engine spec's linears are TE's already: megatron-core runs them in FP8 from the
    config, so the slot holds the local spec's converter only."""
    assert registry.select("fp8_linear", spec="local").name == "torchao"
    assert registry.names("fp8_linear") == ("torchao",)


@pytest.mark.parametrize(
    "fields,cuda,match",
    [
        (dict(fp8_recipe="delayed"), False, "add --fp8-recipe tensorwise$"),
        (dict(fp8_emulate=False), False, "on CPU only emulation runs .*leave out --fp8-format$"),
        (dict(fp8_emulate=False), (8, 0), "compute capability 8.9\\+ .* is 8.0: leave out --fp8-format$"),
        (FULL_RECOMPUTE, False, "use --recompute-granularity selective"),
    ],
    ids=["delayed", "cpu", "ampere", "full-recompute"],
)
def test_what_cannot_run_is_refused_in_one_line(monkeypatch, fields, cuda, match):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(cuda))
    if cuda:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: cuda)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    cfg = tiny_config(2, 2, 16, **{**FP8, **fields})
    with pytest.raises(DiffmegError, match=match) as err:
        TorchaoFp8(cfg)
    assert "\n" not in str(err.value)


def test_a_hopper_gpu_passes_the_check(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert torchao_fp8.fp8_unsupported_reason(emulate=False) is None


def _tp2_check(rank: int, sequence_parallel: bool) -> None:
    """Column then row FP8 linear over TP2 against the same FP8 products taken shard by shard on one
    process: each rank's output, input gradient and weight-gradient shard (the scales are per shard)."""
    cfg = tiny_config(2, 2, 16, tensor_model_parallel_size=2, sequence_parallel=sequence_parallel, **FP8)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 2, 64, generator=gen)  # [s, b, h]
    w1, w2 = torch.randn(128, 64, generator=gen), torch.randn(64, 128, generator=gen)
    dy = torch.randn(8, 2, 64, generator=gen)
    zeros = torch.nn.init.zeros_
    col = Float8ColumnParallelLinear(64, 128, config=cfg, init_method=zeros, bias=False, gather_output=False)
    row = Float8RowParallelLinear(
        128, 64, config=cfg, init_method=zeros, bias=False, input_is_parallel=True, skip_bias_add=False
    )
    w1_shards, w2_shards = w1.chunk(2, dim=0), w2.chunk(2, dim=1)
    with torch.no_grad():
        col.weight.copy_(w1_shards[rank])
        row.weight.copy_(w2_shards[rank])
    local = (lambda t: t.chunk(2, dim=0)[rank]) if sequence_parallel else (lambda t: t)
    x_in = local(x).clone().requires_grad_(True)
    y, _ = row(col(x_in)[0])
    y.backward(local(dy))

    ref_x, ref_w1, ref_w2 = (t.clone().requires_grad_(True) for t in (x, w1, w2))
    emu = dict(fp8_format="hybrid", emulate=True)
    hidden = [torchao_fp8.float8_linear(ref_x, w, **emu) for w in ref_w1.chunk(2, dim=0)]
    ref_y = sum(
        torchao_fp8.float8_linear(h, w, **emu) for h, w in zip(hidden, ref_w2.chunk(2, dim=1), strict=True)
    )
    ref_y.backward(dy)
    tight = dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(y, local(ref_y), **tight)
    torch.testing.assert_close(x_in.grad, local(ref_x.grad), **tight)
    torch.testing.assert_close(col.weight.grad, ref_w1.grad.chunk(2, dim=0)[rank], **tight)
    torch.testing.assert_close(row.weight.grad, ref_w2.grad.chunk(2, dim=1)[rank], **tight)


def _tp2_worker(rank: int, port: int) -> None:
    import os

    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=rank
    )
    from megatron.core import parallel_state

    from diffmeg import runtime
    from diffmeg.compat import model_parallel_manual_seed

    runtime.setup()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    model_parallel_manual_seed(1234)
    try:
        for sequence_parallel in (False, True):
            _tp2_check(rank, sequence_parallel)
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_tp2_and_sequence_parallel_keep_megatron_cores_semantics():
    """TP2 without and with SP in one pair of processes (each start costs seconds of imports)."""
    import torch.multiprocessing as mp

    from tests.conftest import free_port

    torch.set_num_threads(1)
    mp.spawn(_tp2_worker, args=(free_port(),), nprocs=2)
