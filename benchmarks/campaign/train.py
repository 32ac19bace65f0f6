"""Phase `train`: tokens/s and MFU of a 3B-wide model cut to what fits, DIFF against the Transformer.

Each model is pretrain_diff.py's Trainer on mock data, built by benchmarks/train_step.py and timed by its
own `Trainer.train_step`, megatron-core's fusions compiled by TorchDynamo on a GPU (the runner leaves it
on for this phase there). MFU is reported against the GPU's dense bf16 peak (`mfu`, the field's
definition, which the 45% goal uses) and against the matmul rate the env phase measured
(`mfu_vs_matmul`), and with attention counted as the full square (`mfu_full_square`, Megatron-LM's
convention). With `Plan.train_profile` each row at the first length runs one more step under
torch.profiler: its `profile` says where the step's time goes. After the first length's rows comes the
lever matrix (`Plan.train_levers`: each lever's off twin, then its on run, in this one process; a twin
timed before is reused) and its `levers` rows with each gain; on a GPU then the full-depth rows
(`Plan.train_full_depth`). The distributed optimizer and overlap are levers there: on one GPU DP is 1,
so overlap can only show its overhead, never its gain.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.campaign.part import Part
from benchmarks.campaign.plan import DIST_OPT, OVERLAP, FullDepth, Plan, device_of

OVERLAP_ARGS = OVERLAP
"""pretrain_diff.py's overlapped data-parallel communication (Megatron-LM's flags; docs/recipes.md)."""
VARIANTS = {
    "dist-opt": DIST_OPT,
    "dist-opt+overlap": (*DIST_OPT, *OVERLAP_ARGS),
}
VARIANT_NOTE = "one GPU: DP=1, so overlap can only show its overhead here, not its gain"


def phase_train(a: argparse.Namespace, part: Part, deadline: float, plan: Plan) -> None:
    import torch

    from benchmarks import train_step
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
    runs: list[tuple[str, str | None]] = [(base, None)]
    runs += [(plan.train_diff, b) for b in backends]
    if v2 in PRESETS:  # DIFF V2 (attention by megatron-core's own core): its presets are diff2-*
        runs.append((v2, None))
    compiled = not torch._dynamo.config.disable
    print(f"TorchDynamo (megatron-core's fusions compiled): {compiled}", flush=True)
    print(train_step.format_header(), flush=True)
    timer = _Timer(a, part, deadline, plan, device, layers, tiles, compiled)
    for i, seq in enumerate(plan.train_seqs):
        for preset, backend in runs:
            impl = backend or ("baseline" if preset == base else "auto")
            row = {"model": preset, "impl": impl, "seq": seq, "variant": None}
            flags = ("--diff-attn-backend", backend) if backend and backend != "triton-tuned" else ()
            timer.run(
                row, preset, flags, profile=plan.train_profile and i == 0, tuned=backend == "triton-tuned"
            )
        if i == 0:  # the headline figures before the second length: a short budget skips that one
            lever_matrix(timer, plan, seq)
            if plan.train_full_depth and device == "cuda":
                full_depth(timer, plan.train_full_depth)
    train_step.close_process()


class _Timer:
    """Runs one model for the train phase, writes its row, and remembers its result by (model, seq, flags,
    layers) so the lever matrix reuses a twin the rows above already timed."""

    def __init__(self, a, part: Part, deadline: float, plan: Plan, device: str, layers: int, tiles, compiled):
        self.a, self.part, self.deadline, self.plan, self.device = a, part, deadline, plan, device
        self.layers, self.tiles, self.compiled = layers, tiles, compiled
        self.done: dict[tuple, dict] = {}

    def run(
        self,
        row: dict,
        preset: str,
        flags: tuple[str, ...],
        *,
        profile: bool = False,
        tuned: bool = False,
        layers: int | None = None,
        microbatches: int | None = None,
        seq: int | None = None,
    ) -> dict:
        """The result of `preset` with `flags` (timed now unless timed before), its row added when timed."""
        import torch

        from benchmarks import step_profile, train_step

        seq = seq or row["seq"]
        layers = layers or self.layers
        key = (preset, seq, tuple(flags), layers, microbatches, tuned)
        if key in self.done:
            return self.done[key]
        row = {**row, "arch": _arch(preset), "torch_compile": self.compiled}
        if time.monotonic() > self.deadline:
            self.part.add(
                "train", {**row, "tokens_per_s": None, "mfu": None, "error": "skipped: time budget"}
            )
            self.part.set(_status="partial", _error="some runs skipped: time budget")
            return {"tokens_per_s": None, "error": "skipped: time budget", "step_s": None}
        opts = train_step.StepOptions(
            tokens_per_microbatch=self.plan.train_tokens_per_microbatch,
            microbatches=microbatches or self.plan.train_microbatches,
            warmup=self.plan.train_warmup,
            iters=self.plan.train_iters,
            vocab_size=self.plan.vocab_size,
            diff_attn_backend="triton" if tuned else None,
            num_layers=layers,
            extra_args=list(flags),
            profile=profile,
            time_optimizer=microbatches is not None,
        )
        with tuned_triton_tiles(self.tiles if tuned else None):
            r = train_step.run_one(preset, seq, opts, self.device)
        print(train_step.format_row(r, self.a.peak if self.device == "cuda" else None), flush=True)
        if r["profile"]:
            print(f"  one step: {step_profile.format_share(r['profile'])}", flush=True)
        self.part.add("train", {**row, **train_row(r, self.device, self.a.peak, self.a.roof)})
        if self.device == "cuda":
            torch.cuda.empty_cache()
        self.done[key] = r
        return r


def lever_matrix(timer: _Timer, plan: Plan, seq: int) -> None:
    """Each lever's off twin then its on run at `seq` (a twin timed before is reused), and a `levers` row
    with the gain: tokens/s on over off."""
    base = timer.plan.train_diff
    models = {"diff": base, "transformer": _baseline(base)}
    for lever in plan.train_levers:
        preset = models[lever.arch]
        results = {}
        for state, flags in (("off", lever.off), ("on", lever.on)):
            row = {"model": preset, "impl": "lever", "seq": seq, "variant": f"{lever.name}: {state}"}
            if lever.note:
                row["note"] = lever.note
            results[state] = timer.run(row, preset, flags)
        off, on = results["off"], results["on"]
        ok = off["tokens_per_s"] and on["tokens_per_s"]
        timer.part.add("levers", {
            "lever": lever.name, "model": preset, "seq": seq, "on": list(lever.on), "off": list(lever.off),
            "off_tokens_per_s": off["tokens_per_s"], "on_tokens_per_s": on["tokens_per_s"],
            "gain": on["tokens_per_s"] / off["tokens_per_s"] if ok else None,
            "error": None if ok else (on["error"] or off["error"]), "note": lever.note,
        })  # fmt: skip


def full_depth(timer: _Timer, full: FullDepth) -> None:
    """The full model where its memory plan fits; else each fallback cut and a straight-line fit of the
    step time over layers, extrapolated to full depth (`fit` rows)."""
    from diffmeg.presets import get_preset

    for preset in full.models:
        total = get_preset(preset)["num_layers"]
        fits = _fits(timer.plan, preset, full, total, timer.device)
        cuts = [total] if fits else list(full.fallback_layers)
        measured = []
        for layers in cuts:
            row = {"model": preset, "impl": "full-depth" if fits else f"cut {layers}", "seq": full.seq,
                   "variant": f"full depth, {full.microbatches} micro-batches"}  # fmt: skip
            r = timer.run(row, preset, (), layers=layers, microbatches=full.microbatches, seq=full.seq)
            if r.get("step_s"):
                measured.append((layers, r))
            _amortize(timer.part, r, full.amortize_dp)
        if not fits and len(measured) >= 2:
            timer.part.add("train", fitted_row(preset, full, total, measured))


def fitted_row(preset: str, full: FullDepth, total: int, measured: list[tuple[int, dict]]) -> dict:
    """A row for `total` layers from the step times of two or more cuts (a straight line over layers)."""
    (l0, r0), (l1, r1) = measured[0], measured[-1]
    slope = (r1["step_s"] - r0["step_s"]) / (l1 - l0)
    step_s = r0["step_s"] + slope * (total - l0)
    tokens = r0["tokens_per_s"] * r0["step_s"]
    return {
        "model": preset, "impl": "fit", "seq": full.seq, "arch": _arch(preset), "layers": total,
        "variant": f"fit over {l0} and {l1} layers", "tokens_per_s": tokens / step_s, "mfu": None,
        "error": None,
    }  # fmt: skip


def _amortize(part: Part, r: dict, dp: int) -> None:
    """The last row's tokens/s with its optimizer step as a `dp`-way distributed optimizer sees it."""
    opt_s = r.get("optimizer_s")
    if not (r.get("step_s") and opt_s is not None):
        return
    rows = part.data["train"]
    tokens = r["tokens_per_s"] * r["step_s"]
    rows[-1]["optimizer_s"] = opt_s
    rows[-1]["tokens_per_s_amortized"] = tokens / (r["step_s"] - opt_s + opt_s / dp)
    rows[-1]["amortize_dp"] = dp
    part.save()


