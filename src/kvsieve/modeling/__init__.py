"""The model layer: what kvsieve reads from a `transformers` model, below selection and runtime.

Its layers and geometry (`architecture`), its rotary embedding (`rotary`), a hash of its weights
(`fingerprint`) and the retention-gate network trained for it (`gates`). Nothing here chooses
entries or runs attention.
"""
