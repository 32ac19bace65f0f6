"""Checkpoint conversion at scale: wall time and peak memory of hf-to-mcore and mcore-to-hf, and a bit-exact
round trip of every tensor.

    python benchmarks/conversion_scale.py --preset diff-3b --workdir /tmp/conversion-scale
    python benchmarks/conversion_scale.py --preset transformer-3b --workdir /tmp/conversion-scale
    python benchmarks/conversion_scale.py --preset diff-tiny --layers 48 --shard-size 20MB   # quick look

1. A random Hugging Face model of the preset's shape: transformers' DiffLlamaForCausalLM (DIFF presets) or
   LlamaForCausalLM (`transformer-*`) built on the meta device for its tensor names and shapes, its
   config.json from diffmeg's own export mapping, then materialised one safetensors shard at a time
   (`--shard-size`, written with the `safetensors` package as transformers writes them), so this process
   never holds more than one shard. Weights N(0, 0.02), norms in [0.5, 1.5], lambda vectors N(0, 0.3).
2. `tools/convert_checkpoint.py hf-to-mcore` (the source's dtype), then `mcore-to-hf` of the result (same
   shard size, no tokenizer), each in its own process: wall time and the peak RSS of that process's own
   address space (VmHWM; each direction's peak is its own, nothing inherited from this process).
3. Every tensor of the round trip compared with the source byte for byte, one tensor at a time.

Prints one table; `--json FILE` writes the figures. The memory bound of issue 18 is printed next to them:
the largest source shard plus two layers (in the source dtype). Needs the `hf` extra and disk for three
copies of the model (a 3B model in bf16: 3 x 7.6 GB).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_size(text: str) -> int:
    """'2GB', '500MB' -> bytes (powers of 1000, as Hugging Face counts shard sizes)."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    upper = text.strip().upper()
    unit = next((u for u in units if upper.endswith(u)), "B")
    return int(float(upper[: len(upper) - len(unit)] if upper.endswith(unit) else upper) * units[unit])


def hf_config(preset: str, layers: int | None, dtype: str) -> tuple[dict, object]:
    """(transformers config kwargs, layout) of the preset, as `mcore-to-hf` would write its config.json."""
    from diffmeg.conversion.hf_config import hf_config_dict, layout_from_args
    from diffmeg.training.arguments import resolve_args

    argv = ["--model", preset] + (["--num-layers", str(layers)] if layers else [])
    layout = layout_from_args(resolve_args(argv, world_size=1))
    return hf_config_dict(layout, dtype=dtype, bos_token_id=None, eos_token_id=None), layout


def random_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    out = torch.empty(shape, dtype=torch.float32)
    if "lambda" in name:
        out.normal_(0.0, 0.3, generator=gen)
    elif "norm" in name:
        out.uniform_(0.5, 1.5, generator=gen)
    else:
        out.normal_(0.0, 0.02, generator=gen)
    return out.to(dtype)


