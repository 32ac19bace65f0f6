"""The toy comparison's figures (tools/toy_compare_results.py collect): held-out MQAR accuracy and validation
loss against training, one line per seed, and the attention at the answers per layer. `plot_val_loss` draws
the upcycling results' validation loss too (`diffmeg.eval.upcycle_results`)."""

from __future__ import annotations

import os
from collections.abc import Callable

from diffmeg.eval.plotting import figure, save_png
from diffmeg.eval.toy_compare import MODEL_NAMES, TARGET, curves, mean, model_order, setting_order


def _color(model: str) -> str:
    """One colour per model in every plot; models without a name share the last."""
    return f"C{model_order(MODEL_NAMES).index(model) if model in MODEL_NAMES else 9}"


def _seed_line(model: str, first: bool, names: dict[str, str] = MODEL_NAMES, color=_color) -> dict:
    """matplotlib keywords of one seed's curve: the model's colour, its name on the first seed only."""
    return {"color": color(model), "alpha": 0.8, "label": names.get(model, model) if first else None}


def plot(results: dict, out_dir: str) -> list[str]:
    """mqar_accuracy.png (held-out accuracy vs step, a panel per setting), lm_val_loss.png and, with the
    analyses, mqar_attention.png (normalised pair and noise masses per layer, a panel per setting)."""
    written = []
    runs = curves(results)
    settings = setting_order(results)
    if settings:
        fig = figure((4.5 * len(settings), 3.6))
        axes = fig.subplots(1, len(settings), squeeze=False)
        for ax, setting in zip(axes[0], settings, strict=True):
            for model in model_order(m for m, s in runs if s == setting):
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
        written.append(os.path.join(out_dir, "mqar_accuracy.png"))
        save_png(fig, written[-1], dpi=110)
    if results["lm"]:
        written.append(os.path.join(out_dir, "lm_val_loss.png"))
        plot_val_loss(results["lm"], written[-1], xlabel="training tokens")
    if results.get("attention"):
        written.append(os.path.join(out_dir, "mqar_attention.png"))
        plot_attention(results, written[-1])
    return written


def plot_val_loss(
    rows: list[dict],
    path: str,
    *,
    xlabel: str,
    names: dict[str, str] = MODEL_NAMES,
    color: Callable[[str], str] = _color,
) -> None:
    """Validation loss against tokens from rows of model, seed, tokens and val_loss: one line per seed, a
    colour per model (`names` names them, in order)."""
    fig = figure((5.5, 3.6))
    ax = fig.add_subplot()
    for model in model_order({r["model"] for r in rows}, tuple(names)):
        seeds = sorted({r["seed"] for r in rows if r["model"] == model})
        for k, seed in enumerate(seeds):
            mine = sorted(
                (r for r in rows if (r["model"], r["seed"]) == (model, seed)), key=lambda r: r["tokens"]
            )
            ax.plot(
                [r["tokens"] for r in mine],
                [r["val_loss"] for r in mine],
                **_seed_line(model, k == 0, names, color),
            )
    ax.set(xlabel=xlabel, ylabel="validation loss (one line per seed)")
    ax.legend(fontsize=8)
    save_png(fig, path, dpi=110)


def plot_attention(results: dict, path: str) -> None:
    """Per setting, the normalised mass on the queried pair (solid) and on the rest of the context
    (dashed) against the layer, mean over seeds, a colour per model."""
    rows = [r for r in results["attention"] if r["normalised"]]
    settings = setting_order(results, rows)
    fig = figure((4.5 * len(settings), 3.6))
    axes = fig.subplots(1, len(settings), squeeze=False)
    for ax, setting in zip(axes[0], settings, strict=True):
        here = [r for r in rows if r["setting"] == setting]
        for model in model_order(r["model"] for r in here):
            layers = sorted({r["layer"] for r in here if r["model"] == model})
            color = _color(model)
            for key, style in (("pair_mass", "-"), ("noise_mass", "--")):
                y = [mean([r[key] for r in here if (r["model"], r["layer"]) == (model, ly)]) for ly in layers]
                name = f"{MODEL_NAMES.get(model, model)}: {key.split('_')[0]}"
                ax.plot(layers, y, style, color=color, marker="o", label=name)
        ax.set(title=setting, xlabel="layer")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("attention mass at the answers (normalised)")
    save_png(fig, path, dpi=110)
