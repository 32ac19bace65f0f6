"""megatron-core <-> Hugging Face conversion: DIFF <-> DiffLlama, the Transformer baseline <-> Llama
(docs/conversion.md).

layout.py (sizes both formats share), mapping.py (tensors, pure, one table entry per architecture),
hf_config.py (config.json and what DiffLlama / Llama can express, pure), tokenizer_export.py (cl100k_base
as a fast tokenizer). I/O, all streaming: checkpoint_io.py (reading both formats), output_dir.py (the
output folder: what `--overwrite` replaces, written atomically), mcore_writer.py (a dist checkpoint
written one layer at a time), safetensors_io.py (safetensors read and written one tensor at a time),
hf_import.py (a Hugging Face folder as resolved arguments and a single-rank model, without writing a
checkpoint).
"""
