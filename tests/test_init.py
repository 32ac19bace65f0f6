"""diffmeg.init: every parameter is the CPU generator's draw for (seed, global name), on any device."""

from __future__ import annotations

import hashlib
import math

import torch

from diffmeg import init


def _expected(seed: int, name: str, shape, std: float) -> torch.Tensor:
    """The rule written out: sha256("seed:name") -> a CPU Mersenne-Twister stream -> N(0, std^2) in fp32."""
    key = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)
    gen = torch.Generator().manual_seed(key)
    return torch.empty(tuple(shape), dtype=torch.float32).normal_(0.0, std, generator=gen)


def test_model_weights_are_the_cpu_draw(single_rank_parallel_state):
    from diffmeg.model import build_model
    from tests.builders import make_config

    cfg = make_config(heads=2, kv_heads=1, head_dim=8, layers=2)  # float64 weights hold fp32 draws exactly
    model = build_model(cfg, vocab_size=64, max_sequence_length=16, seed=11)
    names = init.global_parameter_names(model)
    scaled = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
    checked = 0
    for local, param in model.named_parameters():
        name = names[local]
        kind = init._init_kind(name)
        if kind == "ones":
            assert torch.equal(param, torch.ones_like(param)), name
            continue
        std = {"lambda": cfg.lambda_std, "scaled_normal": scaled, "normal": cfg.init_method_std}[kind]
        assert torch.equal(param.detach(), _expected(11, name, param.shape, std).to(param.dtype)), name
        checked += 1
    assert checked >= 10


def test_parameters_on_another_device_get_the_same_cpu_draw(single_rank_parallel_state, monkeypatch):
    """Weights living off the CPU (meta stands in for CUDA, which has no Mersenne Twister) are filled from
    CPU generators only; drawing on the parameter's device would give a GPU run other weights."""
    from types import SimpleNamespace

    real = torch.Generator
    devices: list[torch.device] = []

    def recording_generator(device="cpu"):
        devices.append(torch.device(device))
        return real(device=device)

    model = torch.nn.Module()
    model.output_layer = torch.nn.Linear(4, 6, bias=False, device="meta")
    cfg = SimpleNamespace(
        init_method_std=0.02, num_layers=2, lambda_std=0.1, embedding_init_method_std=None,
        gated_linear_unit=True,
    )  # fmt: skip
    monkeypatch.setattr(init.torch, "Generator", recording_generator)
    init.initialize_parameters(model, cfg, seed=5)
    assert devices == [torch.device("cpu")]
    assert torch.equal(init.draw_normal((6, 4), 0.02, init._param_seed(5, "output_layer.weight")),
                       _expected(5, "output_layer.weight", (6, 4), 0.02))  # fmt: skip


def test_a_tied_last_stage_copy_is_the_embeddings_draw(single_rank_parallel_state):
    """Tied weights: the output layer of a last pipeline stage without the embedding (megatron-core's copy,
    summed with the first stage's gradients every step) starts as the first stage's embedding, bit for bit;
    one stage holding both has no output-layer weight at all."""
    from diffmeg.model import build_model
    from tests.builders import make_config

    cfg = make_config(heads=2, kv_heads=1, head_dim=8, layers=2, share_embeddings_and_output_weights=True)
    whole = build_model(cfg, vocab_size=64, max_sequence_length=16, seed=11)
    last = build_model(cfg, vocab_size=64, max_sequence_length=16, seed=11, pre_process=False)
    assert whole.output_layer.weight is None and not hasattr(last, "embedding")
    assert init.global_parameter_names(last)["output_layer.weight"] == "embedding.word_embeddings.weight"
    assert torch.equal(last.output_layer.weight, whole.embedding.word_embeddings.weight)
