"""megatron-core <-> Hugging Face DiffLlama conversion (docs/conversion.md).

layout.py (sizes both formats share), mapping.py (tensors, pure), hf_config.py (config.json and what
DiffLlama can express, pure), tokenizer_export.py (cl100k_base as a fast tokenizer), checkpoint_io.py
(the only I/O: streaming reads and writes of both formats).
"""
