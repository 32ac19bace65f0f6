"""Read attention maps, attention logits and layer outputs out of a loaded model, without editing it.

For the duration of a `with` block, `diffmeg.attention.override_attention_backend` makes every attention
core compute with explicit-softmax math that also hands its maps and logits to a sink:
* DIFF V1 layers (`DiffCoreAttention`): the reference path's math (`diffmeg.kernels.reference`) with both
  maps, both logit tensors and lambda;
* every other layer whose core is diffmeg's `SDPACoreAttention` (the Transformer baseline of the local
  spec, DIFF V2): torch SDPA's math over the ordinary heads. A DIFF V2 layer's 2h heads are reported as
  its h pairs (A1 = even heads, A2 = odd heads) with the per-token lambda of the layer's forward
  (`DiffV2SelfAttention.lam`).
With grouped differential attention (n noise heads for h signal heads) both report h heads: A1 of each
signal head, A2 the noise map of its group (the same map for the group's r = h / n heads).
A baseline built with megatron-core's own local `DotProductAttention` is read through hooks on its
`scale_mask_softmax` module. Layer outputs come from forward hooks on the decoder layers. Everything is
undone on exit, so the model is usable as before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention

from diffmeg.attention import override_attention_backend
from diffmeg.attention_v2 import DiffV2SelfAttention
from diffmeg.errors import DiffmegError
from diffmeg.kernels.reference import causal_keep_mask, softmax_map

LogitFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(logits [b, h, sq, sk], keep [sq, sk] bool) -> logits: a transform applied before the softmax."""


@dataclass
class AttentionRecord:
    """One layer's attention for one forward pass (fp32 or wider tensors, [b, h, sq, sk])."""

    layer: int
    """0-based decoder layer."""
    kind: str
    """"diff" (A1, A2 and lambda) or "softmax" (one map)."""
    logits: list[torch.Tensor]
    """Scaled pre-softmax logits q.k/sqrt(d), before masking (causally invisible entries included)."""
    maps: list[torch.Tensor]
    """Softmax maps: [A1, A2] for DIFF, [A] for the Transformer."""
    keep: torch.Tensor
    """[sq, sk] bool: entries the causal mask lets through."""
    lam: float | torch.Tensor | None = None
    """DIFF V1: the layer's lambda; DIFF V2: sigmoid(lambda_proj(x)) per head and query, [b, h, sq, 1]."""

    @property
    def effective_map(self) -> torch.Tensor:
        """The map that multiplies V: A1 - lambda A2 for DIFF (rows sum to 1 - lambda), A otherwise."""
        if self.kind == "diff":
            return self.maps[0] - self.lam * self.maps[1]
        return self.maps[0]

    @property
    def mean_lambda(self) -> float | None:
        """lambda (DIFF V1), its mean over heads and queries (DIFF V2), None for a softmax layer."""
        return None if self.lam is None else float(torch.as_tensor(self.lam).double().mean())


Sink = Callable[[AttentionRecord], None]


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The GPTModel's transformer layers in order (through DDP/Float16 wrappers)."""
    while hasattr(model, "module"):
        model = model.module
    decoder = getattr(model, "decoder", None)
    if decoder is None or not hasattr(decoder, "layers"):
        raise DiffmegError("the model has no decoder layers to inspect (is it a megatron-core GPTModel?)")
    return list(decoder.layers)


