"""The paper's analyses of trained checkpoints: where attention goes (tools/attention_scores.py) and
activation outliers (tools/activation_stats.py). See docs/analysis.md."""
