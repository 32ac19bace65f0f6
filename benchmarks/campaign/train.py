"""Phase `train`: tokens/s and MFU of a 3B-wide model cut to what fits, DIFF against the Transformer.

Each model is built and stepped by benchmarks/train_step.py as pretrain_diff.py runs it, megatron-core's
fusions compiled by TorchDynamo on a GPU (the runner leaves it on for this phase there). MFU is reported
against the GPU's dense bf16 peak (`mfu`, the field's definition, which the 45% goal uses) and against
the matmul rate the env phase measured (`mfu_vs_matmul`). At the first length DIFF also runs with the
distributed optimizer without and with overlapped communication (VARIANTS): on one GPU DP is 1, so
overlap can only show its overhead there, never its gain. With `Plan.train_profile` each row at the first
length runs one more step under torch.profiler: its `profile` says where the step's time goes.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.campaign.part import Part
from benchmarks.campaign.plan import Plan, device_of

OVERLAP_ARGS = ("--overlap-grad-reduce", "--overlap-param-gather")
"""pretrain_diff.py's overlapped data-parallel communication (Megatron-LM's flags; docs/recipes.md)."""
VARIANTS = {
    "dist-opt": ("--use-distributed-optimizer",),
    "dist-opt+overlap": ("--use-distributed-optimizer", *OVERLAP_ARGS),
}
VARIANT_NOTE = "one GPU: DP=1, so overlap can only show its overhead here, not its gain"


def phase_train(a: argparse.Namespace, part: Part, deadline: float, plan: Plan) -> None:
    import torch

    from benchmarks import step_profile, train_step
    from diffmeg.presets import PRESETS

    device = device_of(a)
    train_step.init_process()
    layers = fit_layers(plan, device)
    backends = list(plan.train_backends)
    tiles = a.triton_tiles if a.triton_tiles not in (None, "auto", "none") else None
    if device == "cuda" and "triton" in backends and tiles and not _is_default_tiles(tiles):
        backends.append("triton-tuned")
    base = train_step.baseline_of(plan.train_diff)
    v2 = plan.train_diff.replace("diff-", "diff2-", 1)
    runs: list[tuple[str, str | None, str | None]] = [(base, None, None)]
    runs += [(plan.train_diff, b, None) for b in backends]
    if v2 in PRESETS:  # DIFF V2 (attention by megatron-core's own core): its presets are diff2-*
        runs.append((v2, None, None))
    compiled = not torch._dynamo.config.disable
    print(f"TorchDynamo (megatron-core's fusions compiled): {compiled}", flush=True)
    print(train_step.format_header(), flush=True)
    for i, seq in enumerate(plan.train_seqs):
        variants = [(plan.train_diff, None, v) for v in VARIANTS] if i == 0 and plan.train_overlap else []
        for preset, backend, variant in runs + variants:
            row = {"model": preset, "impl": backend or ("baseline" if preset == base else "auto"), "seq": seq,
                   "arch": _arch(preset), "variant": variant, "torch_compile": compiled}  # fmt: skip
            if variant:
                row["note"] = VARIANT_NOTE
            if time.monotonic() > deadline:
                part.add("train", {**row, "tokens_per_s": None, "mfu": None, "error": "skipped: time budget"})
                part.set(_status="partial", _error="some runs skipped: time budget")
                continue
            opts = train_step.StepOptions(
                tokens_per_microbatch=plan.train_tokens_per_microbatch,
                microbatches=plan.train_microbatches,
                warmup=plan.train_warmup,
                iters=plan.train_iters,
                vocab_size=plan.vocab_size,
                diff_attn_backend="triton" if backend == "triton-tuned" else backend,
                num_layers=layers,
                extra_args=list(VARIANTS.get(variant, ())),
                profile=plan.train_profile and i == 0 and variant is None,
            )
            with tuned_triton_tiles(tiles if backend == "triton-tuned" else None):
                r = train_step.run_one(preset, seq, opts, device)
            print(train_step.format_row(r, a.peak if device == "cuda" else None), flush=True)
            if r["profile"]:
                print(f"  one step: {step_profile.format_share(r['profile'])}", flush=True)
            part.add("train", {**row, **train_row(r, device, a.peak, a.roof)})
            if device == "cuda":
                torch.cuda.empty_cache()
    train_step.close_process()


def train_row(r: dict, device: str, peak: float | None, roof: float | None) -> dict:
    """A train_step result as a campaign row. MFU against the dense bf16 peak and against the measured
    matmul rate (none on a CPU: its steps run fp32)."""
    tflops = r["tflops"] if device == "cuda" else None
    return {
        "backend": r["backend"],
        "layers": r["layers"],
        "micro_batch_size": r["mbs"],
        "microbatches": r["microbatches"],
        "tokens_per_s": r["tokens_per_s"],
        "tflops": r["tflops"],
        "mfu": tflops / peak if (tflops and peak) else None,
        "mfu_vs_matmul": tflops / roof if (tflops and roof) else None,
        "flops_per_token": r["flops_per_token"],
        "mem_gib": r["mem_gib"],
        "estimated_gib": r["estimated_gib"],
        "resident_gib": r["resident_gib"],
        "left_gib": r["left_gib"],
        "profile": r["profile"],
        "error": r["error"],
    }


def _is_default_tiles(path: str) -> bool:
    """Whether a tuned-tiles file holds its head dim's default configuration (no extra run needed)."""
    from diffmeg.kernels.triton_diff import TritonDiffConfig, default_config

    info = json.loads(Path(path).read_text())
    return TritonDiffConfig(**info["config"]) == default_config(info["head_dim"], interpreted=False)


def _arch(preset: str) -> str:
    return (
        "transformer"
        if preset.startswith("transformer-")
        else "diff2"
        if preset.startswith("diff2-")
        else "diff"
    )


def fit_layers(plan: Plan, device: str) -> int:
    """The most layers (of plan.train_layers) whose memory plan fits 85% of this GPU (DIFF and baseline)."""
    if device != "cuda":
        return plan.train_layers[-1]
    import torch

    from benchmarks import train_step
    from diffmeg.training.memory import estimate_memory

    free = 0.85 * torch.cuda.get_device_properties(0).total_memory
    for layers in plan.train_layers:
        opts = train_step.StepOptions(
            tokens_per_microbatch=plan.train_tokens_per_microbatch,
            microbatches=plan.train_microbatches,
            num_layers=layers,
        )
        need = max(
            estimate_memory(
                train_step.resolve_run_args(p, max(plan.train_seqs), opts, device), on_gpu=True
            ).total
            for p in (plan.train_diff, train_step.baseline_of(plan.train_diff))
        )
        if need <= free:
            return layers
    return plan.train_layers[-1]


class tuned_triton_tiles:
    """Within the block, the fused kernel uses the tiles the kernels phase found fastest (a JSON file)."""

    def __init__(self, path: str | None) -> None:
        self.path = path

    def __enter__(self):
        if self.path:
            from diffmeg.kernels import triton_diff

            info = json.loads(Path(self.path).read_text())
            triton_diff.set_tuned_config(info["head_dim"], triton_diff.TritonDiffConfig(**info["config"]))
        return self

    def __exit__(self, *exc) -> None:
        if self.path:
            from diffmeg.kernels import triton_diff

            triton_diff.set_tuned_config(None, None)
