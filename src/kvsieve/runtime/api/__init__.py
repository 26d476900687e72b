"""The entry points: `compress`, `bounded_cache`, `generate`, `apply`, `EvictionConfig` and `evictions`."""
