"""Data pipeline: cl100k tokenizer, preprocessing to indexed datasets, blends, length upsampling,
and the builtin corpus. See docs/data.md."""
