"""megatron-core <-> Hugging Face conversion: DIFF <-> DiffLlama, the Transformer baseline <-> Llama
(docs/conversion.md).

layout.py (sizes both formats share), mapping.py (tensors, pure), hf_config.py (config.json and what
DiffLlama / Llama can express, pure), tokenizer_export.py (cl100k_base as a fast tokenizer),
checkpoint_io.py (streaming reads and writes of both formats), hf_import.py (a Hugging Face folder as
resolved arguments and a single-rank model, without writing a checkpoint).
"""
