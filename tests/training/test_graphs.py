"""The whole-layer graph options (diffmeg.training.graphs): compiled layers against eager ones, their graph
breaks counted, and the flags of compiled layers, local CUDA graphs and the SDPA kernel preference (their
plumbing into the run and model configs, and their one-line refusals)."""

from __future__ import annotations

import pytest
import torch

from diffmeg.errors import DiffmegError
from diffmeg.run_config import RunConfig
from diffmeg.training import graphs
from diffmeg.training.arguments import resolve_args
from tests.builders import tiny_config

ARCHS = {"diff": {}, "diff2": {"diff_version": 2}, "transformer": {"diff_attention": False}}


@pytest.fixture
def dynamo_on(monkeypatch):
    """TorchDynamo on for this test (conftest and diffmeg.runtime.setup turn it off on CPU)."""
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "0")
    torch._dynamo.reset()
    with torch._dynamo.config.patch(disable=False):
        yield
    torch._dynamo.reset()


def _model(arch: str):
    """A 2-layer fp32 model of hidden 64 (DIFF V1: 2 heads of 16; V2 and the baseline: 4 heads of 16)."""
    from diffmeg.model import build_model

    heads = 2 if arch == "diff" else 4
    cfg = tiny_config(heads, heads, 16, layers=2, ffn=128, **ARCHS[arch])
    return build_model(cfg, vocab_size=64, max_sequence_length=16, rotary_base=500.0, seed=3)


def _loss_and_grads(model) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(16).expand(2, 16)
    loss = model(input_ids=tokens, position_ids=positions, attention_mask=None, labels=tokens).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_a_compiled_layer_is_one_graph_without_breaks(single_rank_parallel_state, dynamo_on, arch):
    """torch._dynamo.explain of one layer as compile_layers leaves it: one graph, no break (megatron-core's
    RowParallelLinear warns every forward on rank 0, two breaks a layer, without the workaround)."""
    layer = graphs.transformer_layers([_model(arch)])[0]
    for linear in layer.modules():
        if isinstance(linear, graphs.RowParallelLinear):
            graphs._pass_own_tp_group(linear)
    hidden = layer.config.hidden_size
    x = torch.randn(16, 2, hidden, requires_grad=True)  # [s, b, h]
    rotary = _rotary(layer, 16)
    explained = torch._dynamo.explain(layer)(x, attention_mask=None, rotary_pos_emb=rotary)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def _rotary(layer, seq: int) -> torch.Tensor:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    return RotaryEmbedding(layer.config.kv_channels, rotary_percent=1.0, rotary_base=500.0)(seq)


@pytest.mark.parametrize("arch", ARCHS)
def test_compiled_layers_give_the_eager_loss_and_gradients(single_rank_parallel_state, dynamo_on, arch):
    """compile_layers on a built model: every layer compiled, names kept, and the loss and every gradient
    those of the same model eager (fp32 tolerance). aot_eager: the graphs and their autograd as inductor
    gets them, without its code generation (~56 s of C++ for 2 layers on 2 CPU cores); inductor's own
    kernels run in tests/test_gpu_readiness.py's CUDA test of --compile-layers."""
    backend = "aot_eager"
    eager, compiled = _model(arch), _model(arch)
    names = list(compiled.state_dict())
    assert graphs.compile_layers([compiled], backend=backend) == 2
    assert list(compiled.state_dict()) == names  # checkpoints and DDP see the same parameters
    assert all(layer._compiled_call_impl is not None for layer in graphs.transformer_layers([compiled]))
    assert torch._dynamo.config.recompile_limit >= 2 * 2 + graphs.RECOMPILE_HEADROOM
    from torch._dynamo.utils import counters

    got_loss, got = _loss_and_grads(compiled)
    assert counters["stats"]["unique_graphs"] >= 1  # compiled, not silently eager
    want_loss, want = _loss_and_grads(eager)
    torch.testing.assert_close(got_loss, want_loss)
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, msg=name)


def _run(argv: list[str]) -> RunConfig:
    return RunConfig.from_args(resolve_args(["--model", "diff-tiny", "--mock-data", *argv], world_size=1))


def test_graph_flags_default_off_and_reach_the_configs(monkeypatch):
    from diffmeg.model import transformer_config

    run = _run([])
    assert (run.training.compile_layers, run.training.cuda_graph_impl, run.model.sdpa_backend) == (
        False,
        "none",
        "auto",
    )
    monkeypatch.setattr(graphs, "cuda_graphs_unsupported_reason", lambda: None)  # as on a GPU
    run = _run(["--cuda-graph-impl", "local", "--sdpa-backend", "math"])
    assert run.to_args().cuda_graph_impl == "local" and run.to_args().sdpa_backend == "math"  # args.json
    config = transformer_config(run)
    assert (config.cuda_graph_impl, config.cuda_graph_scope, config.sdpa_backend) == ("local", [], "math")
    assert _run(["--compile-layers"]).training.compile_layers


def test_old_checkpoints_and_single_rank_readers_run_without_the_graph_options():
    from diffmeg.checkpoints import single_rank_args, upgrade_saved_args

    old = upgrade_saved_args({"num_layers": 2})
    assert (old.sdpa_backend, old.compile_layers, old.cuda_graph_impl) == ("auto", False, "none")
    saved = resolve_args(["--model", "diff-tiny", "--mock-data", "--sdpa-backend", "math"], world_size=1)
    saved.cuda_graph_impl = "local"  # as written by a GPU run
    reader = single_rank_args(saved)
    assert (reader.sdpa_backend, reader.cuda_graph_impl) == ("auto", "none")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusals")
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--cuda-graph-impl", "local"], "--cuda-graph-impl local: CUDA graphs need a GPU"),
        (["--sdpa-backend", "cudnn"], "--sdpa-backend cudnn: the cudnn SDPA kernel needs CUDA"),
        (["--sdpa-backend", "flash"], "--sdpa-backend flash: the flash SDPA kernel needs CUDA"),
    ],
)
def test_gpu_options_are_refused_on_cpu_in_one_line(argv, message):
    with pytest.raises(DiffmegError, match=message) as err:
        _run(argv)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--recompute-granularity", "full"], "cannot capture fully recomputed layers"),
        (["--compile-layers"], "--cuda-graph-impl local and --compile-layers both take over"),
    ],
)
def test_cuda_graphs_refuse_what_they_cannot_capture(monkeypatch, argv, message):
    monkeypatch.setattr(graphs, "cuda_graphs_unsupported_reason", lambda: None)  # as on a GPU
    with pytest.raises(DiffmegError, match=message):
        _run(["--cuda-graph-impl", "local", *argv])
    _run(["--cuda-graph-impl", "local", "--recompute-granularity", "selective"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU note")
def test_flags_that_change_nothing_here_say_so():
    notes = resolve_args(
        ["--model", "diff-tiny", "--mock-data", "--compile-layers"], world_size=1
    ).dropped_flags
    assert any(n.startswith("--compile-layers has no effect: diffmeg disables torch.compile") for n in notes)
    argv = [
        "--model",
        "diff-tiny",
        "--mock-data",
        "--sdpa-backend",
        "math",
        "--diff-attn-backend",
        "reference",
    ]
    notes = resolve_args(argv, world_size=1).dropped_flags
    assert any(
        "--sdpa-backend math has no effect: DIFF V1's attention backend is reference" in n for n in notes
    )
    for model in ("diff-tiny", "transformer-tiny", "diff2-tiny"):
        argv = ["--model", model, "--mock-data", "--sdpa-backend", "math"]
        assert not any("--sdpa-backend" in n for n in resolve_args(argv, world_size=1).dropped_flags)
