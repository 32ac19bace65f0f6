"""Evaluation of trained checkpoints: long-context NLL by position (tools/eval_long_context.py) and
shared plotting. See docs/evaluation.md."""
