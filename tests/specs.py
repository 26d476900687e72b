"""Policy specs every test can run on a tiny random model."""

from kvsieve.selection.scorers import SCORERS

#: Every scorer as a spec; trimkv reads untrained gates (kvsieve ships trained ones only for real models).
SCORER_SPECS = [f"{name}:gates=untrained" if name == "trimkv" else name for name in SCORERS]
