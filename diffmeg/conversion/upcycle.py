"""Function-preserving upcycling of a Transformer into DIFF V2 (pure functions on one layer's tensors).

A Transformer with h query heads over g KV heads of width d becomes a DIFF V2 model with h output heads:
2h query heads over the same g KV heads (DESIGN.md "Upcycling a Transformer into DIFF V2"):

- query head i is copied into query heads 2i and 2i+1. Both sit in the Transformer head's KV group: V2's
  query head j uses KV head j // (2h/g), and (2i) // (2h/g) = (2i+1) // (2h/g) = i // (h/g);
- `linear_lambda` (lambda_proj) is zero, so lambda = sigmoid(0) = 0.5 for every token and head, and head
  i's output is attn_i - 0.5 attn_i = 0.5 attn_i (exact in floating point: a - a/2 is exact);
- `linear_proj` (o_proj) is doubled (exact: a power of two), which undoes the 0.5;
- every other tensor (embedding, norms, keys, values, MLP, output layer) is copied; a tied source gives a
  tied model (its output layer is the embedding, in both).

The upcycled model's logits therefore equal the source's. Training separates the copies: the gradient
of head 2i's query is g, that of 2i+1 is -0.5 g. (DIFF V1 cannot do this: its V is 2d wide and its
head RMSNorm has no identity setting.) Nor can grouped differential attention with r = h / n > 1 signal
heads per noise head: a bias-free sigmoid lambda is never 0, so each signal head keeps lambda times its
group's noise map, which cancels into the head only when it is the head's own copy (r = 1), and r signal
heads cannot all equal their one noise head. Such a start would be a warm start, not the source's function,
so it is refused (`upcycle_io.refuse_grouped_target`); the target is always the 1:1 DIFF V2, over whatever
KV grouping the source has.

In megatron-core's fused QKV (TP=1 state dict) a Transformer group t holds [r query heads, key, value]
of d rows each (r = h / g); the V2 group t holds [2r query heads, key, value], its query heads 2k and
2k+1 both the Transformer's query head k of that group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping

import torch

from diffmeg.conversion.layout import Diff2Layout, LlamaLayout
from diffmeg.conversion.mapping import MCORE_LAYER_PREFIX, check_shapes
from diffmeg.conversion.mcore_writer import part_of
from diffmeg.errors import DiffmegError

QKV = "self_attention.linear_qkv.weight"
PROJ = "self_attention.linear_proj.weight"
LAMBDA = "self_attention.linear_lambda.weight"


def diff2_layout(source: LlamaLayout) -> Diff2Layout:
    """The DIFF V2 layout an upcycled `source` gets: h output heads = the source's heads, the same KV heads,
    head dim, widths, vocabulary, positions, RoPE base, epsilon and tied or untied output layer."""
    if not isinstance(source, LlamaLayout):
        raise DiffmegError(
            f"upcycling starts from a Transformer (Llama layout), not a {source.hf_name} model"
        )
    return Diff2Layout(**dataclasses.asdict(source))  # every field of the shared ModelLayout


def upcycle_qkv(qkv: torch.Tensor, source: LlamaLayout) -> torch.Tensor:
    """The Transformer's fused QKV [g (r + 2) d, H] -> DIFF V2's [g (2r + 2) d, H], each query head twice."""
    g, d, r = source.num_kv_heads, source.head_dim, source.queries_per_group
    hidden = qkv.shape[-1]
    groups = qkv.view(g, r + 2, d, hidden)  # [g (r + 2) d, H] -> [g, r + 2, d, H]
    queries = groups[:, :r].repeat_interleave(2, dim=1)  # [g, r, d, H] -> [g, 2r, d, H]: k, k, k+1, k+1, ...
    return torch.cat([queries, groups[:, r:]], dim=1).reshape(g * (2 * r + 2) * d, hidden)


def upcycle_layer(layer: Mapping[str, torch.Tensor], source: LlamaLayout) -> dict[str, torch.Tensor]:
    """One Transformer layer (TP=1 megatron-core keys inside `decoder.layers.N.`) -> the DIFF V2 layer, in
    the source's dtype: QKV with each query head twice, `linear_proj` doubled, `linear_lambda` zero."""
    check_shapes(layer, source.mcore_layer_shapes(), "Transformer layer")
    target = diff2_layout(source)
    out = {key: value for key, value in layer.items() if key not in (QKV, PROJ)}
    out[QKV] = upcycle_qkv(layer[QKV], source)
    out[PROJ] = layer[PROJ] * 2  # exact: a power of two
    out[LAMBDA] = torch.zeros(target.mcore_layer_shapes()[LAMBDA], dtype=layer[PROJ].dtype)
    check_shapes(out, target.mcore_layer_shapes(), "upcycled DIFF V2 layer")
    return out


def upcycle_blocks(
    blocks: Iterator[dict[str, torch.Tensor]], source: LlamaLayout
) -> Iterator[dict[str, torch.Tensor]]:
    """A Transformer's TP=1 state dict, block by block (a streaming reader gives one layer, or one tensor
    outside the layers, per block) -> the upcycled DIFF V2 model's, block by block: layers are upcycled,
    everything else passes unchanged."""
    for block in blocks:
        layers: dict[int, dict[str, torch.Tensor]] = {}
        out = {}
        for name, tensor in block.items():
            part = part_of(name)
            if isinstance(part, int):
                layers.setdefault(part, {})[name[len(MCORE_LAYER_PREFIX.format(part)) :]] = tensor
            else:
                out[name] = tensor
        block.clear()  # the caller's block is not kept alive beside the upcycled one
        for index, layer in layers.items():
            prefix = MCORE_LAYER_PREFIX.format(index)
            out.update({prefix + k: v for k, v in upcycle_layer(layer, source).items()})
        yield out
