r"""lm-evaluation-harness on diffmeg checkpoints (the DIFF paper's zero-shot table), side by side.

    python tools/eval_harness.py --load ckpt/diff3b ckpt/transformer3b --tasks paper --dtype bfloat16
    python tools/eval_harness.py --load ckpt/diff3b --tasks hellaswag arc_easy --num-fewshot 5 --limit 200
    python tools/eval_harness.py --load ckpt/tiny --tasks my_task.yaml     # a task YAML of your own

--tasks takes lm-eval task or group names, task YAML files, and the preset `paper` (arc_challenge,
arc_easy, boolq, hellaswag, openbookqa, piqa, winogrande). The checkpoint (any TP/PP layout) or Hugging
Face folder is loaded once as diffmeg's single-rank model and handed to lm-eval's Python API in memory:
nothing is exported. lm-eval downloads the tasks' datasets unless they are cached (HF_DATASETS_OFFLINE=1
for an offline machine). Writes harness_results.json (every metric with its stderr, per checkpoint),
harness_results.csv (label, task, metric, value) and with --log-samples harness_samples.jsonl. Needs
the `harness` extra: pip install 'diffmeg[harness]'. See docs/evaluation.md.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from diffmeg import cli  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.parser(__doc__, output_dir="harness_eval", plot=False, tokenizer=True)
    p.add_argument("--tasks", nargs="+", default=["paper"], help="task names, task YAML files or 'paper'")
    p.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples (default: the task's)")
    p.add_argument("--limit", type=float, default=None, help="documents per task, or a fraction below 1")
    p.add_argument("--include-path", default=None, help="a directory of extra task YAMLs")
    p.add_argument("--batch-size", type=int, default=8, help="requests per forward pass")
    p.add_argument("--max-length", type=int, default=None, help="context tokens (default: training length)")
    p.add_argument("--max-gen-toks", type=int, default=256, help="tokens generated per generation request")
    p.add_argument("--log-samples", action="store_true", help="also write every request and its score")
    return cli.parse(p, argv)


def measure(args: argparse.Namespace) -> dict:
    from diffmeg.eval.harness import HarnessConfig, run_harness

    return run_harness(cli.config(HarnessConfig, args))


def report(summary: dict, args: argparse.Namespace) -> None:
    """One row per metric; the standard errors and sample lengths stay in harness_results.json."""
    cli.print_table(
        [
            {"checkpoint": label, "task": task, "metric": metric, "value": value}
            for label, ckpt in summary["checkpoints"].items()
            for task, metrics in ckpt["results"].items()
            for metric, value in metrics.items()
            if not metric.endswith("_stderr") and metric != "sample_len"
        ]
    )


main = cli.measurement_main(parse_args, measure, report)


if __name__ == "__main__":
    main()
