"""Reading trained checkpoints (or Hugging Face folders) and measuring them: long-context NLL
(`long_context`), lm-evaluation-harness (`harness`), multi-needle retrieval (`needle`, `needle_eval`),
MQAR accuracy (`mqar`) and the paper's analyses (`attention_scores`, `activation_stats`, `quantize`).
`common` loads the checkpoints a tool names and writes its outputs (the flags every tool shares are
`diffmeg.cli`), `plotting` draws the figures, `capture` reads attention out of a loaded model. See
docs/evaluation.md and docs/analysis.md."""
