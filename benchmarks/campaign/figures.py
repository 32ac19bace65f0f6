"""The campaign's headline figures, derived from its rows (pure functions, unit-tested)."""

from __future__ import annotations


def throughput_ratio(
    rows: list[dict], seq: int, levers: list[dict] = ()
) -> tuple[float | None, float | None]:
    """(DIFF V1 tokens/s / Transformer tokens/s, FLOP bound of the measured models) at this length: the
    interleaved comparison of their fast paths where the file has one (its gain, median over median);
    files before it: the best DIFF V1 row over the first Transformer row (rows of a variant left out)."""
    for lv in levers:
        pair = (lv.get("on_model") or "", lv.get("off_model") or "")
        fast = lv.get("on_label") == "fast path" and lv.get("kind") == "ratio" and bool(lv.get("gain"))
        if fast and lv["seq"] == seq and pair[0].startswith("diff-") and pair[1].startswith("transformer-"):
            on, off = (_row_of(rows, lv[f"{side}_model"], seq, lv[f"{side}_flags"]) for side in ("on", "off"))
            bound = off["flops_per_token"] / on["flops_per_token"] if on and off else None
            return lv["gain"], bound
    if any("windows" in r for r in rows):  # this design: the comparison or nothing (not yet measured)
        return None, None

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


def _row_of(rows: list[dict], model: str, seq: int, flags: list[str]) -> dict | None:
    """The train row of one variant (model, length, flags) holding its FLOPs a token."""
    for r in rows:
        if r["model"] == model and r["seq"] == seq and r.get("flags") == flags and r.get("flops_per_token"):
            return r
    return None


def preset_flops_per_token(p: dict, layers: int, seq: int, causal: bool = True) -> float:
    """Forward FLOPs per token of preset `p` (a `diffmeg.presets` entry) at `layers` layers and `seq`
    tokens; `causal` False counts attention as the full square (Megatron-LM's MFU convention)."""
    from diffmeg.training.flops import forward_flops_per_token

    return forward_flops_per_token(
        num_layers=layers,
        hidden_size=p["hidden_size"],
        ffn_hidden_size=p["ffn_hidden_size"],
        num_attention_heads=p["num_attention_heads"],
        num_query_groups=p.get("num_query_groups") or p["num_attention_heads"],
        kv_channels=p["kv_channels"],
        seq_length=seq,
        vocab_size=p["vocab_size"],
        diff_attention=p["diff_attention"],
        diff_version=p.get("diff_version", 1),
        num_noise_heads=p.get("num_noise_heads"),
        causal=causal,
    ).total


def flop_bound(diff_preset: str, seq: int) -> float:
    """Transformer FLOPs / DIFF FLOPs per token of the full presets (DESIGN.md: 0.956 at 4K for 3B)."""
    from benchmarks.train_step import baseline_of
    from diffmeg.presets import get_preset

    def per_token(name: str) -> float:
        p = get_preset(name)
        return preset_flops_per_token(p, p["num_layers"], seq)

    return per_token(baseline_of(diff_preset)) / per_token(diff_preset)


def headlines(result: dict) -> dict:
    """The top-level figures of a results object, from the rows it holds: computed by the parent after
    every phase, so a phase killed at its budget keeps the figures of the rows it wrote."""
    out: dict = {}
    train = result.get("train") or []
    if train:
        for key, seq in (("4k", 4096), ("2k", 2048)):
            ratio, bound = throughput_ratio(train, seq, result.get("levers") or [])
            out[f"diff_vs_transformer_ratio_{key}"], out[f"flop_bound_{key}"] = ratio, bound
        out["flop_bound_3b_4k"] = flop_bound("diff-3b", 4096)
    return out
