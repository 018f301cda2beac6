"""Models from the Hugging Face Hub, through `huggingface_hub`: search (client.py), a repository's files grouped
by quantization (files.py), a fit verdict per file from its header alone, read by HTTP range requests (header.py,
verdict.py), and downloads into the Hugging Face cache, resumed and checked by hash (download.py).

HF_ENDPOINT, HF_TOKEN and the stored login (`hf auth login`) are honoured as huggingface_hub honours them."""
