"""Text: the tokenizer (tokenizer.json or a GGUF file's vocabulary) and chat templates in a jinja2 sandbox."""
