"""The runtime layer: storage, attention, the observed prefill, eviction during generation, and the entry points.

It runs the model and holds the cache; it asks the selection layer which entries to keep.
Nothing here imports the harness.
"""
