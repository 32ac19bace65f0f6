r"""The toy comparison's results (examples/toy_compare.sh): collect them, choose learning rates, make tables.

    python tools/toy_compare_results.py collect runs/toy_compare          # -> results.json + plots
    python tools/toy_compare_results.py best-lr runs/toy_compare --model diff --setting kv16
    python tools/toy_compare_results.py tables docs/results/toy_compare.json > tables.md

results.json holds `mqar` rows {model, setting, seed, lr, step, accuracy, split} (split "test": the
held-out test set; "valid": the validation set, whose final step chooses the learning rate; both at
every saved step), `mqar_positions` rows {model, setting, seed, lr, step, by_query, by_pair} (the final
held-out accuracy by query index and by the queried pair's place in the context) and `lm` rows {model,
seed, tokens, val_loss}, plus `meta` (how it was run). From the analyses of the final checkpoints
(OUT/analysis/SETTING/, labels MODEL-sSEED): `attention` rows {model, setting, seed, step, layer,
normalised, pair_mass, noise_mass, query_mass, ratio, lambda} (tools/eval_mqar.py --attention: mass at
the answers on the queried pair vs the rest of the context, mean over heads; normalised: DIFF's rows
divided by 1 - lambda) and `outliers` rows {model, setting, seed, kind, top1, top2, top3, top10, top100,
median, kurtosis, count} (tools/activation_stats.py on the held-out documents).

A model's learning rate for a setting is the one with the highest final validation accuracy of the first
seed, which sweeps them all (ties: the smaller rate); its tables and curves use only runs at that rate.
Steps to 90% is the first saved step whose held-out accuracy is >= 0.9 ("-" if none). The markdown
tables are what docs/results.md shows, generated from the committed docs/results/toy_compare.json.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from diffmeg.errors import DiffmegError, cli_errors  # noqa: E402

TARGET = 0.9
"""The accuracy a run must reach to count as having learned the task (the issue's 90%)."""
MODEL_NAMES = {"diff": "DIFF V1", "diff2": "DIFF V2", "transformer": "Transformer"}
SOURCE_COLUMNS = ("label", "iteration", "setting")
"""`diffmeg.eval.mqar_attention.table_rows` columns that become model, seed, step and the run's setting."""


def load(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise DiffmegError(f"cannot read results {path}: {exc}") from None


def _write_json(path: str, data: dict) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


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
        tokens_per_step = run["tokens_per_iter"]
        metrics = os.path.join(os.path.dirname(path), "metrics.jsonl")
        with open(metrics) as f:
            for line in f:
                record = json.loads(line)
                if "validation_lm_loss" in record:
                    lm.append(
                        {
                            "model": run["model"],
                            "seed": run["seed"],
                            "tokens": record["iteration"] * tokens_per_step,
                            "val_loss": record["validation_lm_loss"],
                        }
                    )
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


def _order(names, known=tuple(MODEL_NAMES)) -> list[str]:
    return sorted(set(names), key=lambda n: (known.index(n) if n in known else len(known), n))


def _color(model: str) -> str:
    """One colour per model in every plot; models without a name share the last."""
    return f"C{_order(MODEL_NAMES).index(model) if model in MODEL_NAMES else 9}"


def _seed_line(model: str, first: bool) -> dict:
    """matplotlib keywords of one seed's curve: the model's colour, its name on the first seed only."""
    return {"color": _color(model), "alpha": 0.8, "label": MODEL_NAMES.get(model, model) if first else None}


def _settings(results: dict) -> list[str]:
    declared = results.get("meta", {}).get("settings")
    found = {r["setting"] for r in results["mqar"]}
    if declared:
        return [s for s in declared if s in found] + sorted(found - set(declared))
    return sorted(found)


def _spread(values: list[float], digits: int = 3) -> str:
    """mean (min-max) of the seeds, or the one value."""
    if not values:
        return "-"
    mean = sum(values) / len(values)
    if len(values) == 1:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def _lr(lr: float) -> str:
    return f"{lr:g}"


def mqar_table(results: dict) -> str:
    """Per setting and model: chosen lr, seeds, final held-out accuracy, steps to 90% per seed."""
    chosen = best_lrs(results)
    runs = curves(results)
    lines = [
        "| setting | model | lr | seeds | final accuracy, mean (min-max) | steps to 90% per seed |",
        "|---|---|---|---|---|---|",
    ]
    for setting in _settings(results):
        for model in _order(m for m, s in runs if s == setting):
            seeds = runs[(model, setting)]
            finals = [rows[-1]["accuracy"] for _, rows in sorted(seeds.items())]
            reached = [steps_to(rows) for _, rows in sorted(seeds.items())]
            to90 = ", ".join("-" if s is None else str(s) for s in reached)
            name = MODEL_NAMES.get(model, model)
            lr = _lr(chosen[(model, setting)])
            lines.append(f"| {setting} | {name} | {lr} | {len(seeds)} | {_spread(finals)} | {to90} |")
    return "\n".join(lines)


def lr_table(results: dict) -> str:
    """The sweep: the sweep seed's final validation accuracy per (setting, model, lr)."""
    scores = sweep(results)
    lrs = sorted({lr for by_lr in scores.values() for lr in by_lr})
    lines = ["| setting | model | " + " | ".join(f"lr {_lr(lr)}" for lr in lrs) + " |"]
    lines.append("|---|---|" + "---|" * len(lrs))
    for setting in _settings(results):
        for model in _order(m for m, s in scores if s == setting):
            by_lr = scores[(model, setting)]
            cells = ["-" if lr not in by_lr else f"{by_lr[lr]:.3f}" for lr in lrs]
            lines.append(f"| {setting} | {MODEL_NAMES.get(model, model)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def lm_table(results: dict, columns: int = 5) -> str:
    """Validation loss by tokens seen, mean (min-max) over seeds, at up to `columns` evaluation points."""
    by_model: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in results["lm"]:
        by_model[r["model"]][r["tokens"]].append(r["val_loss"])
    tokens = sorted({t for points in by_model.values() for t in points})
    if len(tokens) > columns:  # evenly spaced, always the last
        step = (len(tokens) - 1) / (columns - 1)
        tokens = sorted({tokens[round(i * step)] for i in range(columns)})
    lines = ["| model | seeds | " + " | ".join(f"{t:,} tokens" for t in tokens) + " |"]
    lines.append("|---|---|" + "---|" * len(tokens))
    for model in _order(by_model):
        points = by_model[model]
        seeds = len({r["seed"] for r in results["lm"] if r["model"] == model})
        cells = [_spread(points.get(t, [])) for t in tokens]
        lines.append(f"| {MODEL_NAMES.get(model, model)} | {seeds} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ordered_settings(results: dict, rows: list[dict]) -> list[str]:
    """The settings of `rows`, in the run's order."""
    found = {r["setting"] for r in rows}
    order = _settings(results)
    return [s for s in order if s in found] + sorted(found - set(order))


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


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
    for setting in _ordered_settings(results, results["attention"]):
        for model in _order(m for s, m, _ in groups if s == setting):
            for layer in sorted(ly for s, m, ly in groups if (s, m) == (setting, model)):
                scales = groups[(setting, model, layer)]
                norm, raw = scales[True], scales[False]
                pair, noise = _mean([r["pair_mass"] for r in norm]), _mean([r["noise_mass"] for r in norm])
                lambdas = [r["lambda"] for r in norm if r["lambda"] is not None]
                cells = [
                    setting,
                    MODEL_NAMES.get(model, model),
                    str(layer),
                    str(len({r["seed"] for r in norm})),
                    _spread([r["pair_mass"] for r in norm]),
                    _spread([r["noise_mass"] for r in norm]),
                    f"{pair / noise:.2f}" if noise > 0 else "-",
                    f"{_mean([r['pair_mass'] for r in raw]):.3f}" if raw else "-",
                    f"{_mean([r['noise_mass'] for r in raw]):.3f}" if raw else "-",
                    f"{_mean(lambdas):.3f}" if lambdas else "-",
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
    for setting in _ordered_settings(results, results["outliers"]):
        for model in _order(m for s, m, _ in groups if s == setting):
            for kind in OUTLIER_KINDS:
                rows = groups.get((setting, model, kind))
                if not rows:
                    continue
                cells = [
                    setting,
                    MODEL_NAMES.get(model, model),
                    kind.replace("_", " "),
                    str(len(rows)),
                    _spread([r["top1"] for r in rows], 2),
                    f"{_mean([r['top10'] for r in rows]):.2f}",
                    f"{_mean([r['median'] for r in rows]):.3f}",
                    f"{_mean([r['top1'] / r['median'] if r['median'] > 0 else math.nan for r in rows]):.1f}",
                    _spread([r["kurtosis"] for r in rows], 1),
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
        parts += ["### Language modelling: validation loss", "", lm_table(results), ""]
    if results.get("attention"):
        title = "### MQAR: attention at the answers on the queried pair vs the rest of the context"
        parts += [title, "", attention_table(results), ""]
    if results.get("outliers"):
        parts += ["### MQAR: activation outliers on the held-out documents", "", outliers_table(results), ""]
    return "\n".join(parts)


# ----------------------------------------------------------------------------------------------------
# Plots


def plot(results: dict, out_dir: str) -> list[str]:
    """mqar_accuracy.png (held-out accuracy vs step, a panel per setting), lm_val_loss.png and, with the
    analyses, mqar_attention.png (normalised pair and noise masses per layer, a panel per setting)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    runs = curves(results)
    settings = _settings(results)
    if settings:
        fig, axes = plt.subplots(1, len(settings), figsize=(4.5 * len(settings), 3.6), squeeze=False)
        for ax, setting in zip(axes[0], settings, strict=True):
            for model in _order(m for m, s in runs if s == setting):
                for k, (_, rows) in enumerate(sorted(runs[(model, setting)].items())):
                    ax.plot(
                        [r["step"] for r in rows],
                        [r["accuracy"] for r in rows],
                        **_seed_line(model, first=k == 0),
                    )
            ax.axhline(TARGET, color="grey", linewidth=0.5, linestyle="--")
            ax.set(title=setting, xlabel="step", ylim=(0, 1.02))
            ax.legend(fontsize=8)
        axes[0][0].set_ylabel("held-out accuracy (one line per seed)")
        fig.tight_layout()
        written.append(os.path.join(out_dir, "mqar_accuracy.png"))
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    if results["lm"]:
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        for model in _order({r["model"] for r in results["lm"]}):
            seeds = sorted({r["seed"] for r in results["lm"] if r["model"] == model})
            for k, seed in enumerate(seeds):
                rows = sorted(
                    (r for r in results["lm"] if r["model"] == model and r["seed"] == seed),
                    key=lambda r: r["tokens"],
                )
                ax.plot(
                    [r["tokens"] for r in rows],
                    [r["val_loss"] for r in rows],
                    **_seed_line(model, first=k == 0),
                )
        ax.set(xlabel="training tokens", ylabel="validation loss (one line per seed)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        written.append(os.path.join(out_dir, "lm_val_loss.png"))
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    if results.get("attention"):
        written.append(os.path.join(out_dir, "mqar_attention.png"))
        plot_attention(results, written[-1])
    return written


def plot_attention(results: dict, path: str) -> None:
    """Per setting, the normalised mass on the queried pair (solid) and on the rest of the context
    (dashed) against the layer, mean over seeds, a colour per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results["attention"] if r["normalised"]]
    settings = _ordered_settings(results, rows)
    fig, axes = plt.subplots(1, len(settings), figsize=(4.5 * len(settings), 3.6), squeeze=False)
    for ax, setting in zip(axes[0], settings, strict=True):
        here = [r for r in rows if r["setting"] == setting]
        for model in _order(r["model"] for r in here):
            layers = sorted({r["layer"] for r in here if r["model"] == model})
            color = _color(model)
            for key, style in (("pair_mass", "-"), ("noise_mass", "--")):
                y = [
                    _mean([r[key] for r in here if (r["model"], r["layer"]) == (model, ly)]) for ly in layers
                ]
                name = f"{MODEL_NAMES.get(model, model)}: {key.split('_')[0]}"
                ax.plot(layers, y, style, color=color, marker="o", label=name)
        ax.set(title=setting, xlabel="layer")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("attention mass at the answers (normalised)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------
# Model shapes


def model_flags(dry_run: dict, layers: int, hidden: int) -> str:
    """pretrain_diff.py flags for a preset's architecture at another depth and width.

    `dry_run` is `pretrain_diff.py --model <preset> --dry-run`'s JSON. The head size is kept and the
    head and KV-group counts scale with the width, so the presets' DIFF / Transformer pairing (identical
    projections) holds at every size; the SwiGLU width is 8/3 of the hidden size (as the presets').
    """
    m = dry_run["model"]
    scale = hidden / m["hidden_size"]
    heads, groups = m["num_attention_heads"] * scale, m["num_query_groups"] * scale
    if heads != int(heads) or groups != int(groups) or heads < 1 or groups < 1:
        raise DiffmegError(
            f"hidden {hidden} cannot scale {m['preset']}'s {m['num_attention_heads']} heads and "
            f"{m['num_query_groups']} KV groups of {m['head_dim']} at hidden {m['hidden_size']}; "
            "pick a multiple of the preset's width per head"
        )
    ffn = max(64, int(4 * hidden * 2 / 3 / 64) * 64)
    return (
        f"--model {m['preset']} --num-layers {layers} --hidden-size {hidden} "
        f"--num-attention-heads {int(heads)} --num-query-groups {int(groups)} "
        f"--kv-channels {m['head_dim']} --ffn-hidden-size {ffn}"
    )


# ----------------------------------------------------------------------------------------------------
# The command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("collect", help="OUT/results.json and OUT/plots from a toy_compare.sh directory")
    c.add_argument("out")
    c.add_argument("--no-plot", action="store_true")
    b = sub.add_parser("best-lr", help="print the chosen learning rate of one model and setting")
    b.add_argument("results", help="a results.json, or a toy_compare.sh output directory (collected now)")
    b.add_argument("--model", required=True)
    b.add_argument("--setting", required=True)
    t = sub.add_parser("tables", help="print the markdown tables of docs/results.md")
    t.add_argument("results")
    f = sub.add_parser("model-flags", help="flags for a preset at another size (dry-run JSON on stdin)")
    f.add_argument("--layers", type=int, required=True)
    f.add_argument("--hidden", type=int, required=True)
    return p.parse_args(argv)


@cli_errors
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.command == "collect":
        results = collect(args.out)
        path = os.path.join(args.out, "results.json")
        _write_json(path, results)
        written = [path]
        if not args.no_plot:
            os.makedirs(os.path.join(args.out, "plots"), exist_ok=True)
            written += plot(results, os.path.join(args.out, "plots"))
        counts = ", ".join(f"{len(results[k])} {k} rows" for k in ("mqar", "lm", "attention", "outliers"))
        print(f"{counts}; wrote {', '.join(written)}")
    elif args.command == "model-flags":
        try:
            dry_run = json.load(sys.stdin)
        except json.JSONDecodeError:
            raise DiffmegError("model-flags reads `pretrain_diff.py --model X --dry-run` on stdin") from None
        print(model_flags(dry_run, args.layers, args.hidden))
    elif args.command == "best-lr":
        chosen = best_lrs(collect(args.results) if os.path.isdir(args.results) else load(args.results))
        if (args.model, args.setting) not in chosen:
            raise DiffmegError(f"{args.results} has no validation result for {args.model} on {args.setting}")
        print(_lr(chosen[(args.model, args.setting)]))
    else:
        results = load(args.results)
        for key in ("mqar", "lm"):
            if not isinstance(results.get(key), list):
                raise DiffmegError(f"{args.results} has no '{key}' list; is it a toy_compare results.json?")
        if any(not math.isfinite(r["accuracy"]) for r in results["mqar"]):
            raise DiffmegError(f"{args.results} holds a non-finite accuracy")
        print(tables(results))


if __name__ == "__main__":
    main()
