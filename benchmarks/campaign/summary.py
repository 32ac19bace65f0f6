"""The short table a campaign command prints at its end."""

from __future__ import annotations


def summary_lines(result: dict) -> list[str]:
    """The short table printed at the end of a run."""
    out = [
        f"campaign {result['date']}: {result['device']} "
        f"({result['device_type']}{', smoke' if result['smoke'] else ''}),"
        f" git {result['git_revision'][:12]}{' (dirty)' if result['git_dirty'] else ''}"
        f" ({result.get('git_source') or 'git'})"
    ]
    for phase, info in result["phases"].items():
        if info["status"] != "not run":
            secs = f"{info['seconds']:.0f}s" if info.get("seconds") is not None else ""
            earlier = (result.get("continues") or ["the continued file"])[-1]
            reused = f"{info['reused']} runs of {earlier} reused " if "reused" in info else ""
            out.append(f"  {phase:8s} {info['status']:8s} {secs:>6}  {reused}{info.get('error') or ''}")
    fmt = lambda v, f="{:.3g}": "-" if v is None else f.format(v)  # noqa: E731
    out.append(
        f"bf16 matmul TFLOP/s: {fmt(result['bf16_matmul_tflops'])} measured, "
        f"{fmt(result.get('peak_bf16_tflops'))} dense peak (the MFU denominator)"
    )
    if result["tests"]:
        t = result["tests"]
        out.append(
            f"gpu tests: {t['passed']} passed, {t['failed']} failed, {t['errors']} errors, "
            f"{t['skipped']} skipped"
        )
        out.extend(f"  FAILED {name}" for name in t["failures"][:10])
    at4k = [r for r in result["attention"] if r["seq"] == 4096 and r["head_dim"] == 128]
    for r in at4k:
        out.append(
            f"attention 4K {r['impl']:44s} fwd+bwd {fmt(r.get('fwd_bwd_ms'), '{:.2f}')} ms "
            f"{fmt(r['tflops'], '{:.0f}')} TF/s {r['error'] or ''}"
        )
    for r in result["train"]:
        impl = f"{r['impl']} {r['variant']}" if r.get("variant") else r["impl"]
        out.append(
            f"train {r['model']:16s} {impl:24s} s{r['seq']:<5d} "
            f"tokens/s {fmt(r['tokens_per_s'], '{:.0f}')}  MFU {fmt(r['mfu'], '{:.1%}')}"
            f" ({fmt(r.get('mfu_vs_matmul'), '{:.1%}')} of matmul) {r['error'] or ''}"
        )
    for r in result.get("levers") or []:
        out.append(
            f"lever {r['lever']:28s} {r['model']:12s} s{r['seq']:<5d} gain {fmt(r['gain'], '{:.3f}')}x "
            f"({fmt(r['on_tokens_per_s'], '{:.0f}')} / {fmt(r['off_tokens_per_s'], '{:.0f}')} tokens/s) "
            f"{r['error'] or ''}"
        )
    for key in ("4k", "2k"):
        ratio, bound = result[f"diff_vs_transformer_ratio_{key}"], result[f"flop_bound_{key}"]
        if ratio is not None:
            out.append(f"DIFF/Transformer tokens/s at {key}: {ratio:.3f} (FLOP bound {fmt(bound)})")
    for r in result["memory"]:
        out.append(
            f"memory {r['layout']}: estimated {fmt(r['estimated_gib'])} GiB, measured "
            f"{fmt(r['measured_gib'])} GiB {r['error'] or ''}"
        )
    for r in result["gpu_train_run"]:
        out.append(
            f"run {r['model']}: {r['iterations']} it, loss {fmt(r['loss_first'])} -> {fmt(r['loss_last'])},"
            f" resume exact {r['resume_exact']} (all equal {r.get('resume_all_equal')}),"
            f" generation ok {r['generation_ok']} {r['error'] or ''}"
        )
    return out
