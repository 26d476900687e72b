"""Policy specs every test can run on a tiny random model."""

from kvsieve.selection.scorers import SCORERS

#: Every scorer as a spec; trimkv reads untrained gates (kvsieve ships trained ones only for real models).
#: kvzip asks the model to repeat its prompt, which needs the tokenizer: `tests/test_kvzip.py` runs it
#: through the same checks (every allocator against the masked reference, batches).
SCORER_SPECS = [f"{name}:gates=untrained" if name == "trimkv" else name for name in SCORERS if name != "kvzip"]
