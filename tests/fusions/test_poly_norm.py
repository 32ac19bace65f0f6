"""PolyNorm (diffmeg.fusions.poly_norm): the Function against the equation in float64 (values and every
gradient), against its eager twin in each dtype, what it keeps for backward, and the mean over the whole
FFN dimension when tensor parallelism splits it."""

from __future__ import annotations

import pytest
import torch

from diffmeg.fusions.poly_norm import PolyNorm, poly_norm, poly_norm_eager


def _definition(z, w, b, eps=1e-6):
    """PolyNorm written out: w0 norm(z^3) + w1 norm(z^2) + w2 norm(z) + b, norm over the last dimension."""

    def norm(u):
        return u / torch.sqrt((u * u).mean(-1, keepdim=True) + eps)

    return w[0] * norm(z**3) + w[1] * norm(z**2) + w[2] * norm(z) + b[0]


def _inputs(dtype, shape=(5, 2, 12), seed=0):
    gen = torch.Generator().manual_seed(seed)
    z = (torch.randn(shape, generator=gen, dtype=torch.float64) * 1.5).to(dtype).requires_grad_()
    w = torch.tensor([0.5, -0.3, 0.9], dtype=torch.float64, requires_grad=True)
    b = torch.tensor([0.2], dtype=torch.float64, requires_grad=True)
    return z, w, b


def test_poly_norm_is_the_equation_in_float64():
    z, w, b = _inputs(torch.float64)
    zr, wr, br = (t.detach().clone().requires_grad_() for t in (z, w, b))
    out, ref = poly_norm(z, w, b), _definition(zr, wr, br)
    torch.testing.assert_close(out, ref, rtol=1e-13, atol=1e-13)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out.backward(grad)
    ref.backward(grad)
    for got, want, name in ((z, zr, "z"), (w, wr, "weight"), (b, br, "bias")):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-11, atol=1e-12, msg=name)


def test_the_module_starts_as_motifs_init_and_is_the_function():
    module = PolyNorm(12)
    assert module.weight.tolist() == pytest.approx([1 / 3] * 3) and module.bias.tolist() == [0.0]
    assert module.weight.dtype == torch.float32
    z = torch.randn(4, 12, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    torch.testing.assert_close(module(z), _definition(z, module.weight.double(), module.bias.double()))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_poly_norm_equals_its_eager_twin(dtype):
    fused, eager = _inputs(dtype), _inputs(dtype)
    out, want = poly_norm(*fused), poly_norm_eager(*eager)
    assert out.dtype == dtype
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    out.backward(grad)
    want.backward(grad)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    for got, ref, name in zip(fused, eager, ("z", "weight", "bias"), strict=True):
        torch.testing.assert_close(got.grad, ref.grad, rtol=tol, atol=tol, msg=name)


def test_the_function_keeps_its_input_not_fp32_copies():
    """What pays for the Function: for a bf16 input it keeps the input and [tokens, 3] fp32 values, where
    autograd of the expression keeps several fp32 tensors of the input's size."""
    z, w, b = _inputs(torch.bfloat16, shape=(64, 2, 256))
    tokens, features = 64 * 2, 256

    def kept(fn) -> int:
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(z, w, b)
        return sum(storages.values())

    fused, eager = kept(poly_norm), kept(poly_norm_eager)
    assert fused == 2 * tokens * features + 4 * 3 * tokens + 8 * 3  # input, reciprocal RMS, the weights
    assert eager > 6 * 4 * tokens * features  # seven fp32 copies (measured)


def _tp_worker(rank: int, world: int, port: int, fn_name: str, folder: str) -> None:
    """One TP rank: its share of F, the sums over the gloo group; sends back its output and gradients."""
    import diffmeg.fusions.poly_norm as module

    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=world, rank=rank
    )
    z, w, b = _inputs(torch.float64, shape=(4, 2, 12))
    shard = z.detach().chunk(world, dim=-1)[rank].clone().requires_grad_()
    w, b = (t.detach().clone().requires_grad_() for t in (w, b))
    out = getattr(module, fn_name)(shard, w, b, 1e-6, 12, torch.distributed.group.WORLD)
    gen = torch.Generator().manual_seed(4)
    grad = torch.randn(out.shape[:-1] + (12,), generator=gen, dtype=torch.float64)
    out.backward(grad.chunk(world, dim=-1)[rank])
    torch.save((rank, out.detach(), shard.grad, w.grad, b.grad), f"{folder}/rank{rank}.pt")
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("fn_name", ["poly_norm", "poly_norm_eager"])
def test_the_means_span_the_whole_ffn_dimension_under_tensor_parallelism(tmp_path, fn_name):
    """F split over 3 gloo ranks: each rank's output is its slice of the whole PolyNorm, its input gradient
    the whole one's slice, and the weights' gradients summed over the ranks the whole one's."""
    import torch.multiprocessing as mp

    from tests.conftest import free_port

    world = 3
    mp.start_processes(
        _tp_worker, args=(world, free_port(), fn_name, str(tmp_path)), nprocs=world, start_method="spawn"
    )
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    z, w, b = _inputs(torch.float64, shape=(4, 2, 12))
    ref = _definition(z, w, b)
    ref.backward(torch.randn(ref.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64))
    torch.testing.assert_close(torch.cat([r[1] for r in got], dim=-1), ref.detach(), rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(torch.cat([r[2] for r in got], dim=-1), z.grad, rtol=1e-11, atol=1e-12)
    torch.testing.assert_close(sum(r[3] for r in got), w.grad, rtol=1e-11, atol=1e-12)
    torch.testing.assert_close(sum(r[4] for r in got), b.grad, rtol=1e-11, atol=1e-12)
