"""The paged KV cache: block tables, the prefix cache and the cache window."""
