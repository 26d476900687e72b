"""The selection layer: which entries to keep, from observations alone.

The observation contract, budgets, allocators, projections, protection, policies, scorers and
the retention gates with their checkpoints. Nothing here imports attention, the cache or the harness.
"""