def _baseline(preset: str) -> str:
    from benchmarks import train_step

    return train_step.baseline_of(preset) or preset


def _fits(plan: Plan, preset: str, full: FullDepth, layers: int, device: str) -> bool:
    """Whether `layers` of `preset` at the full-depth shape fit 85% of this GPU by the memory plan."""
    import torch

    from benchmarks import train_step
    from diffmeg.training.memory import estimate_memory
    from diffmeg.training.run_config import RunConfig

    opts = train_step.StepOptions(
        tokens_per_microbatch=plan.train_tokens_per_microbatch,
        microbatches=full.microbatches,
        num_layers=layers,
    )
    run = RunConfig.from_args(train_step.resolve_run_args(preset, full.seq, opts, device))
    return estimate_memory(run, on_gpu=True).total <= 0.85 * torch.cuda.get_device_properties(0).total_memory


def train_row(r: dict, device: str, peak: float | None, roof: float | None) -> dict:
    """A train_step result as a campaign row. MFU against the dense bf16 peak (causal half square, ours,
    and `mfu_full_square`, Megatron-LM's convention) and against the measured matmul rate (none on a CPU:
    its steps run fp32)."""
    tflops = r["tflops"] if device == "cuda" else None
    full = r.get("tflops_full_square") if device == "cuda" else None
    return {
        "backend": r["backend"],
        "layers": r["layers"],
        "micro_batch_size": r["mbs"],
        "microbatches": r["microbatches"],
        "tokens_per_s": r["tokens_per_s"],
        "tflops": r["tflops"],
        "mfu": tflops / peak if (tflops and peak) else None,
        "mfu_full_square": full / peak if (full and peak) else None,
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
    from diffmeg.training.run_config import RunConfig

    free = 0.85 * torch.cuda.get_device_properties(0).total_memory
    for layers in plan.train_layers:
        opts = train_step.StepOptions(
            tokens_per_microbatch=plan.train_tokens_per_microbatch,
            microbatches=plan.train_microbatches,
            num_layers=layers,
        )
        need = max(
            estimate_memory(
                RunConfig.from_args(train_step.resolve_run_args(p, max(plan.train_seqs), opts, device)),
                on_gpu=True,
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
