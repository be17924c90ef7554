"""Model loading, Llama-family modules, attention backends and the tokenizer."""
