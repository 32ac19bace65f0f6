"""Peak memory of importing a Motif-shaped Hugging Face folder with `hf-to-mcore` (issue 46).

    python benchmarks/motif_import_memory.py --size 12.7b --layers 4 --workdir /tmp/motif-import
    python benchmarks/motif_import_memory.py --size 12.7b --workdir /tmp/motif-import  # 40 layers, 51 GB

1. A random folder in Motif's format (config.json with Motif's keys, bf16 weights beside fp32 lambda vectors,
   one safetensors shard per layer plus the embedding's and the head's, an index) of the `motif-SIZE` preset's
   published shape (diffmeg/presets.py), with `--layers` of its layers (full width and vocabulary): a
   streamed import holds one layer and the vocabulary matrices at a time, so its peak does not grow with
   depth and a few layers measure the whole model's (run two `--layers` to see it). Written shard by shard,
   so this process never holds more than one.
2. `tools/convert_checkpoint.py hf-to-mcore` of it in its own process: wall time and that process's peak RSS
   (VmHWM, benchmarks/conversion_scale.py's `run_measured`).

Prints the figures and the bound they are held to: the largest shard plus two layers (source dtype).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.conversion_scale import run_measured  # noqa: E402


def motif_config(size: str, layers: int | None) -> dict:
    """config.json of the motif-SIZE preset's shape, as Motif's folders spell it (sub-head counts)."""
    from diffmeg.presets import get_preset

    p = get_preset(f"motif-{size}")
    heads, groups, noise = p["num_attention_heads"], p["num_query_groups"], p.get("num_noise_heads")
    config = {
        "model_type": "motif",
        "architectures": ["MotifForCausalLM"],
        "hidden_size": p["hidden_size"],
        "intermediate_size": p["ffn_hidden_size"],
        "num_hidden_layers": layers or p["num_layers"],
        "vocab_size": p["vocab_size"],
        "max_position_embeddings": p["max_position_embeddings"],
        "rope_theta": p["rotary_base"],
        "rms_norm_eps": p["norm_epsilon"],
        "attn_rms_norm_eps": 1e-5,
        "hidden_act": "poly_norm",
        "tie_word_embeddings": bool(p.get("tie_embeddings_and_output_weights", False)),
        "torch_dtype": "bfloat16",
    }
    if noise is None:  # 2.6B: 2h query and 2g key sub-heads, d = hidden / 2h
        config.update(num_attention_heads=2 * heads, num_key_value_heads=2 * groups)
    else:  # 12.7B: h + n query heads, a K1/K2 pair per group
        config.update(
            num_attention_heads=heads + noise, num_key_value_heads=2 * noise, num_noise_heads=noise, k_ratio=1
        )
        config["head_dim"] = p["kv_channels"]
    return config


def layer_tensors(config: dict, i: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Layer i's tensors in Motif's names, shapes and dtypes (random: only their sizes matter here)."""
    hidden, ffn = config["hidden_size"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or hidden // heads
    signal = heads - config.get("num_noise_heads", heads // 2)
    bf16 = torch.bfloat16

    def w(*shape):
        return torch.randn(shape, generator=gen, dtype=bf16) * 0.02

    p = f"model.layers.{i}."
    tensors = {
        p + "input_layernorm.weight": torch.ones(hidden, dtype=bf16),
        p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=bf16),
        p + "self_attn.q_proj.weight": w(heads * d, hidden),
        p + "self_attn.k_proj.weight": w(kv * d, hidden),
        p + "self_attn.v_proj.weight": w(kv * d, hidden),
        p + "self_attn.o_proj.weight": w(hidden, signal * 2 * d),
        p + "self_attn.subln.weight": torch.ones(2 * d, dtype=bf16),
        p + "mlp.gate_proj.weight": w(ffn, hidden),
        p + "mlp.up_proj.weight": w(ffn, hidden),
        p + "mlp.down_proj.weight": w(hidden, ffn),
        p + "mlp.act_fn.weight": torch.full((3,), 1 / 3, dtype=bf16),
        p + "mlp.act_fn.bias": torch.zeros(1, dtype=bf16),
    }
    for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
        tensors[p + f"self_attn.{name}"] = torch.randn(d, generator=gen) * 0.1  # fp32, as Motif's may be
    return tensors


def write_folder(directory: Path, config: dict) -> dict:
    """The folder, shard by shard; returns its sizes (bytes): total, largest shard, largest layer."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    gen = torch.Generator().manual_seed(0)
    vocab, hidden = config["vocab_size"], config["hidden_size"]

    def vocab_matrix() -> torch.Tensor:
        return torch.randn(vocab, hidden, generator=gen, dtype=torch.bfloat16)

    shards = [("embed", lambda: {"model.embed_tokens.weight": vocab_matrix()})]
    shards += [
        (f"layer{i:03d}", lambda i=i: layer_tensors(config, i, gen))
        for i in range(config["num_hidden_layers"])
    ]
    head = {"model.norm.weight": lambda: torch.ones(hidden, dtype=torch.bfloat16)}
    if not config["tie_word_embeddings"]:
        head["lm_head.weight"] = vocab_matrix
    shards.append(("head", lambda: {k: make() for k, make in head.items()}))
    weight_map, sizes = {}, {"total": 0, "largest_shard": 0, "largest_layer": 0}
    for number, (kind, make) in enumerate(shards):
        tensors = make()
        name = f"model-{number + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(directory / name), metadata={"format": "pt"})
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        sizes["total"] += nbytes
        sizes["largest_shard"] = max(sizes["largest_shard"], nbytes)
        if kind.startswith("layer"):
            sizes["largest_layer"] = max(sizes["largest_layer"], nbytes)
        weight_map.update(dict.fromkeys(tensors, name))
        del tensors
    index = {"metadata": {"total_size": sizes["total"]}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("12.7b", "2.6b"), default="12.7b")
    parser.add_argument("--layers", type=int, default=None, help="default: the preset's")
    parser.add_argument("--workdir", type=Path, required=True, help="a folder this run creates (and removes)")
    parser.add_argument("--keep", action="store_true", help="leave the source and the import in --workdir")
    args = parser.parse_args()
    if args.workdir.exists():
        sys.exit(f"--workdir {args.workdir} exists; give a new folder (this run removes what it writes)")
    config = motif_config(args.size, args.layers)
    source, target = args.workdir / "motif-hf", args.workdir / "motif-mcore"
    try:
        sizes = write_folder(source, config)
        argv = ["hf-to-mcore", "--load", str(source), "--save", str(target)]
        run = run_measured("convert_checkpoint", argv, args.workdir / "hf-to-mcore.log")
    finally:
        if not args.keep:
            for path in (source, target):
                shutil.rmtree(path, ignore_errors=True)
    gib = 2**30
    bound = sizes["largest_shard"] + 2 * sizes["largest_layer"]
    print(f"motif-{args.size} shape, {config['num_hidden_layers']} layers, bf16 (fp32 lambda vectors): "
          f"source {sizes['total'] / gib:.2f} GiB, largest shard {sizes['largest_shard'] / gib:.2f} GiB, "
          f"a layer {sizes['largest_layer'] / gib:.2f} GiB")  # fmt: skip
    print(f"hf-to-mcore: peak RSS {run['peak_rss_bytes'] / gib:.2f} GiB (bound: largest shard + two layers "
          f"{bound / gib:.2f} GiB), wall {run['wall_s']:.0f} s, CPU {run['cpu_s']:.0f} s")  # fmt: skip
    print(f"  {run['command']}")


if __name__ == "__main__":
    main()
