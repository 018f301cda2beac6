"""Model files and formats: Hugging Face folders (config.json, safetensors) and GGUF files, read from headers and
memory-mapped; the model-layout record; the models already on this machine. `source` opens any model path."""
