"""Tensor mapping between TP=1 megatron-core state dicts and Hugging Face ones (pure functions).

DIFF <-> DiffLlama (`DiffLayout`) and the Transformer baseline <-> Llama (`LlamaLayout`) share everything
outside attention: embedding, norms, SwiGLU MLP (`linear_fc1` = [gate; up]), output layer. Only the fused
QKV and, for DIFF, the lambda vectors and head norm differ.

Transformer baseline (n heads, g query groups, head dim d, r = n / g): megatron-core's fused QKV rows
are, per query group t, [r query heads, 1 key, 1 value] of d rows each, query heads numbered across
groups (head t * r + i). Llama's `repeat_kv` sends query head m to KV head m // r, so q_proj is the
query heads in that order, k_proj / v_proj the groups' keys / values: a plain de-interleave.

DIFF head layouts (h differential heads, g differential KV heads, head dim d, r = h / g):

- megatron-core fused QKV rows, per query sub-group t = 0..2g-1: [r query sub-heads, 1 key, 1 value],
  each d rows. Query sub-heads are numbered across groups (m = t * r + i); sub-heads 2i / 2i+1 are
  Q1 / Q2 of differential head i. Sub-groups 2j / 2j+1 hold K1 / K2 of differential KV head j and the
  first / second d-wide half of its 2d-wide V.
- DiffLlama (transformers' `DiffLlamaAttention`): 2h query heads and 2g KV heads of width d. It pairs
  query head i with head i + h (Q1 / Q2 of differential head i), key head j with j + g (K1 / K2), and
  concatenates value heads j and j + g into the 2d-wide V of KV head j.

So one permutation serves Q, K and V alike: even sub-heads first, then odd ones.

DIFF V2 (h heads, g KV heads, n noise heads): megatron-core's fused QKV is the Transformer baseline's with
h + n query heads (query head j = row block j of q_proj, the definition's order: group by group `[signal x r,
noise]`, so the 1:1 model's heads 2i/2i+1 stay adjacent and a grouped model's r + 1 heads of a group stay
in one KV group), and `linear_lambda` is `lambda_proj` as it is. DiffLlama's head
RMSNorm has no weight; ours is folded into `o_proj`'s input columns (the norm output of head i is
columns [2d i, 2d (i+1)) of `o_proj`), which is exact because only a linear map follows it. Importing
back gives a head-norm weight of ones.

Motif (`MotifLayout`, Motif Technologies' format): DIFF V1 whose sub-heads Motif stores in our order
(2.6B: query / key sub-heads 2i, 2i+1 the pairs, V of 2d per KV head; 12.7B: query heads `[signal x r,
noise]` per group, K1/K2 and the V halves 2j/2j+1), so its fused QKV is the projections dealt over the 2g
K/V sub-groups; `subln` is our head norm (weight kept), `mlp.act_fn` our PolyNorm; an export writes the
lambda vectors in fp32 (or wider) whatever its dtype, as Motif's checkpoints hold them.

Every function takes and returns plain tensors of one layer (or of the embedding / final norm / output
layer), so a converter streams a model layer by layer and never holds two full copies.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from diffmeg.config import query_heads_per_subgroup
from diffmeg.conversion.layout import GLOBALS, Diff2Layout, DiffLayout, LlamaLayout, ModelLayout, MotifLayout
from diffmeg.errors import DiffmegError

MCORE_LAYER_PREFIX = "decoder.layers.{}."
HF_LAYER_PREFIX = "model.layers.{}."

# Keys identical up to their prefix in both formats (norms, SwiGLU down projection; DIFF: lambda vectors).
_SAME_IN_LAYER = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_DIFF_SAME_IN_LAYER = {
    f"self_attention.core_attention.lambda_{n}": f"self_attn.lambda_{n}" for n in ("q1", "k1", "q2", "k2")
}


def check_shapes(
    tensors: Mapping[str, torch.Tensor | tuple[int, ...]], expected: Mapping[str, tuple[int, ...]], where: str
) -> None:
    """Raise a one-line DiffmegError for the first missing tensor or shape mismatch."""
    for key, shape in expected.items():
        if key not in tensors:
            raise DiffmegError(f"{where}: tensor {key!r} is missing")
        got = tensors[key]
        got_shape = tuple(got.shape) if isinstance(got, torch.Tensor) else tuple(got)
        if got_shape != tuple(shape):
            raise DiffmegError(
                f"{where}: shape mismatch for {key!r}: found {list(got_shape)}, the model config implies "
                f"{list(shape)}"
            )


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """`t` in `dtype` (None: its own), contiguous; no copy when it already is (converters stream, and a
    copy of the embedding is a second gigabyte)."""
    return (t if dtype is None else t.to(dtype)).contiguous()


def split_fused_qkv(qkv: torch.Tensor, layout: DiffLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """megatron-core fused QKV -> DiffLlama (q_proj, k_proj, v_proj) weights."""
    h, g, d, r = layout.num_heads, layout.num_kv_heads, layout.head_dim, layout.queries_per_group
    hidden = qkv.shape[-1]
    groups = qkv.view(2 * g, r + 2, d, hidden)  # [2g * (r + 2) * d, H] -> [2g, r + 2, d, H]
    q_sub = groups[:, :r].reshape(2 * h, d, hidden)  # query sub-heads in megatron order m = t * r + i
    k_sub, v_sub = groups[:, r], groups[:, r + 1]  # [2g, d, H] each
    # Even sub-heads (Q1 / K1 / first V half) first, then odd ones: [2n, d, H] -> [2n * d, H]
    q = torch.cat([q_sub[0::2], q_sub[1::2]]).reshape(2 * h * d, hidden)
    k = torch.cat([k_sub[0::2], k_sub[1::2]]).reshape(2 * g * d, hidden)
    v = torch.cat([v_sub[0::2], v_sub[1::2]]).reshape(2 * g * d, hidden)
    return q, k, v


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: DiffLayout) -> torch.Tensor:
    """DiffLlama (q_proj, k_proj, v_proj) weights -> megatron-core fused QKV (inverse of split_fused_qkv)."""
    h, g, d, r = layout.num_heads, layout.num_kv_heads, layout.head_dim, layout.queries_per_group
    hidden = q.shape[-1]

    def interleave(w: torch.Tensor, n: int) -> torch.Tensor:
        # [2n * d, H] = [first halves; second halves] -> [2n, d, H] with halves alternating
        halves = w.view(2, n, d, hidden)
        return halves.transpose(0, 1).reshape(2 * n, d, hidden)

    q_sub = interleave(q, h).view(2 * g, r, d, hidden)  # [2h, d, H] -> [2g, r, d, H]
    k_sub = interleave(k, g).unsqueeze(1)  # [2g, 1, d, H]
    v_sub = interleave(v, g).unsqueeze(1)
    return torch.cat([q_sub, k_sub, v_sub], dim=1).reshape(layout.qkv_rows, hidden)


def fold_head_norm(linear_proj: torch.Tensor, head_norm: torch.Tensor, layout: DiffLayout) -> torch.Tensor:
    """o_proj = linear_proj with head i's input columns scaled by the (shared) head-norm weight.

    Computed in fp32 (or wider), rounded once to linear_proj's dtype.
    """
    wide = torch.promote_types(linear_proj.dtype, torch.float32)
    scale = head_norm.to(wide).repeat(layout.num_heads)  # [2d] -> [h * 2d], one copy per head
    return (linear_proj.to(wide) * scale).to(linear_proj.dtype)


def split_fused_qkv_llama(
    qkv: torch.Tensor, layout: LlamaLayout | Diff2Layout
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """megatron-core fused QKV of the Transformer baseline (or DIFF V2) -> (q_proj, k_proj, v_proj)."""
    g, d, r = layout.num_kv_heads, layout.head_dim, layout.queries_per_group
    hidden = qkv.shape[-1]
    groups = qkv.view(g, r + 2, d, hidden)  # [g * (r + 2) * d, H] -> [g, r + 2, d, H]
    q = groups[:, :r].reshape(g * r * d, hidden)  # query head t * r + i = Llama head t * r + i
    return q, groups[:, r].reshape(g * d, hidden), groups[:, r + 1].reshape(g * d, hidden)


def fuse_qkv_llama(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: LlamaLayout | Diff2Layout
) -> torch.Tensor:
    """Llama (q_proj, k_proj, v_proj) weights -> megatron-core fused QKV (inverse of the split)."""
    g, d, r = layout.num_kv_heads, layout.head_dim, layout.queries_per_group
    hidden = q.shape[-1]
    parts = [q.view(g, r, d, hidden), k.view(g, 1, d, hidden), v.view(g, 1, d, hidden)]
    return torch.cat(parts, dim=1).reshape(layout.qkv_rows, hidden)


def fuse_qkv_motif(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: MotifLayout) -> torch.Tensor:
    """Motif (q_proj, k_proj, v_proj) weights -> megatron-core fused QKV: Motif's sub-heads are ours in
    order (query sub-heads `[signal x r, noise]` per group or 2i/2i+1 pairs, keys K1/K2 and values V halves
    2j/2j+1), dealt over the 2g K/V sub-groups as `query_heads_per_subgroup` lays them out."""
    d, subgroups, hidden = layout.head_dim, 2 * layout.num_kv_heads, q.shape[-1]
    q_heads = q.view(layout.query_heads, d, hidden)
    k_sub, v_sub = k.view(subgroups, d, hidden), v.view(subgroups, d, hidden)
    parts, start = [], 0
    for m, count in enumerate(query_heads_per_subgroup(layout.query_heads, subgroups)):
        parts += [q_heads[start : start + count], k_sub[m : m + 1], v_sub[m : m + 1]]
        start += count
    return torch.cat(parts).reshape(layout.qkv_rows, hidden)


def split_fused_qkv_motif(
    qkv: torch.Tensor, layout: MotifLayout
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """megatron-core fused QKV -> Motif (q_proj, k_proj, v_proj) weights (inverse of fuse_qkv_motif)."""
    d, subgroups, hidden = layout.head_dim, 2 * layout.num_kv_heads, qkv.shape[-1]
    rows = qkv.view(-1, d, hidden)  # [(h + n + 4g), d, H]
    q, k, v, start = [], [], [], 0
    for count in query_heads_per_subgroup(layout.query_heads, subgroups):
        q.append(rows[start : start + count])
        k.append(rows[start + count])
        v.append(rows[start + count + 1])
        start += count + 2
    return (
        torch.cat(q).reshape(-1, hidden),
        torch.stack(k).reshape(-1, hidden),
        torch.stack(v).reshape(-1, hidden),
    )


@dataclass(frozen=True)
class LayerMapping:
    """How one architecture's decoder layer maps between the formats (keys inside the layer).

    Everything outside attention is common (`_SAME_IN_LAYER`, SwiGLU fc1 = [gate; up]); an architecture
    gives its own tensors that only change name, its fused-QKV split and fuse, how `linear_proj` becomes
    `o_proj`, and the megatron-core tensors Hugging Face does not store. A third architecture is a layout
    class (layout.py) plus one more entry in LAYER_MAPPINGS.
    """

    same: Mapping[str, str]
    """megatron-core key -> HF key of tensors copied as they are (beyond `_SAME_IN_LAYER`)."""
    split_qkv: Callable[[torch.Tensor, Any], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    fuse_qkv: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any], torch.Tensor]
    o_proj: Callable[[Mapping[str, torch.Tensor], Any], torch.Tensor] = lambda layer, layout: layer[
        "self_attention.linear_proj.weight"
    ]
    """The HF o_proj from a megatron-core layer (DIFF: the head-norm weight folded in)."""
    mcore_only: Callable[[Any, torch.dtype], dict[str, torch.Tensor]] = lambda layout, dtype: {}
    """megatron-core tensors with no HF counterpart, as an import sets them (DIFF: head norm = 1)."""
    fp32: frozenset[str] = frozenset()
    """HF keys an export writes in fp32 or wider whatever its dtype (Motif's lambda vectors: its format
    keeps them fp32 beside bf16 weights)."""


def _diff_o_proj(layer: Mapping[str, torch.Tensor], layout: DiffLayout) -> torch.Tensor:
    return fold_head_norm(
        layer["self_attention.linear_proj.weight"],
        layer["self_attention.core_attention.head_norm.weight"],
        layout,
    )


def _diff_head_norm(layout: DiffLayout, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {"self_attention.core_attention.head_norm.weight": torch.ones(2 * layout.head_dim, dtype=dtype)}


LAYER_MAPPINGS: dict[type[ModelLayout], LayerMapping] = {
    DiffLayout: LayerMapping(
        same=_DIFF_SAME_IN_LAYER,
        split_qkv=split_fused_qkv,
        fuse_qkv=fuse_qkv,
        o_proj=_diff_o_proj,
        mcore_only=_diff_head_norm,
    ),
    LlamaLayout: LayerMapping(same={}, split_qkv=split_fused_qkv_llama, fuse_qkv=fuse_qkv_llama),
    Diff2Layout: LayerMapping(
        same={"self_attention.linear_lambda.weight": "self_attn.lambda_proj.weight"},
        split_qkv=split_fused_qkv_llama,
        fuse_qkv=fuse_qkv_llama,
    ),
    MotifLayout: LayerMapping(  # Motif's subln is our head norm, weight and all: nothing to fold
        same={
            **_DIFF_SAME_IN_LAYER,
            "self_attention.core_attention.head_norm.weight": "self_attn.subln.weight",
            "mlp.poly_norm.weight": "mlp.act_fn.weight",
            "mlp.poly_norm.bias": "mlp.act_fn.bias",
        },
        split_qkv=split_fused_qkv_motif,
        fuse_qkv=fuse_qkv_motif,
        fp32=frozenset(_DIFF_SAME_IN_LAYER.values()),
    ),
}


def layer_mapping(layout: ModelLayout) -> LayerMapping:
    """The mapping of `layout`'s architecture."""
    mapping = LAYER_MAPPINGS.get(type(layout))
    if mapping is None:
        raise DiffmegError(f"no tensor mapping for {type(layout).__name__}")
    return mapping


