"""megatron-core's MLP with PolyNorm as its gated activation: Motif's `down(PolyNorm(gate(x)) * up(x))`.

megatron-core's gated MLP applies `config.activation_func` (a plain function, SwiGLU's silu) to the gate
half of `linear_fc1`'s output; PolyNorm has parameters (`diffmeg.fusions.poly_norm.PolyNorm`) and, under
tensor parallelism, takes its means over the whole FFN dimension across the TP ranks. So this subclass
keeps megatron-core's `linear_fc1` ([gate; up] per rank, column-parallel) and `linear_fc2`, and applies
its own `poly_norm` module between them. The config's `mlp_activation` chooses it (`layer_specs`).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.mlp import MLP

from diffmeg.errors import DiffmegError
from diffmeg.fusions.poly_norm import PolyNorm


class PolyNormMLP(MLP):
    """The gated MLP with PolyNorm on the gate: `linear_fc2(PolyNorm(gate) * up)`."""

    def __init__(self, config, submodules, is_expert: bool = False, **kwargs) -> None:
        if not config.gated_linear_unit or config.add_bias_linear:
            raise DiffmegError("the PolyNorm MLP is gated and bias-free, as Motif's (gated_linear_unit)")
        super().__init__(config, submodules, is_expert=is_expert, **kwargs)
        device = "cpu" if config.use_cpu_initialization or not torch.cuda.is_available() else "cuda"
        group = self.tp_group if self.tp_group is not None and self.tp_group.size() > 1 else None
        self.poly_norm = PolyNorm(config.ffn_hidden_size, group=group, device=device)

    def forward(self, hidden_states: torch.Tensor, per_token_scale=None, **kwargs):
        if per_token_scale is not None:
            raise DiffmegError("the PolyNorm MLP has no per-token scale (it is not a mixture-of-experts MLP)")
        intermediate, _ = self.linear_fc1(hidden_states)  # [s, b, 2F / tp] = this rank's [gate; up]
        gate, up = torch.chunk(intermediate, 2, dim=-1)  # [s, b, F / tp] each
        output, output_bias = self.linear_fc2(self.poly_norm(gate) * up)  # [s, b, hidden]
        return output, output_bias
