"""Stowage engine: loading, planning, the paged KV cache and generation. Never imports Qt."""
