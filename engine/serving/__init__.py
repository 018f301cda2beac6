"""Serving many sequences on one engine: the scheduler's step (continuous batching, the one generation loop), the
prefix pool of cached conversations and the KV store on disk."""
