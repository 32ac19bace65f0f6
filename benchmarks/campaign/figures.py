"""The campaign's headline figures, derived from its rows (pure functions, unit-tested)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path


def fused_speedup(rows: list[dict], seq: int, head_dim: int) -> float | None:
    """Best unfused DIFF fwd+bwd time / best correct fused Triton fwd+bwd time at this length."""
    from benchmarks.attention import TRITON, UNFUSED

    def best(pred: Callable[[dict], bool]) -> float | None:
        times = [
            r["fwd_bwd_ms"]
            for r in rows
            if r["seq"] == seq
            and r["head_dim"] == head_dim
            and pred(r)
            and r.get("fwd_bwd_ms")
            and not r["error"]
        ]
        return min(times) if times else None

    unfused = best(lambda r: r["impl"] in UNFUSED)
    fused = best(lambda r: r["impl"].startswith(TRITON) and r.get("correct") is not False)
    return unfused / fused if unfused and fused else None


def best_triton(rows: list[dict], seq: int, head_dim: int) -> dict | None:
    """The fastest correct fused-Triton row at this length and head dim."""
    from benchmarks.attention import TRITON

    ok = [
        r
        for r in rows
        if r["impl"].startswith(TRITON)
        and r["seq"] == seq
        and r["head_dim"] == head_dim
        and not r["error"]
        and r.get("correct") is not False
        and r.get("fwd_bwd_ms")
    ]
    return min(ok, key=lambda r: r["fwd_bwd_ms"]) if ok else None


def throughput_ratio(rows: list[dict], seq: int) -> tuple[float | None, float | None]:
    """(best DIFF V1 tokens/s / Transformer tokens/s, FLOP bound of the measured models) at this length;
    rows of a variant (the distributed optimizer, with or without overlap) are not the comparison's."""

    def usable(r: dict, arch: str) -> bool:
        return r["seq"] == seq and r["arch"] == arch and bool(r["tokens_per_s"]) and not r["error"]

    diff = [r for r in rows if usable(r, "diff") and not r.get("variant")]
    base = [r for r in rows if usable(r, "transformer") and not r.get("variant")]
    if not diff or not base:
        return None, None
    best = max(diff, key=lambda r: r["tokens_per_s"])
    return best["tokens_per_s"] / base[0]["tokens_per_s"], base[0]["flops_per_token"] / best[
        "flops_per_token"
    ]


def flop_bound(diff_preset: str, seq: int) -> float:
    """Transformer FLOPs / DIFF FLOPs per token of the full presets (DESIGN.md: 0.956 at 4K for 3B)."""
    from benchmarks.train_step import baseline_of
    from diffmeg.presets import get_preset
    from diffmeg.training.flops import forward_flops_per_token

    def per_token(name: str) -> float:
        p = get_preset(name)
        return forward_flops_per_token(
            num_layers=p["num_layers"],
            hidden_size=p["hidden_size"],
            ffn_hidden_size=p["ffn_hidden_size"],
            num_attention_heads=p["num_attention_heads"],
            num_query_groups=p.get("num_query_groups") or p["num_attention_heads"],
            kv_channels=p["kv_channels"],
            seq_length=seq,
            vocab_size=p["vocab_size"],
            diff_attention=p["diff_attention"],
        ).total

    return per_token(baseline_of(diff_preset)) / per_token(diff_preset)


def kept_triton_best(results_dir: Path, device: str) -> dict | None:
    """triton_best of the newest results file from this GPU model (a kernels phase of an earlier command)."""
    found = []
    for path in results_dir.glob("*.json"):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and data.get("device") == device and data.get("triton_best"):
            found.append((data.get("date", ""), data["triton_best"]))
    return max(found, key=lambda x: x[0])[1] if found else None


def headlines(result: dict, head_dim: int) -> dict:
    """The top-level figures of a results object, from the rows it holds: computed by the parent after
    every phase, so a phase killed at its budget keeps the figures of the rows it wrote."""
    from benchmarks.attention import TRITON

    out: dict = {}
    attention, train = result.get("attention") or [], result.get("train") or []
    if attention:
        out["fused_speedup_vs_best_unfused_4k"] = fused_speedup(attention, 4096, head_dim)
        best = best_triton(attention, 4096, head_dim)
        configs = {c["label"]: c.get("config") for c in result.get("triton_candidates") or []}
        label = best["impl"][len(TRITON) + 1 :] if best else None
        out["triton_best"] = (
            {"label": label, "head_dim": head_dim, "config": configs[label]} if label in configs else None
        )
    if train:
        for key, seq in (("4k", 4096), ("2k", 2048)):
            ratio, bound = throughput_ratio(train, seq)
            out[f"diff_vs_transformer_ratio_{key}"], out[f"flop_bound_{key}"] = ratio, bound
        out["flop_bound_3b_4k"] = flop_bound("diff-3b", 4096)
    return out
