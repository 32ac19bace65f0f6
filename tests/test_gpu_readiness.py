"""Issue 17's CUDA paths, end to end on a GPU (skipped without one; CPU tests emulate each where they can).

- initialisation is device-independent: a model built on the GPU has the weights of the CPU-built one;
- the attention backend is resolved from the tensors at call time: a core built on the CPU and moved to
  the GPU runs SDPA's GPU path;
- seeded sampling draws on the logits' device;
- the Transformer baseline's local spec runs in bf16 on a GPU without the fused-softmax extension, and
  DIFF with each backend gives the same loss;
- training steps as the campaign's train phase takes them (issue 24): bf16, SDPA, megatron-core's
  fused SwiGLU compiled by TorchDynamo, the distributed optimizer with overlapped gradient reduction, on
  an NCCL process group, for the Transformer and DIFF: the loss falls.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _tiny_config(on_gpu: bool):
    """A 2-layer DIFF config (float64) built on the GPU, or on the CPU (use_cpu_initialization)."""
    from tests.builders import make_config

    cfg = make_config(heads=2, kv_heads=1, head_dim=16, layers=2)
    cfg.use_cpu_initialization = not on_gpu
    return cfg


def test_gpu_built_model_has_the_cpu_built_weights(single_rank_parallel_state):
    from diffmeg.model import build_model

    on_cpu = build_model(_tiny_config(on_gpu=False), vocab_size=64, max_sequence_length=32)
    on_gpu = build_model(_tiny_config(on_gpu=True), vocab_size=64, max_sequence_length=32)
    gpu_state = on_gpu.state_dict()
    checked = 0
    for name, value in on_cpu.state_dict().items():
        if torch.is_tensor(value) and value.is_floating_point() and name in gpu_state:
            assert gpu_state[name].is_cuda, name
            assert torch.equal(gpu_state[name].cpu(), value), name
            checked += 1
    assert checked >= 10


def test_core_built_on_cpu_runs_sdpa_on_gpu(single_rank_parallel_state):
    from megatron.core.transformer.enums import AttnMaskType

    from diffmeg.attention import DiffCoreAttention
    from tests.builders import make_config

    cores = {}
    for backend in ("reference", "sdpa"):
        cfg = make_config(2, 1, 16, attention_backend_diff=backend)  # use_cpu_initialization=True
        torch.manual_seed(0)
        cores[backend] = DiffCoreAttention(cfg, 3, AttnMaskType.causal, "self").float().cuda()
    cores["sdpa"].load_state_dict(cores["reference"].state_dict())
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(37, 2, n, 16, generator=gen).cuda() for n in (4, 2, 2))  # [s, b, heads, d]
    out = {name: core(q, k, v, None) for name, core in cores.items()}
    torch.testing.assert_close(out["sdpa"], out["reference"], rtol=1e-4, atol=1e-5)


def test_seeded_sampling_on_gpu_logits(single_rank_parallel_state):
    from diffmeg.generation import SamplingConfig, generate
    from diffmeg.model import build_model

    model = build_model(_tiny_config(on_gpu=True), vocab_size=64, max_sequence_length=32).eval()
    sampling = SamplingConfig(temperature=1.0, seed=5)
    runs = [generate(model, [1, 2, 3], 8, sampling).output_ids for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 8


@pytest.mark.parametrize("preset", ["transformer-tiny", "diff-tiny"])
def test_bf16_local_spec_trains_on_gpu(single_rank_parallel_state, monkeypatch, preset):
    """The baseline's core attention in bf16 at 512 tokens (the fused-softmax path without its extension
    was a ModuleNotFoundError); DIFF's sdpa and reference backends agree on the loss."""
    from diffmeg.model import build_model, transformer_config
    from diffmeg.run_config import RunConfig
    from diffmeg.training.arguments import resolve_args

    backends = ["sdpa", "reference"] if preset.startswith("diff") else [None]
    losses = {}
    for backend in backends:
        argv = ["--model", preset, "--mock-data", "--bf16", "--seq-length", "512", "--vocab-size", "1024"]
        argv += ["--diff-attn-backend", backend] if backend else []
        args = resolve_args(argv, world_size=1)
        config = transformer_config(RunConfig.from_args(args))
        model = build_model(config, vocab_size=1024, max_sequence_length=512, seed=3)
        tokens = torch.randint(0, 1024, (2, 512), generator=torch.Generator().manual_seed(0)).cuda()
        positions = torch.arange(512, device="cuda").expand(2, 512)
        per_token = model(input_ids=tokens, position_ids=positions, attention_mask=None, labels=tokens)
        loss = per_token.float().mean()
        loss.backward()
        assert torch.isfinite(loss)
        assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
        losses[backend] = loss.item()
    if len(losses) == 2:
        assert abs(losses["sdpa"] - losses["reference"]) < 2e-2 * abs(losses["sdpa"]), losses


