"""diffmeg.generation on devices other than the CPU, emulated: the sampling generator follows the logits."""

from __future__ import annotations

import torch

from diffmeg import generation
from diffmeg.generation import SamplingConfig, generate


class _FakeGenerator:
    """Records the device it was made for (CPU-only torch cannot make a CUDA generator)."""

    def __init__(self, device="cpu") -> None:
        self.device = torch.device(device)

    def manual_seed(self, seed: int) -> _FakeGenerator:
        self.seed = seed
        return self


class _MetaLogitsModel(torch.nn.Module):
    """Weights on the CPU, logits on another device (meta stands in for CUDA)."""

    vocab_size = 11

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, position_ids, attention_mask, **kwargs):
        return torch.zeros(1, input_ids.shape[1], self.vocab_size, device="meta")


def test_seeded_sampling_draws_on_the_logits_device(monkeypatch):
    import megatron.core.inference.contexts  # noqa: F401  (imported before torch.Generator is replaced)

    made: list[_FakeGenerator] = []

    def fake_generator(*args, **kwargs):
        g = _FakeGenerator(*args, **kwargs)
        made.append(g)
        return g

    def multinomial(probs, num_samples, generator=None):
        # What CUDA does: a generator of another device type is refused.
        assert generator is not None and generator.device == probs.device, (generator.device, probs.device)
        return torch.tensor([3])

    monkeypatch.setattr(generation.torch, "Generator", fake_generator)
    monkeypatch.setattr(generation.torch, "multinomial", multinomial)
    result = generate(_MetaLogitsModel(), [1, 2], 3, SamplingConfig(seed=7), use_cache=False)
    assert result.output_ids == [3, 3, 3]
    assert len(made) == 1 and made[0].device == torch.device("meta") and made[0].seed == 7


def test_sampling_generator_is_seeded_on_cpu():
    a = torch.rand(5, generator=generation.sampling_generator(3, torch.device("cpu")))
    b = torch.rand(5, generator=generation.sampling_generator(3, torch.device("cpu")))
    assert torch.equal(a, b)
