"""The selection layer: which entries to keep, from observations alone.

The observation contract, budgets, allocators, projections, protection, policies, scorers and the
retention-gate checkpoints a learned scorer loads. What it reads from a model (architecture, rotary
embedding, the gate network) is `kvsieve.modeling`'s. Nothing here imports attention, the cache or the harness.
"""
