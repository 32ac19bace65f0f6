"""Read attention maps, attention logits and layer outputs out of a loaded model, without editing it.

DIFF layers: `diffmeg.attention.override_attention_backend` runs, for the duration of a `with` block,
an explicit-softmax function with the reference path's math
(`diffmeg.kernels.reference`) that also hands both maps, both logit tensors and lambda to a sink.
Transformer layers (megatron-core's DotProductAttention): hooks on its `scale_mask_softmax` module see
the scaled logits going in and the probabilities coming out. Layer outputs come from forward hooks on
the decoder layers. Everything is undone on exit, so the model is usable as before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch

from diffmeg.errors import DiffmegError
from diffmeg.kernels.reference import causal_keep_mask

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
    lam: float | None = None

    @property
    def effective_map(self) -> torch.Tensor:
        """The map that multiplies V: A1 - lambda A2 for DIFF (rows sum to 1 - lambda), A otherwise."""
        if self.kind == "diff":
            return self.maps[0] - self.lam * self.maps[1]
        return self.maps[0]


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
    """An attention backend with the reference math that reports maps and can transform logits."""

    def backend(q1, q2, k1, k2, v, lam, *, scale, dropout_p=0.0, attention_mask=None):
        if dropout_p > 0.0:
            raise DiffmegError("attention analysis needs the model in eval mode (attention dropout is on)")
        h, g, sk = q1.shape[1], k1.shape[1], k1.shape[2]
        rep = h // g
        k1, k2, v = (t.repeat_interleave(rep, dim=1) for t in (k1, k2, v))
        dtype = torch.promote_types(q1.dtype, torch.float32)
        keep = causal_keep_mask(q1.shape[2], sk, q1.device)
        if attention_mask is not None:
            keep = keep & ~attention_mask.bool()
        logits = [
            torch.matmul(q.to(dtype), k.to(dtype).transpose(-1, -2)) * scale for q, k in ((q1, k1), (q2, k2))
        ]
        if logit_fn is not None:
            logits = [logit_fn(x, keep) for x in logits]
        maps = [torch.softmax(x.masked_fill(~keep, float("-inf")), dim=-1) for x in logits]
        lam = lam.to(dtype)
        if sink is not None:
            sink(AttentionRecord(layer, "diff", logits, maps, keep, float(lam)))
        return torch.matmul(maps[0] - lam * maps[1], v.to(dtype)).to(q1.dtype)

    return backend


@contextmanager
def capture_attention(
    model: torch.nn.Module, sink: Sink | None = None, logit_fn: LogitFn | None = None
) -> Iterator[None]:
    """Within the block, every attention layer reports an `AttentionRecord` to `sink` per forward pass
    and applies `logit_fn` to its logits before the softmax (both maps for DIFF)."""
    from diffmeg.attention import DiffCoreAttention, override_attention_backend

    with ExitStack() as stack:
        stack.enter_context(
            override_attention_backend(model, lambda index: _diff_backend(index, sink, logit_fn))
        )
        for index, layer in enumerate(decoder_layers(model)):
            core = layer.self_attention.core_attention
            if isinstance(core, DiffCoreAttention):
                continue
            softmax = getattr(core, "scale_mask_softmax", None)
            if softmax is None:
                raise DiffmegError(f"layer {index}: unsupported attention module {type(core).__name__}")
            for handle in _softmax_hooks(softmax, index, sink, logit_fn):
                stack.callback(handle.remove)
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