def mcore_layer_to_hf(
    layer: Mapping[str, torch.Tensor], layout: ModelLayout, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """One megatron-core layer (keys inside `decoder.layers.N.`) -> HF keys inside `model.layers.N.`."""
    check_shapes(layer, layout.mcore_layer_shapes(), "megatron-core layer")
    mapping = layer_mapping(layout)
    out = {hf: _cast(layer[mc], dtype) for mc, hf in {**_SAME_IN_LAYER, **mapping.same}.items()}
    q, k, v = mapping.split_qkv(layer["self_attention.linear_qkv.weight"], layout)
    out["self_attn.q_proj.weight"] = _cast(q, dtype)
    out["self_attn.k_proj.weight"] = _cast(k, dtype)
    out["self_attn.v_proj.weight"] = _cast(v, dtype)
    out["self_attn.o_proj.weight"] = _cast(mapping.o_proj(layer, layout), dtype)
    gate, up = layer["mlp.linear_fc1.weight"].chunk(2, dim=0)  # fc1 = [gate; up]
    out["mlp.gate_proj.weight"] = _cast(gate, dtype)
    out["mlp.up_proj.weight"] = _cast(up, dtype)
    for key in mapping.fp32:  # widened from the source tensor: a bf16 cast in between would round it
        source = layer[next(mc for mc, hf in mapping.same.items() if hf == key)]
        out[key] = _cast(source, torch.promote_types(out[key].dtype, torch.float32))
    return out


def hf_export_dtype(layout: ModelLayout, name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype an export in `dtype` writes HF tensor `name` in (`LayerMapping.fp32`: at least fp32)."""
    key = name.split(".", 3)[-1] if name.startswith("model.layers.") else name
    wide = key in layer_mapping(layout).fp32
    return torch.promote_types(dtype, torch.float32) if wide else dtype


def hf_layer_to_mcore(
    layer: Mapping[str, torch.Tensor], layout: ModelLayout, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """One HF layer (keys inside `model.layers.N.`) -> megatron-core keys (DIFF: head-norm weight = 1)."""
    check_shapes(layer, layout.hf_layer_shapes(), f"{layout.hf_name} layer")
    mapping = layer_mapping(layout)
    out = {mc: _cast(layer[hf], dtype) for mc, hf in {**_SAME_IN_LAYER, **mapping.same}.items()}
    q, k, v = (layer[f"self_attn.{n}_proj.weight"] for n in "qkv")
    o_proj = layer["self_attn.o_proj.weight"]
    out.update(mapping.mcore_only(layout, dtype if dtype is not None else o_proj.dtype))
    out["self_attention.linear_qkv.weight"] = _cast(mapping.fuse_qkv(q, k, v, layout), dtype)
    out["self_attention.linear_proj.weight"] = _cast(o_proj, dtype)
    gate, up = layer["mlp.gate_proj.weight"], layer["mlp.up_proj.weight"]
    out["mlp.linear_fc1.weight"] = _cast(torch.cat([gate, up], dim=0), dtype)  # [gate; up]
    return out


def mcore_globals_to_hf(
    tensors: Mapping[str, torch.Tensor], layout: ModelLayout, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Embedding, final norm and output layer (none when tied) -> Hugging Face names (no layout change)."""
    check_shapes(tensors, layout.mcore_global_shapes(), "megatron-core model")
    return {GLOBALS[mc]: _cast(tensors[mc], dtype) for mc in layout.mcore_global_shapes()}


def hf_globals_to_mcore(
    tensors: Mapping[str, torch.Tensor], layout: ModelLayout, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """HF embedding, norm and lm_head -> megatron-core names. A tied layout maps no lm_head (one stored
    anyway is not read: transformers ties it to the embedding too)."""
    check_shapes(tensors, layout.hf_global_shapes(), f"{layout.hf_name} model")
    return {mc: _cast(tensors[GLOBALS[mc]], dtype) for mc in layout.mcore_global_shapes()}


def hf_model_shapes(layout: ModelLayout) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face tensor's shape, in the order the exporter writes them: the tensors outside the
    layers, then layer by layer."""
    shapes = dict(layout.hf_global_shapes())
    for index in range(layout.num_layers):
        prefix = HF_LAYER_PREFIX.format(index)
        shapes.update({prefix + k: shape for k, shape in layout.hf_layer_shapes().items()})
    return shapes


def layer_tensors(state_dict: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The entries of `state_dict` under `prefix`, with the prefix removed."""
    return {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}


def mcore_to_hf(
    state_dict: Mapping[str, torch.Tensor], layout: ModelLayout, dtype: torch.dtype | None = None
) -> Iterator[dict[str, torch.Tensor]]:
    """A whole TP=1 megatron-core state dict -> HF tensors, one block (globals, layers) at a time."""
    yield mcore_globals_to_hf(state_dict, layout, dtype)
    yield from _layers(state_dict, layout, dtype, mcore_layer_to_hf, MCORE_LAYER_PREFIX, HF_LAYER_PREFIX)


def hf_to_mcore(
    state_dict: Mapping[str, torch.Tensor], layout: ModelLayout, dtype: torch.dtype | None = None
) -> Iterator[dict[str, torch.Tensor]]:
    """A whole HF state dict -> megatron-core TP=1 tensors, one block at a time."""
    yield hf_globals_to_mcore(state_dict, layout, dtype)
    yield from _layers(state_dict, layout, dtype, hf_layer_to_mcore, HF_LAYER_PREFIX, MCORE_LAYER_PREFIX)


def _layers(state_dict, layout: ModelLayout, dtype, convert: Callable, source: str, target: str):
    """Each layer of `state_dict` (names under `source`) converted and renamed under `target`."""
    for i in range(layout.num_layers):
        layer = layer_tensors(state_dict, source.format(i))
        yield {target.format(i) + k: v for k, v in convert(layer, layout, dtype).items()}
