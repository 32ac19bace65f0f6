"""The toy comparison's results (examples/toy_compare.sh, run through tools/toy_compare_results.py): the
model shapes it trains, results.json collected from its output directory, the learning rate chosen per model
and setting, and the markdown tables of docs/results.md. The figures are `diffmeg.eval.toy_compare_plots`.
The upcycling results (`diffmeg.eval.upcycle_results`) read their file and tabulate their validation loss
with the functions here.

What results.json holds, how a learning rate is chosen and what "steps to 90%" means: the tool's help
(`python tools/toy_compare_results.py --help`) and docs/results.md.
"""

from __future__ import annotations

import glob
import json
import math
import os
from collections import defaultdict
from statistics import fmean as mean

from diffmeg.errors import DiffmegError
from diffmeg.storage import write_json

TARGET = 0.9
"""The accuracy a run must reach to count as having learned the task (the issue's 90%)."""
MODEL_NAMES = {
    "diff": "DIFF V1", "diff2": "DIFF V2", "gda": "GDA 4:1 (V2 style)", "transformer": "Transformer"
}
SOURCE_COLUMNS = ("label", "iteration", "setting")
"""`diffmeg.eval.mqar_attention.table_rows` columns that become model, seed, step and the run's setting."""


def load(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise DiffmegError(f"cannot read results {path}: {exc}") from None


def read_metrics(path: str) -> list[dict]:
    """A run's metrics.jsonl (`--metrics-file`), one record per logged iteration."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def write_results(path: str, data: dict) -> None:
    """results.json as the committed docs/results/toy_compare.json is written (indent 1), atomically."""
    write_json(path, data, indent=1)


# ----------------------------------------------------------------------------------------------------
# Collecting a run directory


def _model_seed(label: str, path: str) -> tuple[str, int]:
    """(model, seed) from an analysis label MODEL-sSEED (examples/toy_compare.sh's --label)."""
    model, sep, seed = label.rpartition("-s")
    if not sep or not model or not seed.isdigit():
        raise DiffmegError(f"{path}: label {label!r} is not MODEL-sSEED, as examples/toy_compare.sh labels")
    return model, int(seed)


def collect_analyses(out: str) -> tuple[list[dict], list[dict]]:
    """(attention rows, outlier rows) from OUT/analysis/SETTING/{attention,outliers}/."""
    attention, outliers = [], []
    pattern = os.path.join(out, "analysis", "*", "attention", "mqar_attention.json")
    for path in sorted(glob.glob(pattern)):
        setting = os.path.basename(os.path.dirname(os.path.dirname(path)))
        from diffmeg.eval.mqar_attention import table_rows  # torch: only where there are analyses

        for r in load(path)["results"]:
            model, seed = _model_seed(r["label"], path)
            for row in table_rows([r]):  # label, iteration, setting, layer, normalised, the masses, ...
                where = {"model": model, "setting": setting, "seed": seed, "step": row["iteration"]}
                attention.append(where | {k: v for k, v in row.items() if k not in SOURCE_COLUMNS})
    pattern = os.path.join(out, "analysis", "*", "outliers", "activation_stats.json")
    for path in sorted(glob.glob(pattern)):
        setting = os.path.basename(os.path.dirname(os.path.dirname(path)))
        for ckpt in load(path)["checkpoints"]:
            model, seed = _model_seed(ckpt["label"], path)
            for kind, stats in sorted(ckpt["stats"].items()):
                outliers.append({"model": model, "setting": setting, "seed": seed, "kind": kind, **stats})
    return attention, outliers


def collect(out: str) -> dict:
    """results.json's content from a toy_compare.sh output directory (every finished run in it)."""
    mqar, positions, lm, runs = [], [], [], []
    for path in sorted(glob.glob(os.path.join(out, "mqar", "*", "*", "*", "run.json"))):
        run = load(path)
        here = os.path.dirname(path)
        key = {k: run[k] for k in ("model", "setting", "seed", "lr")}
        summary = os.path.join(here, "eval", "mqar_summary.json")
        final = None
        for r in load(summary)["results"] if os.path.isfile(summary) else []:
            split = r["data_prefix"].rsplit("-", 1)[-1]  # PREFIX-test / PREFIX-valid (make_mqar_data.py)
            if split in ("test", "valid"):
                mqar.append({**key, "step": r["iteration"], "accuracy": r["accuracy"], "split": split})
            if split == "test" and (final is None or r["iteration"] > final["iteration"]):
                final = r
        if final is not None:  # the final held-out accuracy by query index and by context pair
            by = {k: final[k] for k in ("by_query", "by_pair") if k in final}
            positions.append({**key, "step": final["iteration"], **by})
        runs.append(run)
    for path in sorted(glob.glob(os.path.join(out, "lm", "*", "*", "run.json"))):
        run = load(path)
        key = {k: run[k] for k in ("model", "seed")}
        for record in read_metrics(os.path.join(os.path.dirname(path), "metrics.jsonl")):
            if "validation_lm_loss" in record:
                tokens = record["iteration"] * run["tokens_per_iter"]
                lm.append({**key, "tokens": tokens, "val_loss": record["validation_lm_loss"]})
        runs.append(run)
    meta_path = os.path.join(out, "meta.json")
    meta = load(meta_path) if os.path.isfile(meta_path) else {}
    attention, outliers = collect_analyses(out)
    return {
        "meta": {**meta, "runs": runs},
        "mqar": mqar,
        "mqar_positions": positions,
        "lm": lm,
        "attention": attention,
        "outliers": outliers,
    }


PROTOCOL = (
    "settings", "lrs", "seeds", "mqar_iters", "mqar_batch", "eval_every", "eval_docs", "layers", "hidden",
    "vocab", "init_method_std", "lm_iters", "lm_eval_every", "lm_tokens_per_iter",
)
"""The meta keys two runs of the comparison must share to sit in one table: same data, budget and seeds."""
SOURCE_META = ("models", "date", "jobs", "threads_per_run")
ROW_KEYS = ("mqar", "mqar_positions", "lm", "attention", "outliers")


def merge(parts: list[dict], sources: list[str]) -> dict:
    """One results.json from runs of the same protocol over different models (a model added later, e.g.
    `TOY_MODELS=gda`), refused in one line when the protocols differ or a model is in two parts."""
    first, merged = parts[0]["meta"], {k: [] for k in ROW_KEYS}
    models: list[str] = []
    for part, source in zip(parts, sources, strict=True):
        meta = part["meta"]
        if meta.get("smoke"):
            raise DiffmegError(f"{source} is a smoke run (TOY_SMOKE=1); merge only full runs")
        differ = [k for k in PROTOCOL if meta.get(k) != first.get(k)]
        if differ:
            raise DiffmegError(
                f"{source} was run with other {', '.join(differ)} than {sources[0]} "
                f"({', '.join(f'{k} {meta.get(k)} vs {first.get(k)}' for k in differ)}): run it with the "
                "same TOY_* settings"
            )
        twice = sorted(set(meta["models"]) & set(models))
        if twice:
            raise DiffmegError(f"{source} holds {', '.join(twice)} again; merge each model from one run")
        models += meta["models"]
        for key in ROW_KEYS:
            merged[key] += part.get(key, [])
    meta = {k: first[k] for k in PROTOCOL if k in first} | {
        "models": model_order(models),
        "arch": {m: a for part in parts for m, a in part["meta"]["arch"].items()},
        "runs": [run for part in parts for run in part["meta"].get("runs", [])],
        "merged": [  # where each model's runs came from, and how they were run
            {"source": os.path.basename(src)} | {k: part["meta"].get(k) for k in SOURCE_META}
            for part, src in zip(parts, sources, strict=True)
        ],
    }
    return {"meta": meta, **merged}


# ----------------------------------------------------------------------------------------------------
# Selection and summaries


def final_rows(rows: list[dict], split: str) -> dict[tuple, dict]:
    """The last step of every (model, setting, lr, seed) run in `split`."""
    last: dict[tuple, dict] = {}
    for r in rows:
        if r.get("split", "test") != split:
            continue
        key = (r["model"], r["setting"], r["lr"], r["seed"])
        if key not in last or r["step"] > last[key]["step"]:
            last[key] = r
    return last


def sweep_seed(results: dict) -> int:
    """The seed that sweeps the learning rates: the run's first seed, else the smallest validated one."""
    seeds = results.get("meta", {}).get("seeds")
    if seeds:
        return seeds[0]
    validated = [r["seed"] for r in results["mqar"] if r.get("split") == "valid"]
    if not validated:
        raise DiffmegError("no validation rows (split 'valid'): the learning rate cannot be chosen")
    return min(validated)


def sweep(results: dict) -> dict[tuple[str, str], dict[float, float]]:
    """(model, setting) -> lr -> the sweep seed's final validation accuracy."""
    seed = sweep_seed(results)
    out: dict[tuple[str, str], dict[float, float]] = defaultdict(dict)
    for (model, setting, lr, s), r in final_rows(results["mqar"], "valid").items():
        if s == seed:
            out[(model, setting)][lr] = r["accuracy"]
    return out


def best_lrs(results: dict) -> dict[tuple[str, str], float]:
    """(model, setting) -> the learning rate with the best final validation accuracy of the sweep seed
    (ties: the smaller rate)."""
    return {key: max(sorted(by_lr), key=lambda lr: by_lr[lr]) for key, by_lr in sweep(results).items()}


def steps_to(rows: list[dict], target: float = TARGET) -> int | None:
    """The first step at which a run's held-out accuracy reaches `target` (rows of one run)."""
    hits = [r["step"] for r in rows if r["accuracy"] >= target]
    return min(hits) if hits else None


def curves(results: dict) -> dict[tuple[str, str], dict[int, list[dict]]]:
    """(model, setting) -> seed -> held-out rows by step, at the chosen learning rate only."""
    chosen = best_lrs(results)
    out: dict[tuple[str, str], dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in results["mqar"]:
        if r.get("split", "test") == "test" and chosen.get((r["model"], r["setting"])) == r["lr"]:
            out[(r["model"], r["setting"])][r["seed"]].append(r)
    for seeds in out.values():
        for rows in seeds.values():
            rows.sort(key=lambda r: r["step"])
    return out


def model_order(names, known=tuple(MODEL_NAMES)) -> list[str]:
    return sorted(set(names), key=lambda n: (known.index(n) if n in known else len(known), n))


def setting_order(results: dict, rows: list[dict] | None = None) -> list[str]:
    """The settings of `rows` (default: the MQAR rows): those the run declared in its order, then the others
    sorted."""
    found = {r["setting"] for r in (results["mqar"] if rows is None else rows)}
    declared = results.get("meta", {}).get("settings") or []
    return [s for s in declared if s in found] + sorted(found - set(declared))


def spread(values: list[float], digits: int = 3) -> str:
    """mean (min-max) of the seeds, or the one value."""
    if not values:
        return "-"
    middle = sum(values) / len(values)
    if len(values) == 1:
        return f"{middle:.{digits}f}"
    return f"{middle:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def format_lr(lr: float) -> str:
    return f"{lr:g}"


def mqar_table(results: dict) -> str:
    """Per setting and model: chosen lr, seeds, final held-out accuracy, steps to 90% per seed."""
    chosen = best_lrs(results)
    runs = curves(results)
    lines = [
        "| setting | model | lr | seeds | final accuracy, mean (min-max) | steps to 90% per seed |",
        "|---|---|---|---|---|---|",
    ]
    for setting in setting_order(results):
        for model in model_order(m for m, s in runs if s == setting):
            seeds = runs[(model, setting)]
            finals = [rows[-1]["accuracy"] for _, rows in sorted(seeds.items())]
            reached = [steps_to(rows) for _, rows in sorted(seeds.items())]
            to90 = ", ".join("-" if s is None else str(s) for s in reached)
            name = MODEL_NAMES.get(model, model)
            lr = format_lr(chosen[(model, setting)])
            lines.append(f"| {setting} | {name} | {lr} | {len(seeds)} | {spread(finals)} | {to90} |")
    return "\n".join(lines)


def lr_table(results: dict) -> str:
    """The sweep: the sweep seed's final validation accuracy per (setting, model, lr)."""
    scores = sweep(results)
    lrs = sorted({lr for by_lr in scores.values() for lr in by_lr})
    lines = ["| setting | model | " + " | ".join(f"lr {format_lr(lr)}" for lr in lrs) + " |"]
    lines.append("|---|---|" + "---|" * len(lrs))
    for setting in setting_order(results):
        for model in model_order(m for m, s in scores if s == setting):
            by_lr = scores[(model, setting)]
            cells = ["-" if lr not in by_lr else f"{by_lr[lr]:.3f}" for lr in lrs]
            lines.append(f"| {setting} | {MODEL_NAMES.get(model, model)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def val_loss_table(rows: list[dict], names: dict[str, str] = MODEL_NAMES, columns: int = 5) -> str:
    """Validation loss by tokens seen, mean (min-max) over seeds, at up to `columns` evaluation points, from
    rows of model, seed, tokens and val_loss; `names`: how the models are named, in order ("": no rows)."""
    by_model: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        by_model[r["model"]][r["tokens"]].append(r["val_loss"])
    tokens = sorted({t for points in by_model.values() for t in points})
    if not tokens:
        return ""
    if len(tokens) > columns:  # evenly spaced, always the last
        step = (len(tokens) - 1) / (columns - 1)
        tokens = sorted({tokens[round(i * step)] for i in range(columns)})
    lines = ["| model | seeds | " + " | ".join(f"{t:,} tokens" for t in tokens) + " |"]
    lines.append("|---|---|" + "---|" * len(tokens))
    for model in model_order(by_model, tuple(names)):
        points = by_model[model]
        seeds = len({r["seed"] for r in rows if r["model"] == model})
        cells = [spread(points.get(t, [])) for t in tokens]
        lines.append(f"| {names.get(model, model)} | {seeds} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def attention_table(results: dict) -> str:
    """Per setting, model and layer: the normalised pair and noise masses at the answers, mean (min-max)
    over the analysed seeds; the ratio of those means ("-" where the noise cancels to <= 0); the raw
    masses and lambda, means over seeds."""
    groups: dict[tuple, dict[bool, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in results["attention"]:
        groups[(r["setting"], r["model"], r["layer"])][r["normalised"]].append(r)
    lines = [
        "| setting | model | layer | seeds | pair | noise | pair / noise | raw pair | raw noise | lambda |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for setting in setting_order(results, results["attention"]):
        for model in model_order(m for s, m, _ in groups if s == setting):
            for layer in sorted(ly for s, m, ly in groups if (s, m) == (setting, model)):
                scales = groups[(setting, model, layer)]
                norm, raw = scales[True], scales[False]
                pair, noise = mean([r["pair_mass"] for r in norm]), mean([r["noise_mass"] for r in norm])
                lambdas = [r["lambda"] for r in norm if r["lambda"] is not None]
                cells = [
                    setting,
                    MODEL_NAMES.get(model, model),
                    str(layer),
                    str(len({r["seed"] for r in norm})),
                    spread([r["pair_mass"] for r in norm]),
                    spread([r["noise_mass"] for r in norm]),
                    f"{pair / noise:.2f}" if noise > 0 else "-",
                    f"{mean([r['pair_mass'] for r in raw]):.3f}" if raw else "-",
                    f"{mean([r['noise_mass'] for r in raw]):.3f}" if raw else "-",
                    f"{mean(lambdas):.3f}" if lambdas else "-",
                ]
                lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


OUTLIER_KINDS = ("attention_logits", "hidden_states")


def outliers_table(results: dict) -> str:
    """Per setting, model and kind (attention logits, hidden states): top-1 magnitude and kurtosis, mean
    (min-max) over seeds; top-10, median and top-1 / median, means over seeds."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in results["outliers"]:
        if r["kind"] in OUTLIER_KINDS:
            groups[(r["setting"], r["model"], r["kind"])].append(r)
    lines = [
        "| setting | model | kind | seeds | top-1 | top-10 | median | top-1 / median | kurtosis |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for setting in setting_order(results, results["outliers"]):
        for model in model_order(m for s, m, _ in groups if s == setting):
            for kind in OUTLIER_KINDS:
                rows = groups.get((setting, model, kind))
                if not rows:
                    continue
                cells = [
                    setting,
                    MODEL_NAMES.get(model, model),
                    kind.replace("_", " "),
                    str(len(rows)),
                    spread([r["top1"] for r in rows], 2),
                    f"{mean([r['top10'] for r in rows]):.2f}",
                    f"{mean([r['median'] for r in rows]):.3f}",
                    f"{mean([r['top1'] / r['median'] if r['median'] > 0 else math.nan for r in rows]):.1f}",
                    spread([r["kurtosis"] for r in rows], 1),
                ]
                lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tables(results: dict) -> str:
    parts = []
    if results["mqar"]:
        parts += ["### MQAR: held-out accuracy at the chosen learning rate", "", mqar_table(results), ""]
        title = f"### MQAR: learning-rate sweep (final validation accuracy, seed {sweep_seed(results)})"
        parts += [title, "", lr_table(results), ""]
    if results["lm"]:
        parts += ["### Language modelling: validation loss", "", val_loss_table(results["lm"]), ""]
    if results.get("attention"):
        title = "### MQAR: attention at the answers on the queried pair vs the rest of the context"
        parts += [title, "", attention_table(results), ""]
    if results.get("outliers"):
        parts += ["### MQAR: activation outliers on the held-out documents", "", outliers_table(results), ""]
    return "\n".join(parts)


# ----------------------------------------------------------------------------------------------------
# Model shapes


def model_flags(dry_run: dict, layers: int, hidden: int) -> str:
    """pretrain_diff.py flags for a preset's architecture at another depth and width.

    `dry_run` is `pretrain_diff.py --model <preset> --dry-run`'s JSON. The head size is kept and the
    head and KV-group counts scale with the width, so the presets' DIFF / Transformer pairing (identical
    projections) holds at every size; the SwiGLU width is 8/3 of the hidden size (as the presets').
    A grouped preset (fewer noise than signal heads) keeps its grouping instead: r signal heads per noise
    head and the preset's noise heads per KV head; where the width holds fewer than one noise group at the
    preset's head size, the head size shrinks to fit one (gda-tiny at hidden 64: 4 signal heads of 16
    over 1 noise head and 1 KV head), since r:1 is what the row compares.
    """
    m = dry_run["model"]
    scale = hidden / m["hidden_size"]
    heads, groups = m["num_attention_heads"] * scale, m["num_query_groups"] * scale
    noise = m.get("num_noise_heads") or m["num_attention_heads"]
    ffn = max(64, int(4 * hidden * 2 / 3 / 64) * 64)
    size = f"--model {m['preset']} --num-layers {layers} --hidden-size {hidden}"
    if noise < m["num_attention_heads"]:
        ratio, per_kv = m["num_attention_heads"] // noise, noise // m["num_query_groups"]
        n = max(per_kv, round(noise * scale))
        head_dim = hidden / (ratio * n)
        if head_dim != int(head_dim):
            raise DiffmegError(
                f"hidden {hidden} cannot hold {m['preset']}'s {ratio}:1 grouping ({ratio * n} signal heads "
                f"over {n} noise heads); pick a multiple of {ratio * per_kv} signal heads' width"
            )
        return (
            f"{size} --num-attention-heads {ratio * n} --num-noise-heads {n} "
            f"--num-query-groups {n // per_kv} --kv-channels {int(head_dim)} --ffn-hidden-size {ffn}"
        )
    if heads != int(heads) or groups != int(groups) or heads < 1 or groups < 1:
        raise DiffmegError(
            f"hidden {hidden} cannot scale {m['preset']}'s {m['num_attention_heads']} heads and "
            f"{m['num_query_groups']} KV groups of {m['head_dim']} at hidden {m['hidden_size']}; "
            "pick a multiple of the preset's width per head"
        )
    return (
        f"{size} --num-attention-heads {int(heads)} --num-query-groups {int(groups)} "
        f"--kv-channels {m['head_dim']} --ffn-hidden-size {ffn}"
    )
