"""What the 1:1 DIFF models (V1, V2) were before grouped differential attention: a committed snapshot.

Grouped differential attention made the noise-head count a parameter of the V1 and V2 modules; with as many
noise heads as signal heads (the default) they must be today's models exactly: the same state-dict keys and
shapes, the same initial weights and the same numbers. `snapshot(name)` measures one model;
tests/fixtures/classic_diff_snapshot.json holds what the code measured before the change, written by

    python3 -m tests.classic_snapshot --write

The state dict's keys, shapes and initial weights (SHA-256 of each tensor's bytes) must match exactly; the
float64 loss and gradient norms to 1e-12 relative (matmul kernels differ between CPUs in the last bits),
the float32 loss to 1e-6.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import torch

FIXTURE = Path(__file__).parent / "fixtures" / "classic_diff_snapshot.json"

MODELS: dict[str, dict] = {
    "v1": dict(heads=4, kv_heads=4, head_dim=8, layers=2),
    "v1_gqa": dict(heads=4, kv_heads=2, head_dim=8, layers=2),
    "v2": dict(heads=4, kv_heads=4, head_dim=8, layers=2, diff_version=2),
    "v2_gqa": dict(heads=4, kv_heads=2, head_dim=8, layers=2, diff_version=2),
}
"""The models snapshotted: h DIFF heads, g KV heads, head dim d (tests.builders.tiny_config's counts)."""


def _model(spec: dict, dtype: torch.dtype, **fields):
    from diffmeg.model import build_model
    from tests.builders import tiny_config

    spec = dict(spec)
    cfg = tiny_config(
        spec.pop("heads"), spec.pop("kv_heads"), spec.pop("head_dim"), spec.pop("layers"),
        params_dtype=dtype, **spec, **fields,
    )  # fmt: skip
    return build_model(cfg, vocab_size=64, max_sequence_length=16, rotary_base=500.0, seed=11)


def _loss(model) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 64, (2, 12), generator=gen)
    labels = torch.randint(0, 64, (2, 12), generator=gen)
    position_ids = torch.arange(12)[None].expand(2, -1)
    logits = model(input_ids=tokens, position_ids=position_ids, attention_mask=None)  # [b, s, V]
    # our own cross entropy in the model's dtype (megatron-core's loss computes in fp32 whatever the model's)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()


def snapshot(name: str, **fields) -> dict:
    """Keys, shapes and weight hashes of the float32 model `name` at init; its float32 loss; the float64
    model's loss and every gradient's norm. `fields` go to the config (e.g. the noise-head count)."""
    spec = MODELS[name]
    model = _model(spec, torch.float32, **fields)
    tensors = {
        key: {"shape": list(t.shape), "sha256": _sha256(t)}
        for key, t in model.state_dict().items()
        if isinstance(t, torch.Tensor)
    }
    loss32 = _loss(model).item()
    model64 = _model(spec, torch.float64, **fields).double()
    loss64 = _loss(model64)
    loss64.backward()
    grads = {n: p.grad.norm().item() for n, p in model64.named_parameters()}
    return {"tensors": tensors, "loss_fp32": loss32, "loss_fp64": loss64.item(), "grad_norms_fp64": grads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {FIXTURE}")
    args = parser.parse_args()
    from diffmeg.runtime import single_process

    single_process()
    data = {name: snapshot(name) for name in MODELS}
    if args.write:
        FIXTURE.parent.mkdir(exist_ok=True)
        FIXTURE.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        print(f"wrote {FIXTURE}")
    else:
        numbers = {name: {k: v for k, v in d.items() if k != "tensors"} for name, d in data.items()}
        print(json.dumps(numbers, indent=1))


if __name__ == "__main__":
    main()
