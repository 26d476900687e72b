"""The research harness: model loading, data, evaluation, comparisons, reports, gate training and the CLI.

It builds on the library (`kvsieve.selection`, `kvsieve.runtime`); `import kvsieve` never loads it.
"""
