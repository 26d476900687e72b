"""Eviction while a cache grows: a bounded cache held at its budget during chunked prefill and generation."""