def make_source(
    directory: Path, preset: str, layers: int | None, dtype: str, shard_bytes: int, seed: int
) -> dict:
    """Write the random model; returns its sizes."""
    import transformers
    from safetensors.torch import save_file

    kwargs, layout = hf_config(
        preset, layers, {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[dtype]
    )
    config = getattr(transformers, layout.architecture.replace("ForCausalLM", "Config"))(**kwargs)
    with torch.device("meta"):
        model = getattr(transformers, layout.architecture)(config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    del model
    torch_dtype = DTYPES[dtype]
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * torch_dtype.itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    directory.mkdir(parents=True)
    config.save_pretrained(directory)
    weight_map = {}
    for index, names in enumerate(shards):
        file = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {
            n: random_tensor(n, shapes[n], torch_dtype, seed * 100003 + i) for i, n in enumerate(names)
        }
        save_file(tensors, str(directory / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
        del tensors
    total = sum(math.prod(s) for s in shapes.values()) * torch_dtype.itemsize
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    layer_bytes = (
        sum(math.prod(s) for n, s in shapes.items() if n.startswith("model.layers.0.")) * torch_dtype.itemsize
    )
    largest_shard = max(sum(math.prod(shapes[n]) for n in names) for names in shards) * torch_dtype.itemsize
    return {
        "parameters": sum(math.prod(s) for s in shapes.values()),
        "bytes": total,
        "shards": len(shards),
        "largest_shard_bytes": largest_shard,
        "layer_bytes": layer_bytes,
        "layers": layout.num_layers,
        "architecture": layout.architecture,
    }


# Runs a tool and reports the peak RSS of its own address space (VmHWM). Not wait4's ru_maxrss: Linux
# carries the launching process's high-water mark across fork/vfork + exec into the child's, so a child
# started by a large parent would report the parent's peak.
_MEASURED = """
import runpy, sys
tool = sys.argv[1]
sys.argv = sys.argv[1:]
try:
    runpy.run_path(tool, run_name="__main__")
finally:
    with open("/proc/self/status") as f:
        hwm = next(line for line in f if line.startswith("VmHWM:"))
    print("peak-rss-kB", int(hwm.split()[1]), file=sys.stderr, flush=True)
"""


def run_measured(tool: str, argv: list[str], log: Path) -> dict:
    """Run `python tools/<tool>.py argv` in its own process: wall time and that process's peak RSS."""
    script = str(REPO / "tools" / f"{tool}.py")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)  # CPU time: summed, so per-run deltas are exact
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.run(
            [sys.executable, "-c", _MEASURED, script, *argv], stdout=out, stderr=subprocess.STDOUT, cwd=REPO
        )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    text = log.read_text()
    if proc.returncode != 0:
        sys.exit(f"{tool} {shlex.join(argv)} failed (exit {proc.returncode}):\n{text[-4000:]}")
    peak = [line for line in text.splitlines() if line.startswith("peak-rss-kB ")][-1]
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "peak_rss_bytes": int(peak.split()[1]) * 1024,
        "command": f"python tools/{tool}.py {shlex.join(argv)}",
        "load_average_after": os.getloadavg()[0],
    }


def tensor_files(directory: Path) -> dict[str, Path]:
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    return {name: directory / file for name, file in index["weight_map"].items()}


def compare_round_trip(source: Path, back: Path) -> dict:
    """Every tensor byte for byte, one at a time (each file opened per tensor, so no mapping piles up)."""
    from safetensors import safe_open

    ours, theirs = tensor_files(source), tensor_files(back)
    if ours.keys() != theirs.keys():
        missing = sorted(ours.keys() - theirs.keys()) or sorted(theirs.keys() - ours.keys())
        return {"tensors": len(ours), "identical": 0, "first_difference": f"key sets differ ({missing[0]})"}
    identical, first = 0, None
    for name in sorted(ours):
        with safe_open(str(ours[name]), "pt") as f:
            a = f.get_tensor(name)
        with safe_open(str(theirs[name]), "pt") as f:
            b = f.get_tensor(name)
        same = (
            a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(
                a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
            )
        )
        identical += same
        if not same and first is None:
            first = name
    return {"tensors": len(ours), "identical": identical, "first_difference": first}


def directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--preset", default="diff-3b", help="diffmeg preset whose shape to build (diff-*, transformer-*)"
    )
    p.add_argument("--layers", type=int, default=None, help="override the preset's number of layers")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="source weights (bf16)")
    p.add_argument(
        "--shard-size", type=parse_size, default=parse_size("2GB"), help="source and export shards"
    )
    p.add_argument("--workdir", type=Path, default=Path("/tmp/conversion-scale"), help="emptied first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", action="store_true", help="keep the three models in --workdir")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args()

    shutil.rmtree(args.workdir, ignore_errors=True)
    source, ckpt, back = args.workdir / "hf", args.workdir / "mcore", args.workdir / "hf-back"
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    sizes = make_source(source, args.preset, args.layers, args.dtype, args.shard_size, args.seed)
    depth = f" with {args.layers} layers" if args.layers else ""
    print(
        f"source: {args.preset}{depth}, {sizes['architecture']}, {sizes['parameters'] / 1e9:.2f}B "
        f"parameters, {gb(sizes['bytes'])} {args.dtype} in {sizes['shards']} shard(s) "
        f"(built in {time.perf_counter() - t0:.0f} s)",
        flush=True,
    )
    to_mcore = run_measured(
        "convert_checkpoint",
        ["hf-to-mcore", "--load", str(source), "--save", str(ckpt)],
        args.workdir / "hf-to-mcore.log",
    )
    to_hf = run_measured(
        "convert_checkpoint",
        [
            "mcore-to-hf",
            "--load",
            str(ckpt),
            "--save",
            str(back),
            "--no-tokenizer",
            "--max-shard-size",
            str(args.shard_size),
        ],
        args.workdir / "mcore-to-hf.log",
    )
    check = compare_round_trip(source, back)
    bound = sizes["largest_shard_bytes"] + 2 * sizes["layer_bytes"]
    results = {
        "preset": args.preset,
        "layers": sizes["layers"],
        "dtype": args.dtype,
        "source": sizes,
        "checkpoint_bytes": directory_bytes(ckpt),
        "hf_to_mcore": to_mcore,
        "mcore_to_hf": to_hf,
        "bound_bytes": bound,
        "round_trip": check,
        "host": {"cpus": os.cpu_count(), "torch": torch.__version__, "load_average_before": load_before},
    }
    print(
        f"checkpoint: {gb(results['checkpoint_bytes'])}; bound (largest source shard + 2 layers): {gb(bound)}"
    )
    print(
        f"load average (1 min) before: {load_before:.1f}, after each direction: "
        f"{to_mcore['load_average_after']:.1f}, {to_hf['load_average_after']:.1f} ({os.cpu_count()} CPUs)"
    )
    print(f"{'direction':<12} {'wall':>9} {'CPU':>9} {'peak RSS':>10}  within bound")
    for name, r in (("hf-to-mcore", to_mcore), ("mcore-to-hf", to_hf)):
        ok = "yes" if r["peak_rss_bytes"] <= bound else "NO"
        print(f"{name:<12} {r['wall_s']:>8.1f}s {r['cpu_s']:>8.1f}s {gb(r['peak_rss_bytes']):>10}  {ok}")
    exact = check["identical"] == check["tensors"]
    print(
        f"round trip: {check['identical']}/{check['tensors']} tensors bit-identical"
        + ("" if exact else f" (first difference: {check['first_difference']})")
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    if not args.keep:
        shutil.rmtree(args.workdir, ignore_errors=True)
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
