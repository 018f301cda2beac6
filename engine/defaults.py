"""Defaults that more than one module relies on, stated once."""

BLOCK_SIZE = 16  # tokens per KV block
PREFILL_CHUNK = 512  # prompt tokens per forward pass
DEFAULT_CONTEXT = 4096  # a chat's context when the user names none (capped by the model's maximum)
KV_DIR_ENV = "STOWAGE_KV_DIR"  # where evicted conversations' KV cache is kept (engine/serving/kv_store.py)