# One fresh process (its own NCCL group, TorchDynamo on as in the train phase), both models in turn, each
# pretrain_diff.py's Trainer as benchmarks/train_step.py builds it, stepped by its own train_step.
_TRAIN_STEPS = """
import json, sys
import torch
from benchmarks import train_step

train_step.init_process()
flags = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--lr", "1e-3", "--lr-warmup-iters", "0"]
for preset, backend in (("transformer-tiny", None), ("diff-tiny", sys.argv[1])):
    opts = train_step.StepOptions(tokens_per_microbatch=512, microbatches=2, vocab_size=1024,
                                  diff_attn_backend=backend, extra_args=flags)
    trainer = train_step.build_trainer(train_step.resolve_run_args(preset, 256, opts, "cuda"))
    losses, updated = [], []
    for _ in range(4):
        trainer.state.consumed_samples = 0  # the same global batch every step: the loss must fall
        out = trainer.train_step()
        updated.append(out.update_ok)
        losses.append(float(out.loss))
    model = trainer.model  # a list of DDP chunks
    print(json.dumps({
        "preset": preset, "process_group": torch.distributed.get_backend(),
        "attention": train_step.attention_impl(model[0]), "dtype": str(next(model[0].parameters()).dtype),
        "fused_swiglu": trainer.model_config.bias_activation_fusion,
        "dynamo": not torch._dynamo.config.disable,
        "losses": losses, "updated": updated,
    }))
"""


def test_training_steps_as_the_train_phase_takes_them():
    """bf16 steps of the Trainer as benchmarks/train_step.py times them: NCCL, SDPA for DIFF, the compiled
    fused SwiGLU, the distributed optimizer with overlapped gradient reduction; both models' losses fall on
    repeated batches."""
    repo = Path(__file__).resolve().parents[1]
    backend = "sdpa"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env.update(TORCHDYNAMO_DISABLE="0", PYTHONPATH=str(repo))
    proc = subprocess.run(
        [sys.executable, "-c", _TRAIN_STEPS, backend], cwd=repo, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["preset"] for r in runs] == ["transformer-tiny", "diff-tiny"]
    group = "nccl" if torch.distributed.is_nccl_available() else "gloo"
    for r, attention in zip(runs, ("SDPACoreAttention", backend), strict=True):
        assert (r["process_group"], r["attention"], r["dtype"]) == (group, attention, "torch.bfloat16"), r
        assert r["fused_swiglu"] and r["dynamo"] and all(r["updated"]), r
        assert all(torch.isfinite(torch.tensor(r["losses"]))) and r["losses"][-1] < r["losses"][0], r


# One fresh process per option (its own NCCL group, TorchDynamo on): both models, 6 Trainer steps, the
# option's evidence beside the losses (graphs captured; layers compiled; the preference recorded).
_GRAPH_STEPS = """
import json, sys
import torch
from benchmarks import train_step
from diffmeg.training.graphs import transformer_layers

train_step.init_process()
flags = ["--lr", "1e-3", "--lr-warmup-iters", "0", *json.loads(sys.argv[1])]
for preset in ("transformer-tiny", "diff-tiny"):
    opts = train_step.StepOptions(
        tokens_per_microbatch=512, microbatches=2, vocab_size=1024, extra_args=flags
    )
    trainer = train_step.build_trainer(train_step.resolve_run_args(preset, 256, opts, "cuda"))
    losses = []
    for _ in range(6):  # megatron-core's 3 warmup steps, the capture, then replays
        trainer.state.consumed_samples = 0  # the same global batch every step: the loss must fall
        losses.append(float(trainer.train_step().loss))
    layers = transformer_layers(trainer.model)  # through the DDP wrappers
    runners = [r for layer in layers for r in getattr(getattr(layer, "cudagraph_manager", None),
                                                      "cudagraph_runners", [])]
    print(json.dumps({
        "preset": preset, "losses": losses,
        "graphs": sum(bool(r.cudagraph_created) for r in runners),
        "compiled": sum(layer._compiled_call_impl is not None for layer in layers),
        "sdpa_backend": trainer.model_config.sdpa_backend,
    }))
"""


@pytest.mark.parametrize(
    "flags, evidence",
    [
        (["--cuda-graph-impl", "local"], "graphs"),
        (["--compile-layers"], "compiled"),
        (["--sdpa-backend", "cudnn", "--bf16"], "sdpa_backend"),
    ],
)
def test_graph_options_train_a_tiny_model(flags, evidence):
    """Each GPU lever of diffmeg.training.graphs and --sdpa-backend runs pretrain_diff.py's Trainer for a few
    steps on both models: the option took effect and the loss falls on repeated batches."""
    repo = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env.update(TORCHDYNAMO_DISABLE="0", PYTHONPATH=str(repo))
    proc = subprocess.run(
        [sys.executable, "-c", _GRAPH_STEPS, json.dumps(flags)], cwd=repo, env=env, capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["preset"] for r in runs] == ["transformer-tiny", "diff-tiny"]
    for r in runs:
        assert r[evidence] not in (0, "auto"), r
        assert all(torch.isfinite(torch.tensor(r["losses"]))) and r["losses"][-1] < r["losses"][0], r
