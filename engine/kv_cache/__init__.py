"""The KV caches: the paged pool, its block manager (block tables, the prefix cache), the cache
window, and the contiguous cache kept for tests and single-sequence scoring."""
