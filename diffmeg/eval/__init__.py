"""Reading trained checkpoints (or Hugging Face folders) and measuring them: long-context NLL
(`long_context`), multi-needle retrieval (`needle`, `needle_eval`), MQAR accuracy (`mqar`) and the
paper's analyses (`attention_scores`, `activation_stats`, `quantize`). `common` loads the checkpoints a
tool names, `capture` reads attention out of a loaded model. See docs/evaluation.md and docs/analysis.md."""
