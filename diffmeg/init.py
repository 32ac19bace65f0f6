"""Parameter initialisation that does not depend on the parallel layout.

megatron-core initialises each pipeline stage's layers from a shared RNG stream, so PP=2 and PP=1 runs
start from different weights. Here every parameter is drawn from its own generator, seeded from the run
seed and the parameter's *global* name (layer index from megatron-core's global `layer_number`); a
tensor-parallel shard is cut from the full tensor. Any TP/PP/DP layout therefore starts from the same
model, which is what makes single-rank parity tests meaningful from a fresh start. The numbers are drawn
on the CPU and copied to the parameter's device, so CPU and GPU runs of one seed start identically too.

Tied embedding and output weights (`share_embeddings_and_output_weights`): with one pipeline stage the
output layer has no weight of its own; with several, megatron-core keeps a copy of the embedding on the
last stage (zero-filled, then all-reduced from the first stage when the model is built) and sums the two
copies' gradients in `finalize_model_grads`. That copy is drawn here under the embedding's own global
name, so both stages hold the embedding's exact values without any communication, as one rank does.
"""

from __future__ import annotations

import hashlib
import math

import torch
from megatron.core import parallel_state
from megatron.core.transformer.transformer_layer import TransformerLayer

from diffmeg.config import DiffTransformerConfig
from diffmeg.errors import DiffmegError

_OUTPUT_SCALED = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
_LAMBDA = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")


def _param_seed(seed: int, global_name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{global_name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


_EMBEDDING = "embedding.word_embeddings.weight"
_OUTPUT = "output_layer.weight"


def global_parameter_names(model: torch.nn.Module) -> dict[str, str]:
    """Map each local parameter name to a name that is the same under every PP layout (a tied output
    layer's copy of the embedding on the last pipeline stage is the embedding)."""
    tied = bool(getattr(model, "share_embeddings_and_output_weights", False))
    layer_prefix: dict[str, int] = {}
    for name, module in model.named_modules():
        if isinstance(module, TransformerLayer):
            layer_prefix[name + "."] = module.layer_number - 1  # global, 0-based
    names = {}
    for name, _ in model.named_parameters():
        for prefix, index in layer_prefix.items():
            if name.startswith(prefix):
                names[name] = f"layers.{index}.{name[len(prefix) :]}"
                break
        else:
            names[name] = _EMBEDDING if tied and name == _OUTPUT else name
    return names


def _init_kind(name: str) -> str:
    leaf = name.rsplit(".", 1)[-1]
    if leaf in _LAMBDA:
        return "lambda"
    if ".poly_norm." in name:  # Motif's PolyNorm: weights 1/3, bias 0
        return "third" if leaf == "weight" else "zeros"
    if "norm" in name and leaf in ("weight", "layer_norm_weight"):
        return "ones"
    if name.endswith(_OUTPUT_SCALED):
        return "scaled_normal"
    if leaf == "weight":
        return "normal"
    raise DiffmegError(f"no initialisation rule for parameter {name!r}; add one in diffmeg/init.py")


def draw_normal(shape: tuple[int, ...], std: float, seed: int) -> torch.Tensor:
    """N(0, std^2) in fp32 from a CPU generator, whatever device the parameter lives on.

    CUDA's generator (Philox) and the CPU's (Mersenne Twister) give different numbers for one seed; drawing
    on the CPU and copying makes a GPU run start from exactly the weights of a CPU run.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.empty(shape, dtype=torch.float32, device="cpu").normal_(0.0, std, generator=gen)


@torch.no_grad()
def initialize_parameters(model: torch.nn.Module, config: DiffTransformerConfig, seed: int) -> None:
    """Fill every parameter of `model` (one PP stage, one TP shard) from (seed, global name)."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    scaled_std = config.init_method_std / math.sqrt(2.0 * config.num_layers)
    names = global_parameter_names(model)
    for local_name, param in model.named_parameters():
        name = names[local_name]
        kind = _init_kind(name)
        if kind in ("ones", "third", "zeros"):
            param.fill_({"ones": 1.0, "third": 1.0 / 3.0, "zeros": 0.0}[kind])
            continue
        std = {"lambda": config.lambda_std, "scaled_normal": scaled_std, "normal": config.init_method_std}[
            kind
        ]
        if kind == "normal" and "word_embeddings" in name and config.embedding_init_method_std is not None:
            std = config.embedding_init_method_std
        seed_ = _param_seed(seed, name)
        sharded = getattr(param, "tensor_model_parallel", False) and tp > 1
        if not sharded:
            param.copy_(draw_normal(tuple(param.shape), std, seed_))
            continue
        dim = param.partition_dim
        full_shape = list(param.shape)
        full_shape[dim] *= tp
        if name.endswith("mlp.linear_fc1.weight") and config.gated_linear_unit:
            # SwiGLU fc1 holds [gate; up] per rank: shard gate and up separately, as the TP=1 layout is.
            full = draw_normal(tuple(full_shape), std, seed_)  # [2F, H] = [gate; up]
            gate, up = full.chunk(2, dim=0)
            param.copy_(torch.cat([gate.chunk(tp, dim=0)[tp_rank], up.chunk(tp, dim=0)[tp_rank]], dim=0))
        else:
            full = draw_normal(tuple(full_shape), std, seed_)
            param.copy_(full.chunk(tp, dim=dim)[tp_rank])
