"""The toy comparison's figures (tools/toy_compare_results.py collect): held-out MQAR accuracy and validation
loss against training, one line per seed, and the attention at the answers per layer."""

from __future__ import annotations

import os

from diffmeg.eval.plotting import save_png
from diffmeg.eval.toy_compare import (
    MODEL_NAMES,
    TARGET,
    curves,
    mean,
    model_order,
    setting_order,
    settings_in,
)


def _color(model: str) -> str:
    """One colour per model in every plot; models without a name share the last."""
    return f"C{model_order(MODEL_NAMES).index(model) if model in MODEL_NAMES else 9}"


def _seed_line(model: str, first: bool) -> dict:
    """matplotlib keywords of one seed's curve: the model's colour, its name on the first seed only."""
    return {"color": _color(model), "alpha": 0.8, "label": MODEL_NAMES.get(model, model) if first else None}


def plot(results: dict, out_dir: str) -> list[str]:
    """mqar_accuracy.png (held-out accuracy vs step, a panel per setting), lm_val_loss.png and, with the
    analyses, mqar_attention.png (normalised pair and noise masses per layer, a panel per setting)."""
    import matplotlib  # optional dependency, for the plots only

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): pyplot picks its backend on import

    written = []
    runs = curves(results)
    settings = setting_order(results)
    if settings:
        fig, axes = plt.subplots(1, len(settings), figsize=(4.5 * len(settings), 3.6), squeeze=False)
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
        fig.tight_layout()
        written.append(os.path.join(out_dir, "mqar_accuracy.png"))
        save_png(fig, written[-1], dpi=110)
        plt.close(fig)
    if results["lm"]:
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        for model in model_order({r["model"] for r in results["lm"]}):
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
        save_png(fig, written[-1], dpi=110)
        plt.close(fig)
    if results.get("attention"):
        written.append(os.path.join(out_dir, "mqar_attention.png"))
        plot_attention(results, written[-1])
    return written


def plot_attention(results: dict, path: str) -> None:
    """Per setting, the normalised mass on the queried pair (solid) and on the rest of the context
    (dashed) against the layer, mean over seeds, a colour per model."""
    import matplotlib  # optional dependency, for the plots only

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): pyplot picks its backend on import

    rows = [r for r in results["attention"] if r["normalised"]]
    settings = settings_in(results, rows)
    fig, axes = plt.subplots(1, len(settings), figsize=(4.5 * len(settings), 3.6), squeeze=False)
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
    fig.tight_layout()
    save_png(fig, path, dpi=110)
    plt.close(fig)
