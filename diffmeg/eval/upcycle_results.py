"""The results of examples/upcycle.sh: a pretrained Transformer continued as itself and upcycled into DIFF
V2 (tools/convert_checkpoint.py upcycle), both for the same tokens and seeds.

`collect(out)` reads the example's output directory into one JSON-able dict (its meta.json, every run's
metrics.jsonl); `tables(results)` prints the markdown of docs/results.md's upcycling section from it (a
test keeps the page equal to the committed docs/results/upcycle.json); `plot` draws the validation-loss
curves. tools/upcycle_results.py is the command line.

Layout of the output directory (written by the example): meta.json, pretrain/metrics.jsonl (the source
Transformer), continue/<model>-s<seed>/metrics.jsonl and run.json ({"model", "seed", "tokens_per_iter"}).
"""

from __future__ import annotations

import glob
import os

from diffmeg.errors import DiffmegError
from diffmeg.eval.toy_compare import load, read_metrics, val_loss_table

MODELS = {"transformer": "Transformer (continued)", "diff2": "DIFF V2 (upcycled)"}
"""Run names and how the tables and plots name them, in order."""
COLORS = {"transformer": "tab:gray", "diff2": "tab:blue"}


def collect(out: str) -> dict:
    """results.json's content from an examples/upcycle.sh output directory (every finished run in it)."""
    meta_path = os.path.join(out, "meta.json")
    if not os.path.isfile(meta_path):
        raise DiffmegError(f"{out} has no meta.json: not an examples/upcycle.sh output directory")
    meta = load(meta_path)
    pretrain = read_metrics(os.path.join(out, "pretrain", "metrics.jsonl"))
    validation = [r["validation_lm_loss"] for r in pretrain if "validation_lm_loss" in r]
    val, first, runs = [], [], []
    for path in sorted(glob.glob(os.path.join(out, "continue", "*", "run.json"))):
        run = load(path)
        records = read_metrics(os.path.join(os.path.dirname(path), "metrics.jsonl"))
        key = {"model": run["model"], "seed": run["seed"]}
        for record in records:
            if "validation_lm_loss" in record:
                tokens = record["iteration"] * run["tokens_per_iter"]
                val.append({**key, "tokens": tokens, "val_loss": record["validation_lm_loss"]})
            elif record.get("iteration") == 1:
                first.append({**key, "loss": record["lm_loss"]})
        runs.append(run)
    return {
        "meta": {**meta, "runs": runs},
        "pretrain": {"final_val_loss": validation[-1] if validation else None},
        "first_step": first,
        "val": val,
    }


def _curves(results: dict) -> dict[str, dict[int, dict[int, float]]]:
    """model -> seed -> tokens -> validation loss."""
    curves: dict[str, dict[int, dict[int, float]]] = {}
    for row in results["val"]:
        curves.setdefault(row["model"], {}).setdefault(row["seed"], {})[row["tokens"]] = row["val_loss"]
    return curves


def paired_table(results: dict) -> str:
    """Per seed: the first step's training loss of both (the same batch: equal by construction) and the
    final validation losses with their difference (DIFF V2 minus Transformer)."""
    curves = _curves(results)
    first = {(r["model"], r["seed"]): r["loss"] for r in results["first_step"]}
    seeds = sorted(set(curves.get("transformer", {})) & set(curves.get("diff2", {})))
    lines = [
        "| seed | first-step loss, Transformer | first-step loss, DIFF V2 | final validation loss, "
        "Transformer | final validation loss, DIFF V2 | DIFF V2 - Transformer |",
        "|---|---|---|---|---|---|",
    ]
    for seed in seeds:
        t, d = curves["transformer"][seed], curves["diff2"][seed]
        last = max(set(t) & set(d))
        f_t, f_d = first.get(("transformer", seed)), first.get(("diff2", seed))
        fmt = lambda v: "-" if v is None else f"{v:.6f}"
        lines.append(
            f"| {seed} | {fmt(f_t)} | {fmt(f_d)} | {t[last]:.4f} | {d[last]:.4f} | {d[last] - t[last]:+.4f} |"
        )
    return "\n".join(lines)


def tables(results: dict) -> str:
    """The markdown sections docs/results.md shows for the upcycling run."""
    for key in ("meta", "first_step", "val"):
        if key not in results:
            raise DiffmegError(f"not an upcycle results file: no {key!r}")
    sections = [
        (
            "Upcycling: validation loss while continuing (mean (min-max) over seeds)",
            val_loss_table(results["val"], MODELS),
        ),
        ("Upcycling: per seed, first step and final validation loss", paired_table(results)),
    ]
    return "\n\n".join(f"### {title}\n\n{body}" for title, body in sections if body) + "\n"


def plot(results: dict, path: str) -> str:
    """Validation loss vs tokens of continued training, one line per seed, a colour per model."""
    from diffmeg.eval.toy_compare_plots import plot_val_loss  # matplotlib: only when plotting

    plot_val_loss(results["val"], path, xlabel="tokens of continued training", names=MODELS, color=COLORS.get)
    return path