def _diff_backend(layer: int, sink: Sink | None, logit_fn: LogitFn | None):
    """A DIFF V1 attention backend with the reference math that reports maps and can transform logits."""

    def backend(q1, q2, k1, k2, v, lam, *, scale, dropout_p=0.0, attention_mask=None):
        if dropout_p > 0.0:
            raise DiffmegError("attention analysis needs the model in eval mode (attention dropout is on)")
        h, n, g = q1.shape[1], q2.shape[1], k1.shape[1]
        # GQA: [b, g, s, .] -> [b, h, s, .] (signal heads), [b, n, s, .] (noise heads)
        k1, v = (t.repeat_interleave(h // g, dim=1) for t in (k1, v))
        k2 = k2.repeat_interleave(n // g, dim=1)
        keep = causal_keep_mask(q1.shape[2], k1.shape[2], q1.device)
        if attention_mask is not None:
            keep = keep & ~attention_mask.bool()
        (l1, a1), (l2, a2) = (softmax_map(q, k, keep, scale, logit_fn) for q, k in ((q1, k1), (q2, k2)))
        # each signal head's noise map: its group's, [b, n, ..] -> [b, h, ..]
        l2, a2 = (t.repeat_interleave(h // n, dim=1) for t in (l2, a2))
        lam = lam.to(a1.dtype)
        if sink is not None:
            sink(AttentionRecord(layer, "diff", [l1, l2], [a1, a2], keep, float(lam)))
        return torch.matmul(a1 - lam * a2, v.to(a1.dtype)).to(q1.dtype)

    return backend


def _sdpa_keep(attn_mask: torch.Tensor | None, is_causal: bool, sq: int, sk: int, device) -> torch.Tensor:
    """The [sq, sk] entries torch's SDPA attends to for these arguments (True = attend)."""
    if attn_mask is not None:
        keep = attn_mask.bool()
        while keep.dim() > 2 and keep.shape[0] == 1:  # [1, 1, sq, sk] -> [sq, sk]
            keep = keep[0]
        if keep.dim() != 2:
            raise DiffmegError("attention analysis takes one mask for the whole batch ([sq, sk])")
        return keep.expand(sq, sk)
    if is_causal:  # torch's convention: the top-left triangle
        return torch.ones(sq, sk, dtype=torch.bool, device=device).tril()
    return torch.ones(sq, sk, dtype=torch.bool, device=device)


def _signal_and_noise(t: torch.Tensor, ratio: int) -> list[torch.Tensor]:
    """A DIFF V2 layer's per-head tensor [b, h + n, ...] in groups [signal x ratio, noise] as [A1, A2], each
    [b, h, ...]: the signal heads, and for each its group's noise head (ratio 1: heads 2i, 2i+1)."""
    b, heads = t.shape[:2]
    groups = t.view(b, heads // (ratio + 1), ratio + 1, *t.shape[2:])  # [b, n, r + 1, ...]
    signal = groups[:, :, :ratio].reshape(b, -1, *t.shape[2:])
    return [signal, groups[:, :, ratio].repeat_interleave(ratio, dim=1)]


def _sdpa(layer: int, sink: Sink | None, logit_fn: LogitFn | None, v2: DiffV2SelfAttention | None):
    """torch SDPA's math, explicit, reporting the maps. For a DIFF V2 layer (`v2`, its attention) the 2h
    heads are reported as h pairs (even heads A1, odd heads A2) with the lambda of its forward [s, b, h]."""

    def sdpa(q, k, v, *, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if dropout_p > 0.0:
            raise DiffmegError("attention analysis needs the model in eval mode (attention dropout is on)")
        heads, sq, sk = q.shape[1], q.shape[2], k.shape[2]
        rep = heads // k.shape[1]
        k, v = (t.repeat_interleave(rep, dim=1) for t in (k, v))  # query head j reads KV head j // rep
        keep = _sdpa_keep(attn_mask, is_causal, sq, sk, q.device)
        scale = scale if scale is not None else q.shape[-1] ** -0.5
        logits, maps = softmax_map(q, k, keep, scale, logit_fn)
        if sink is not None:
            if v2 is None:
                sink(AttentionRecord(layer, "softmax", [logits], [maps], keep))
            else:
                if v2.lam is None:
                    raise DiffmegError(f"layer {layer}: DIFF V2 attention ran without its lambda projection")
                lam = v2.lam.permute(1, 2, 0).unsqueeze(-1)  # [s, b, h] -> [b, h, s, 1]
                pairs = [_signal_and_noise(t, v2.noise_ratio) for t in (logits, maps)]
                sink(AttentionRecord(layer, "diff", pairs[0], pairs[1], keep, lam.to(maps.dtype)))
        return torch.matmul(maps, v.to(maps.dtype)).to(q.dtype)

    return sdpa


@contextmanager
def capture_attention(
    model: torch.nn.Module, sink: Sink | None = None, logit_fn: LogitFn | None = None
) -> Iterator[None]:
    """Within the block, every attention layer reports an `AttentionRecord` to `sink` per forward pass
    and applies `logit_fn` to its logits before the softmax (both maps for DIFF)."""

    with ExitStack() as stack:
        v2_layers: dict[int, DiffV2SelfAttention] = {}
        for index, layer in enumerate(decoder_layers(model)):
            attention = layer.self_attention
            core = attention.core_attention
            if isinstance(attention, DiffV2SelfAttention) and hasattr(core, "override"):
                v2_layers[index] = attention  # its forward holds the per-token lambda the SDPA override reads
            elif isinstance(core, DotProductAttention) and not isinstance(attention, DiffV2SelfAttention):
                for handle in _softmax_hooks(core.scale_mask_softmax, index, sink, logit_fn):
                    stack.callback(handle.remove)
            elif not hasattr(core, "override"):
                raise DiffmegError(f"layer {index}: attention analysis cannot read {type(core).__name__}")
        stack.enter_context(
            override_attention_backend(
                model,
                lambda i: _diff_backend(i, sink, logit_fn),
                lambda i: _sdpa(i, sink, logit_fn, v2_layers.get(i)),
            )
        )
        yield


def _softmax_hooks(module: torch.nn.Module, index: int, sink: Sink | None, logit_fn: LogitFn | None):
    """Hooks on megatron-core's FusedScaleMaskSoftmax: its first input is the scaled logits."""
    state: dict[str, torch.Tensor] = {}

    def pre(mod, args):
        scores = args[0]
        keep = causal_keep_mask(scores.shape[-2], scores.shape[-1], scores.device)
        if logit_fn is not None:
            scores = logit_fn(scores, keep)
            args = (scores, *args[1:])
        state["logits"], state["keep"] = scores, keep
        return args

    def post(mod, args, output):
        if sink is not None:
            if getattr(mod, "scale", None) is not None:
                raise DiffmegError("query-key layer scaling is on: the logits seen are not the final ones")
            sink(
                AttentionRecord(index, "softmax", [state["logits"].float()], [output.float()], state["keep"])
            )
        state.clear()

    return [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]


@contextmanager
def capture_layer_outputs(
    model: torch.nn.Module, sink: Callable[[int, torch.Tensor], None]
) -> Iterator[None]:
    """Within the block, `sink(layer, hidden [s, b, h])` receives every decoder layer's output."""

    def hook(index: int):
        def fn(mod, args, output):
            sink(index, output[0] if isinstance(output, tuple) else output)

        return fn

    handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(decoder_layers(model))]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
